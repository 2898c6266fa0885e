"""Anthropic's Messages API refusing what it should, in Anthropic's envelope and statuses, on a real `llmbus up`
(the tiny demo model) run with ``--api-key``: the key is taken as ``x-api-key`` (what Anthropic's SDKs send)
and as ``Authorization: Bearer``; bad bodies are 400 ``invalid_request_error``; unknown routes under
``/v1/messages`` are 404 ``not_found_error``; the SDK raises its typed errors from them. Also: the route
counts in ``/metrics``.
"""

from __future__ import annotations

import pytest

from llmbus.testing import Server, metrics, post

HELLO = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def server(tiny_keyed_server):
    """The shared server behind ``--api-key`` (``.api_key``), ``--max-total-tokens 256`` (the refusal below
    names it)."""
    return tiny_keyed_server


def _post(server: Server, body, path: str = "/v1/messages", *, raw: bytes | None = None,
          headers: dict | None = None):
    return post(server.url + path, body, raw=raw, headers={
        "x-api-key": server.api_key, "anthropic-version": "2023-06-01", **(headers or {})})


def _envelope(answer) -> tuple[str, str]:
    assert set(answer) == {"type", "error"} and answer["type"] == "error", answer
    return answer["error"]["type"], answer["error"]["message"]


def test_either_key_header_is_taken(server):
    assert _post(server, HELLO)[0] == 200
    status, _, answer = post(server.url + "/v1/messages", HELLO, headers={"Authorization": f"Bearer {server.api_key}"})
    assert status == 200 and answer["type"] == "message"
    status, _, answer = post(server.url + "/v1/messages/count_tokens", HELLO, headers={"x-api-key": server.api_key})
    assert status == 200 and answer["input_tokens"] > 0
    # x-api-key opens the other generation routes too: one key, whichever header a client sends
    status, _, _ = post(server.url + "/v1/chat/completions", {"messages": HELLO["messages"], "max_tokens": 2},
                        headers={"x-api-key": server.api_key})
    assert status == 200


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}])
def test_a_missing_or_wrong_key_is_an_authentication_error(server, path, headers):
    status, _, answer = post(server.url + path, HELLO, headers=headers)
    assert status == 401
    assert _envelope(answer) == ("authentication_error", "Unauthorized")


def test_the_sdk_raises_its_typed_errors(server):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**HELLO)
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "system", "content": "hi"}])
    assert raised.value.status_code == 400 and raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.post("/v1/messages/batches", body=HELLO, cast_to=object)


@pytest.mark.parametrize("body,message", [
    ({"model": "m", "messages": HELLO["messages"]}, "`max_tokens` is required"),
    ({**HELLO, "max_tokens": 0}, "`max_tokens` must be an integer >= 1. Given: 0"),
    ({**HELLO, "messages": []}, "`messages` must be a non-empty array"),
    ({**HELLO, "messages": [{"role": "system", "content": "hi"}]}, 'must be an object with `role` "user" or '
                                                                   '"assistant"'),
    ({**HELLO, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "`messages[0].content[0]` is image content, which this model does not read"),
    ({**HELLO, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]},
     '`messages[0].content[0]` has a block of type "tool_use"; user messages take text and tool_result blocks'),
    ({**HELLO, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "`messages[0].content[0]` must have a string `tool_use_id`"),
    ({**HELLO, "system": [{"type": "image"}]}, "`system[0]` is image content"),
    ({**HELLO, "temperature": 1.5}, "`temperature` must be a number >= 0 and <= 1. Given: 1.5"),
    ({**HELLO, "top_k": -1}, "`top_k` must be an integer >= 0. Given: -1"),
    ({**HELLO, "stop_sequences": "x"}, "`stop_sequences` must be an array of strings"),
    ({**HELLO, "tools": [{"name": "f"}]}, "`tools[0].input_schema` must be a JSON Schema object"),
    ({**HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "is a server tool"),
    ({**HELLO, "tool_choice": {"type": "sometimes"}}, "`tool_choice` must be"),
    # schemathesis found it: a type that is not a string was looked up in a dict (a 500)
    ({**HELLO, "tool_choice": {"type": {}}}, "`tool_choice` must be"),
    ({**HELLO, "tool_choice": {"type": "any"}}, "`tool_choice` needs `tools`"),
    ({**HELLO, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool",
                                                                                            "name": "g"}},
     "Tool error: Tool with name g not found"),
    ([1], "expected a JSON object"),
])
def test_bad_bodies_are_invalid_request_errors(server, body, message):
    status, content_type, answer = _post(server, body)
    assert (status, content_type["Content-Type"]) == (400, "application/json"), answer
    kind, text = _envelope(answer)
    assert kind == "invalid_request_error" and message in text, text


def test_a_body_that_is_not_json_and_a_prompt_too_long(server):
    status, _, answer = _post(server, None, raw=b"{not json")
    assert status == 400 and _envelope(answer)[0] == "invalid_request_error"
    long = {**HELLO, "messages": [{"role": "user", "content": "word " * 400}]}
    status, _, answer = _post(server, long)
    assert status == 400 and "must be <= 256" in _envelope(answer)[1]  # --max-total-tokens, TGI's text


def test_unknown_routes_under_messages_are_not_found(server):
    status, _, answer = _post(server, HELLO, "/v1/messages/batches")
    assert status == 404 and _envelope(answer) == ("not_found_error", "Not found: POST /v1/messages/batches")


def test_a_streamed_answer_and_the_request_metrics(server):
    before = metrics(server.url, labels=True)
    _post(server, {**HELLO, "stream": True})
    _post(server, {**HELLO, "max_tokens": 0})
    after = metrics(server.url, labels=True)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("tgi_request_count") == 2 and grew("tgi_request_success") == 1
    assert grew('tgi_request_failure{err="validation"}') == 1
    assert grew('llmbus_request_route_count{route="/v1/messages"}') == 2
