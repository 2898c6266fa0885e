"""What a real engine seldom does on cue, for /v1/messages streams, against the fake scheduler
(llmbus.testing.fake_scheduler): a generation that fails after the stream started arrives as Anthropic's
``event: error`` (api_error) after ``message_start``; a request the engine holds gets ``ping`` events as
keep-alives, ``message_start`` with the first of them, and ends normally once released; a full server
answers 429 rate_limit_error in Anthropic's envelope. And a browser's CORS preflight for Anthropic's headers.
"""

from __future__ import annotations

import http.client
import json
import socket

from llmbus.testing.fake_scheduler import WAIT, last_rid
from llmbus.testing.http import named_sse_events, read_lines_until


def _body(content: str, **extra) -> dict:
    return {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": content}], **extra}


def _events(raw: bytes) -> list[tuple[str, dict]]:
    return named_sse_events(raw)


def test_a_failure_after_the_stream_started_is_an_error_event(make_fe):
    fe = make_fe()
    status, headers, raw = fe.request("POST", "/v1/messages", _body("GENFAIL", stream=True))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = _events(raw)
    assert [name for name, _ in events] == ["message_start", "ping", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message":
                                                        "Request failed during generation: shard broke"}}
    # the same failure before an answer started: an HTTP 500 in the same envelope
    status, _, answer = fe.post("/v1/messages", _body("GENFAIL"))
    assert status == 500 and answer["error"]["type"] == "api_error"


def test_a_held_stream_pings_and_then_ends(make_fe):
    fe = make_fe(keepalive_s=0.05)
    conn = http.client.HTTPConnection(fe.host, fe.port, timeout=WAIT)
    conn.request("POST", "/v1/messages", json.dumps(_body("HOLD", stream=True)),
                  {"Content-Type": "application/json"})
    resp = conn.getresponse()
    # read until two keep-alive pings came while the engine holds the request (the first comes with
    # message_start), then let the engine answer
    lines = read_lines_until(resp, b"event: ping\n", 2)
    fe.sched.release(last_rid(fe))
    events = _events(b"".join(lines) + resp.read())
    conn.close()
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"] and "content_block_delta" in names
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_a_full_server_is_a_rate_limit_error(make_fe):
    fe = make_fe(max_concurrent_requests=1)
    conn = socket.create_connection((fe.host, fe.port), timeout=WAIT)
    body = json.dumps(_body("HOLD")).encode()
    conn.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "the held request to arrive")
    status, _, answer = fe.post("/v1/messages", _body("hi"))
    assert status == 429
    assert answer == {"type": "error", "error": {"type": "rate_limit_error", "message": "Model is overloaded"}}
    conn.close()  # the client leaves: its request is aborted and its permit returns
    fe.sched.wait_for(lambda: len(fe.sched.aborts) == 1, "the held request to be aborted")


def test_a_browsers_preflight_allows_anthropics_headers(make_fe):
    """Anthropic's SDKs in a browser send the key as x-api-key and an anthropic-version header: a preflight
    that names them must allow both, or the browser never sends the request."""
    fe = make_fe()
    status, headers, _ = fe.request("OPTIONS", "/v1/messages", headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-api-key,anthropic-version"})
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert {"x-api-key", "anthropic-version", "content-type"} <= set(headers["access-control-allow-headers"].split(","))
