"""What a real engine seldom does on cue, for /v1/responses streams, against the fake scheduler
(llmbus.testing.fake_scheduler): a generation that fails after the stream started arrives as an in-band
``event: error`` after ``response.created`` and ``response.in_progress`` (unstreamed: an HTTP 424 in OpenAI's
envelope); a request the engine holds gets SSE comments as keep-alives and ends with ``response.completed``
once released; a client that leaves mid-stream has its request aborted.
"""

from __future__ import annotations

import http.client
import json

from llmbus.testing.fake_scheduler import WAIT, last_rid
from llmbus.testing.http import named_sse_events, read_lines_until


def _events(raw: bytes) -> list[tuple[str, dict]]:
    return named_sse_events(raw, comments=True)


def test_a_failure_after_the_stream_started_is_an_error_event(make_fe):
    fe = make_fe()
    status, headers, raw = fe.request("POST", "/v1/responses", {"input": "GENFAIL", "stream": True})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = _events(raw)
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1][1] == {"type": "error", "sequence_number": 2, "code": "generation", "param": None,
                             "message": "Request failed during generation: shard broke"}
    status, _, answer = fe.post("/v1/responses", {"input": "GENFAIL"})
    assert status == 424 and answer["error"]["message"] == "Request failed during generation: shard broke"


def _open_stream(fe, body: dict):
    conn = http.client.HTTPConnection(fe.host, fe.port, timeout=WAIT)
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_a_held_stream_keeps_alive_and_then_completes(make_fe):
    fe = make_fe(keepalive_s=0.05)
    conn, resp = _open_stream(fe, {"input": "HOLD", "stream": True, "max_output_tokens": 3})
    # read until two keep-alive comments came while the engine holds the request, then let it answer
    lines = read_lines_until(resp, b":\n", 2)
    fe.sched.release(last_rid(fe))
    events = _events(b"".join(lines) + resp.read())
    conn.close()
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))


def test_a_client_that_leaves_mid_stream_aborts_its_request(make_fe):
    fe = make_fe()
    conn, resp = _open_stream(fe, {"input": "HOLD", "stream": True})
    assert resp.readline() == b"event: response.created\n"  # the stream has started
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "the held request to arrive")
    conn.close()
    fe.sched.wait_for(lambda: len(fe.sched.aborts) == 1, "the held request to be aborted")
