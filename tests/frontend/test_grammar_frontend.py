"""Grammars through the frontend, against llmbus.testing's fake scheduler (real zmq and HTTP): what reaches
the scheduler for each shape of TGI's ``grammar`` and OpenAI's ``response_format``, and TGI's error texts
for a grammar that is turned off, invalid or does not compile. Nothing invalid reaches the scheduler.
"""

from __future__ import annotations

import json

import pytest

from llmbus.bus.messages import Grammar
from llmbus.testing.fake_scheduler import chat, last_rid

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}
# what reaches the scheduler by default: the schema closed to its declared properties (strict_schema.py)
COMPACT = json.dumps(SCHEMA | {"additionalProperties": False}, separators=(",", ":"))


def generate(fe, grammar, **parameters):
    return fe.post("/generate", {"inputs": "hi", "parameters": {"grammar": grammar, **parameters}})


@pytest.mark.parametrize("grammar, expected", [
    ({"type": "json", "value": SCHEMA}, Grammar("json_schema", COMPACT)),
    ({"type": "json_object", "value": json.dumps(SCHEMA)}, Grammar("json_schema", COMPACT)),  # a JSON string
    ({"type": "json_schema", "value": {"name": "person", "schema": SCHEMA}}, Grammar("json_schema", COMPACT)),
    ({"type": "json", "value": {"type": "array", "items": {"enum": [1, 2]}}},  # no `properties`: fine here
     Grammar("json_schema", '{"type":"array","items":{"enum":[1,2]}}')),
    ({"type": "regex", "value": "[0-9]{3}-[a-z]+"}, Grammar("regex", "[0-9]{3}-[a-z]+")),
    ({"type": "lark", "value": 'start: "yes" | "no"'}, Grammar("lark", 'start: "yes" | "no"')),
])
def test_tgi_grammar_reaches_the_scheduler(make_frontend, grammar, expected):
    fe = make_frontend()
    status, _, body = generate(fe, grammar)
    assert status == 200, body
    assert fe.sched.adds[last_rid(fe)].grammar == expected


@pytest.mark.parametrize("grammar, error", [
    ({"type": "regex", "value": "a(b"}, "Input validation error: grammar is not valid: "),
    ({"type": "regex", "value": 7}, "Input validation error: grammar is not supported"),
    ({"type": "json", "value": "{not json"}, "Input validation error: grammar is not valid: "),
    ({"type": "json", "value": [1]}, "Input validation error: grammar is not supported"),
    ({"type": "json", "value": {"type": "object", "properties": {"a": {"minimum": "x"}}}},
     "Input validation error: grammar is not valid: 'x' is not of type 'number'"),
    ({"type": "json", "value": {"$ref": "#/$defs/missing"}},
     "Input validation error: cannot compile regex from schema: "),
    ({"type": "lark", "value": "start: undefined_rule"}, "Input validation error: grammar is not valid: "),
    ({"type": "ebnf", "value": "root ::= ("}, "Input validation error: grammar is not valid: "),
    ({"type": "yaml", "value": "x"}, "Failed to deserialize the JSON body into the target type: parameters.grammar: "
                                     "unknown variant `yaml`"),
    ({"type": "regex"}, "Failed to deserialize the JSON body into the target type: parameters.grammar: missing "
                        "field `value`"),
])
def test_bad_grammars_get_tgi_texts(make_frontend, grammar, error):
    fe = make_frontend()
    status, _, body = generate(fe, grammar)
    assert status == 422 and body["error"].startswith(error) and body["error_type"] == "validation", body
    assert fe.sched.adds == {}
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    assert status == 200, "the frontend keeps serving"


def test_disable_grammar_support(make_frontend, make_fe):
    fe = make_frontend(disable_grammar_support=True)
    status, _, body = generate(fe, {"type": "regex", "value": "a+"})
    assert (status, body) == (422, {"error": "Input validation error: grammar is not supported",
                                    "error_type": "validation"})
    chat_fe = make_fe(disable_grammar_support=True)
    status, _, body = chat(chat_fe, response_format={"type": "json_object"})
    assert status == 422 and body["error"]["message"] == "Input validation error: grammar is not supported"
    assert chat_fe.sched.adds == {}


@pytest.mark.parametrize("response_format, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, Grammar("json_schema", '{"type":"object"}')),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
     Grammar("json_schema", COMPACT)),
    ({"type": "json_schema", "value": {"name": "person", "schema": SCHEMA}}, Grammar("json_schema", COMPACT)),
    ({"type": "json_object", "value": SCHEMA}, Grammar("json_schema", COMPACT)),
    ({"type": "regex", "value": "(yes|no)"}, Grammar("regex", "(yes|no)")),
])
def test_response_format_shapes(make_fe, response_format, expected):
    fe = make_fe()
    status, _, body = chat(fe, response_format=response_format)
    assert status == 200, body
    assert fe.sched.adds[last_rid(fe)].grammar == expected


