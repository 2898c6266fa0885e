"""Do SmolLM2's tool arguments and JSON outputs hold to their schemas? 20 tool and schema prompts (issue
#37), and 2 that invite long numbers, greedy, on a server with strict schemas turned off
(``--disable-strict-schemas``: JSON Schema's own meaning, undeclared keys allowed) and on one with the
default (strict), in one run; ``--against REV`` adds the default of another revision (a before/after):

    python benchmarks/structured_args.py [--max-tokens 200] [--against REV]

Per side, the answers that carry keys their schema does not declare, that ran to ``max_tokens``
(finish_reason "length"), that do not parse (arguments or content that are not JSON, or no call where
``tool_choice`` forces one), and that hold a number of more than 17 significant digits (more than a float64
keeps; rank 0 stops numbers there, workers/json_numbers.py). None of the schemas sets
``additionalProperties``, as most clients' schemas (LangChain's, instructor's for nested models, hand-written
tools) do not. A named ``tool_choice`` is one call on both sides (not a setting); the "calls" column counts
the calls of the tool answers.
"""

from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor

from _revision import revision_package  # this folder, on the path of a script run from it
from llmbus.testing import Server
from llmbus.testing.http import post

S = {"type": "string", "maxLength": 40}
WEATHER = {"type": "object", "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": S}, "required": ["tz"]}
SEARCH = {"type": "object", "properties": {"query": S, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
          "required": ["query"]}
EMAIL = {"type": "object", "properties": {"to": S, "subject": S, "body": {"type": "string", "maxLength": 80}},
         "required": ["to", "subject"]}
BOOK = {"type": "object", "properties": {"restaurant": S, "people": {"type": "integer", "minimum": 1, "maximum": 12},
                                         "time": S}, "required": ["restaurant", "people"]}


def tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [tool("get_weather", "Current weather in a city", WEATHER),
         tool("get_time", "Current time in a timezone", TIME),
         tool("search", "Search the web", SEARCH), tool("send_email", "Send an email", EMAIL),
         tool("book_table", "Book a restaurant table", BOOK)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# (prompt, tool_choice) for the tool prompts; (prompt, schema) for the schema prompts
TOOL_CASES = [
    ("What is the weather in Paris?", "required"), ("What time is it in Tokyo?", "required"),
    ("Search for the best pizza in Naples.", "required"), ("Email Bob that the meeting moved to 3pm.", "required"),
    ("Book a table for four at Chez Marie tonight.", "required"), ("Is it raining in London?", NAMED),
    ("I am going to Rome tomorrow.", NAMED), ("How cold is Oslo in fahrenheit?", "auto"),
    ("What time is it in New York and what is the weather there?", "required"),
    ("Find news about the Mars rover.", "auto"),
]
SCHEMA_CASES = [
    ("Describe a city as JSON: its name, country and population in millions.",
     {"type": "object", "properties": {"name": S, "country": S, "population_millions": {"type": "number"}},
      "required": ["name", "country", "population_millions"]}),
    ("Give a recipe as JSON with a title and a list of ingredients.",
     {"type": "object", "properties": {"title": S, "ingredients": {"type": "array", "items": S, "maxItems": 6}},
      "required": ["title", "ingredients"]}),
    ("Describe a person as JSON with their name, age and email.",
     {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "email": S}, "required": ["name", "age"]}),
    ("Give a product as JSON: its name, price and whether it is in stock.",
     {"type": "object", "properties": {"name": S, "price": {"type": "number"}, "in_stock": {"type": "boolean"}},
      "required": ["name", "price", "in_stock"]}),
    ("Describe a movie as JSON: title, year and director.",
     {"type": "object", "properties": {"title": S, "year": {"type": "integer"}, "director": S},
      "required": ["title", "year"]}),
    ("Give the address of a museum as JSON.",
     {"type": "object", "properties": {"museum": S, "address": {
         "type": "object", "properties": {"street": S, "city": S}, "required": ["street", "city"]}},
      "required": ["museum", "address"]}),
    ("Rate a restaurant as JSON: its name, a score from 1 to 5 and a short comment.",
     {"type": "object", "properties": {"name": S, "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                       "comment": S}, "required": ["name", "score"]}),
    ("Give the coordinates of Paris as JSON.",
     {"type": "object", "properties": {"latitude": {"type": "number"}, "longitude": {"type": "number"}},
      "required": ["latitude", "longitude"]}),
    ("List two tasks as JSON, each with a title and a priority.",
     {"type": "object", "properties": {"tasks": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {"title": S, "priority": {"enum": ["low", "high"]}},
         "required": ["title", "priority"]}}}, "required": ["tasks"]}),
    ("Describe the weather today as JSON: temperature in celsius and conditions.",
     {"type": "object", "properties": {"temperature": {"type": "number"}, "conditions": S},
      "required": ["temperature", "conditions"]}),
]
# numbers: SmolLM2 wrote pi's digits until max_tokens, and an electron's mass with 18 significant digits
NUMBER_CASES = [
    ("Give the value of pi as JSON, with as many digits as you know.",
     {"type": "object", "properties": {"pi": {"type": "number"}}, "required": ["pi"]}),
    ("Give the mass of an electron in kilograms as JSON.",
     {"type": "object", "properties": {"mass_kg": {"type": "number"}}, "required": ["mass_kg"]}),
]
CASES = TOOL_CASES + SCHEMA_CASES + NUMBER_CASES
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NUMBER = re.compile(r"-?[0-9][0-9.]*")


def undeclared(value, schema: dict) -> bool:
    """Whether ``value`` holds an object key its (sub)schema does not declare."""
    if isinstance(value, dict) and isinstance(schema, dict):
        props = schema.get("properties", {})
        return any(k not in props or undeclared(v, props[k]) for k, v in value.items())
    if isinstance(value, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        return any(undeclared(v, schema["items"]) for v in value)
    return False


def long_number(text: str | None) -> bool:
    """Whether ``text`` holds a number (outside strings) of more than 17 significant digits."""
    mantissas = _NUMBER.findall(_STRING.sub('""', text or ""))  # an exponent's digits are a match of their own
    return any(len(m.lstrip("-").replace(".", "").lstrip("0")) > 17 for m in mantissas)


def _loads(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def run_case(url: str, case: tuple, max_tokens: int) -> dict:
    prompt, spec = case
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    is_tool = not (isinstance(spec, dict) and "properties" in spec)
    if is_tool:
        body |= {"tools": TOOLS, "tool_choice": spec}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": spec}}
    status, _, answer = post(url + "/v1/chat/completions", body, timeout=600)
    if status != 200:
        raise SystemExit(f"{prompt!r}: {status} {answer}")
    choice = answer["choices"][0]
    out = {"length": choice["finish_reason"] == "length", "extra": False, "bad": False, "calls": 0,
           "long": False}
    if is_tool:
        calls = choice["message"].get("tool_calls") or []
        out["calls"] = len(calls)
        out["bad"] = spec != "auto" and not calls
        for call in calls:
            out["long"] |= long_number(call["function"]["arguments"])
            args = _loads(call["function"]["arguments"])
            out["bad"] |= args is None
            out["extra"] |= undeclared(args, SCHEMAS[call["function"]["name"]])
        out["text"] = json.dumps([[c["function"]["name"], c["function"]["arguments"]] for c in calls])
        if not calls:
            out["text"] = choice["message"]["content"]
    else:
        value = _loads(choice["message"]["content"])
        out["long"] = long_number(choice["message"]["content"])
        out["bad"], out["extra"] = value is None, undeclared(value, spec)
        out["text"] = choice["message"]["content"]
    return out


def side(args, extra_flags: list[str], env: dict[str, str] | None = None) -> list[dict]:
    server = Server(["--max-total-tokens", "2048", *extra_flags], env=env)
    try:
        with ThreadPoolExecutor(len(CASES)) as pool:
            return list(pool.map(lambda c: run_case(server.url, c, args.max_tokens), CASES))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--verbose", action="store_true", help="print every answer")
    parser.add_argument("--against", default=None, help="a git revision whose default (strict) side to add")
    args = parser.parse_args()
    rows = [("strict off (--disable-strict-schemas)", side(args, ["--disable-strict-schemas"]))]
    if args.against:
        with revision_package(args.against, "structured_args.py") as package:
            rows.append((f"strict, {args.against}"[:40], side(args, [], env={"PYTHONPATH": str(package)})))
    rows.append(("strict (default)", side(args, [])))
    n = len(CASES)
    print(f"{'':40} {'undeclared keys':>16} {'ran to max_tokens':>18} {'unparseable':>12} "
          f"{'over 17 digits':>15} {'calls':>6}")
    for name, results in rows:
        print(f"{name:40} {sum(r['extra'] for r in results):>13}/{n} {sum(r['length'] for r in results):>15}/{n} "
              f"{sum(r['bad'] for r in results):>9}/{n} {sum(r['long'] for r in results):>12}/{n} "
              f"{sum(r['calls'] for r in results):>6}")
        if args.verbose:
            for case, r in zip(CASES, results):
                print(f"   {case[0][:40]!r:44} {r['text'][:160]}")


if __name__ == "__main__":
    main()
