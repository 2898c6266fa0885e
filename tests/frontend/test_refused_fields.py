"""Nothing a client asks for is silently ignored (issue #37): on a real server (the tiny model), TGI's
``adapter_id`` naming an adapter that is not loaded (422, TGI's validation status) and every documented
field of the OpenAI, Responses and Anthropic APIs that llmbus does not serve (400) are refused naming the
field, while their "off" values and the documented no-op fields are answered; Anthropic's
``output_config.format`` is honoured (a JSON answer valid under the schema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmbus.frontend.refused_fields import ANTHROPIC, OPENAI_CHAT, RESPONSES, VLLM_EXTRAS
from llmbus.testing.http import post

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSE = {"model": "m", "input": "hi", "max_output_tokens": 2}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}
MESSAGE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}

# (route, body, field, a value that asks for something unserved, values that ask for nothing)
ASKED = [
    ("/v1/chat/completions", CHAT, "functions", [{"name": "f", "parameters": {}}], [[]]),
    ("/v1/chat/completions", CHAT, "function_call", "auto", []),
    ("/v1/chat/completions", CHAT, "audio", {"voice": "alloy", "format": "wav"}, []),
    ("/v1/chat/completions", CHAT, "modalities", ["text", "audio"], [["text"]]),
    ("/v1/chat/completions", CHAT, "reasoning_effort", "high", ["none", "minimal"]),
    ("/v1/chat/completions", CHAT, "verbosity", "low", []),
    ("/v1/chat/completions", CHAT, "web_search_options", {"search_context_size": "low"}, []),
    ("/v1/chat/completions", CHAT, "skip_special_tokens", False, [True]),
    ("/v1/chat/completions", CHAT, "spaces_between_special_tokens", False, [True]),
    ("/v1/chat/completions", CHAT, "prompt_logprobs", 1, []),
    ("/v1/chat/completions", CHAT, "allowed_token_ids", [1, 2], [[]]),
    ("/v1/chat/completions", CHAT, "bad_words", ["no"], [[]]),
    ("/v1/chat/completions", CHAT, "use_beam_search", True, [False]),
    ("/v1/chat/completions", CHAT, "logits_processors", ["x"], [[]]),
    ("/v1/completions", COMPLETION, "skip_special_tokens", False, [True]),
    ("/v1/completions", COMPLETION, "prompt_logprobs", 0, []),
    ("/v1/responses", RESPONSE, "include", ["message.output_text.logprobs"], [[]]),
    ("/v1/responses", RESPONSE, "reasoning", {"effort": "low"}, [{"effort": None, "summary": None},
                                                                  {"effort": "none"}]),
    ("/v1/responses", RESPONSE, "truncation", "auto", ["disabled"]),
    ("/v1/responses", RESPONSE, "top_logprobs", 3, [0]),
    ("/v1/responses", RESPONSE, "background", True, [False]),
    ("/v1/responses", RESPONSE, "prompt", {"id": "pmpt_1"}, []),
    ("/v1/responses", RESPONSE, "conversation", "conv_1", []),
    ("/v1/responses", RESPONSE, "max_tool_calls", 2, []),
    ("/v1/messages", MESSAGE, "thinking", {"type": "enabled", "budget_tokens": 1024}, [{"type": "disabled"}]),
    ("/v1/messages", MESSAGE, "container", "container_1", []),
    ("/v1/messages", MESSAGE, "mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}], [[]]),
    ("/v1/messages", MESSAGE, "context_management", {"edits": []}, []),
]
NO_OPS = [("/v1/chat/completions", CHAT | {"user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
                                           "metadata": {"a": "b"}, "store": True, "service_tier": "auto",
                                           "prediction": {"type": "content", "content": "hello"},
                                           "stream_options": None}),
          ("/v1/responses", RESPONSE | {"user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
                                        "service_tier": "auto", "metadata": {"a": "b"}}),
          ("/v1/messages", MESSAGE | {"metadata": {"user_id": "u"}, "service_tier": "auto"})]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def ask(server, route, body):
    return post(server.url + route, body, headers=ANTHROPIC_HEADERS if route == "/v1/messages" else None)


# the reasoning controls: refused here (the tiny model does not reason), mapped onto a reasoning model's
# template (thinking_controls.py, tested in test_reasoning_controls.py)
REASONING_CONTROLS = {("/v1/chat/completions", "reasoning_effort"), ("/v1/responses", "reasoning"),
                      ("/v1/messages", "thinking")}


def test_every_refused_field_is_covered():
    covered = {(route, name) for route, _, name, _, _ in ASKED if route != "/v1/completions"}
    tables = {"/v1/chat/completions": OPENAI_CHAT | VLLM_EXTRAS, "/v1/responses": RESPONSES, "/v1/messages": ANTHROPIC}
    assert covered == {(route, name) for route, table in tables.items() for name in table} | REASONING_CONTROLS


@pytest.mark.parametrize("route, body, name, value, off", ASKED, ids=[f"{a[0]}:{a[2]}" for a in ASKED])
def test_unserved_fields_are_refused_by_name(server, route, body, name, value, off):
    status, _, answer = ask(server, route, body | {name: value})
    assert status == 400, answer
    assert name in json.dumps(answer), answer
    for quiet in off + [None]:
        status, _, answer = ask(server, route, body | {name: quiet})
        assert status == 200, (quiet, answer)


@pytest.mark.parametrize("route, body", NO_OPS, ids=[r for r, _ in NO_OPS])
def test_documented_no_op_fields_are_accepted(server, route, body):
    status, _, answer = ask(server, route, body)
    assert status == 200, answer


def test_tgi_adapter_that_is_not_loaded_is_refused_naming_it(server):
    status, _, answer = post(server.url + "/generate", {"inputs": "hi", "parameters": {"adapter_id": "my-lora"}})
    assert status == 422 and "my-lora" in answer["error"] and answer["error_type"] == "validation", answer
    assert "--lora-adapters" in answer["error"], answer  # none is loaded: the message says how to load one
    for base in ("", None):  # TGI's base model
        status, _, answer = post(server.url + "/generate", {"inputs": "hi", "parameters": {
            "adapter_id": base, "max_new_tokens": 2}})
        assert status == 200, answer
    # a stream carries it in-band, as TGI's streams carry every validation error
    _, _, answer = post(server.url + "/generate_stream", {"inputs": "hi", "parameters": {"adapter_id": "x"}})
    assert "adapter `x` is not loaded" in str(answer) and '"error_type":"validation"' in str(answer), answer


def test_anthropic_effort_is_refused_and_output_format_honoured(server):
    status, _, answer = ask(server, "/v1/messages", MESSAGE | {"output_config": {"effort": "low"}})
    assert status == 400 and "output_config.effort" in answer["error"]["message"], answer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    status, _, answer = ask(server, "/v1/messages", MESSAGE | {"max_tokens": 20, "output_config": {
        "format": {"type": "json_schema", "schema": schema}}})
    assert status == 200 and answer["stop_reason"] == "end_turn", answer
    jsonschema.validate(json.loads(answer["content"][0]["text"]), schema)