def test_strictness_off_sends_the_schema_as_written(make_frontend, make_fe):
    status, _, body = generate(fe := make_frontend(disable_strict_schemas=True), {"type": "json", "value": SCHEMA})
    assert status == 200, body
    assert fe.sched.adds[last_rid(fe)].grammar == Grammar("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    fe = make_fe(disable_strict_schemas=True)
    status, _, body = chat(fe, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert status == 200, body
    assert "additionalProperties" not in fe.sched.adds[last_rid(fe)].grammar.source


def test_gbnf_is_translated_to_lark(make_frontend):
    fe = make_frontend()
    status, _, body = generate(fe, {"type": "ebnf", "value": 'root ::= "yes" | "no"'})
    assert status == 200, body
    grammar = fe.sched.adds[last_rid(fe)].grammar
    assert grammar.kind == "lark" and '"yes"' in grammar.source and '"no"' in grammar.source


def test_completions_take_response_format_too(make_fe):
    fe = make_fe()
    status, _, body = fe.post("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}})
    assert status == 200, body
    assert fe.sched.adds[last_rid(fe)].grammar == Grammar("json_schema", '{"type":"object"}')


# vLLM's structured-output parameters, as its users send them in the OpenAI SDK's extra_body
CHOICES = ['say "yes"', "naïve", "back\\slash", "🙂"]
CHOICE_LARK = 'start: "say \\"yes\\"" | "naïve" | "back\\\\slash" | "🙂"'


@pytest.mark.parametrize("extra, expected", [
    ({"guided_json": SCHEMA}, Grammar("json_schema", COMPACT)),
    ({"guided_json": json.dumps(SCHEMA)}, Grammar("json_schema", COMPACT)),  # a JSON string, as vLLM takes it
    ({"guided_regex": "[0-9]{3}"}, Grammar("regex", "[0-9]{3}")),
    ({"guided_choice": CHOICES}, Grammar("lark", CHOICE_LARK)),
    ({"guided_grammar": 'start: "yes" | "no"'}, Grammar("lark", 'start: "yes" | "no"')),
    ({"structured_outputs": {"json": SCHEMA}}, Grammar("json_schema", COMPACT)),
    ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, Grammar("regex", "a+")),
    ({"structured_outputs": {"choice": CHOICES}}, Grammar("lark", CHOICE_LARK)),
    ({"structured_outputs": {"json_object": True}}, Grammar("json_schema", '{"type":"object"}')),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, Grammar("json_schema", COMPACT)),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"guided_grammar": 'start: "a ::= b"'}, Grammar("lark", 'start: "a ::= b"')),  # Lark, "::=" in a literal
    ({"guided_choice": ["a\x7fb"]}, Grammar("lark", 'start: "a\\u007fb"')),  # DEL escaped for Lark's lexer
])
def test_vllm_structured_outputs_reach_the_scheduler(make_fe, extra, expected):
    fe = make_fe()
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"})):
        status, _, answer = fe.post(route, {**body, **extra})
        assert status == 200, (route, answer)
        assert fe.sched.adds[last_rid(fe)].grammar == expected, route


def test_vllm_gbnf_grammar_is_translated(make_fe):
    fe = make_fe()
    status, _, body = chat(fe, guided_grammar='root ::= "yes" | "no"')
    assert status == 200, body
    grammar = fe.sched.adds[last_rid(fe)].grammar
    assert grammar.kind == "lark" and '"yes"' in grammar.source and "::=" not in grammar.source


@pytest.mark.parametrize("extra, param, message", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json",
     "only one kind of structured output may be given: guided_json, guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice", "`guided_choice` must be a non-empty array of non-empty strings"),
    ({"guided_choice": ["yes", ""]}, "guided_choice", "must be a non-empty array of non-empty strings"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "must be a non-empty array"),
    ({"guided_json": [1]}, "guided_json", "`guided_json` must be a JSON Schema"),
    ({"guided_json": "{not json"}, "guided_json", "grammar is not valid"),
    ({"guided_regex": "(a"}, "guided_regex", "grammar is not valid"),
    ({"guided_regex": 5}, "guided_regex", "`guided_regex` must be a string"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "`structured_outputs.structural_tag` is not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "`structured_outputs` must be an object"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "`guided_whitespace_pattern` is not supported"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs",
     "`structured_outputs.disable_any_whitespace` is not supported"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex",
     "`guided_regex` and `response_format` cannot both constrain the output"),
])
def test_bad_vllm_structured_outputs_are_refused_by_name(make_fe, extra, param, message):
    fe = make_fe()
    status, _, body = chat(fe, **extra)
    assert status == 422 and body["error"]["param"] == param and message in body["error"]["message"], body
    assert fe.sched.adds == {}


def test_vllm_structured_outputs_and_tools_are_exclusive(make_fe):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, _, body = chat(make_fe(), tools=[tool], tool_choice="required", guided_choice=["a"])
    assert status == 422 and "Grammar and tools are mutually exclusive" in body["error"]["message"], body
