"""Graceful shutdown of the whole stack (`llmbus up` on the tiny model): SIGTERM while a stream runs lets
the stream finish, answers new requests 503, and exits 0."""

from __future__ import annotations

import http.client
import json
import signal

from harness import Server
from httputil import post

# Long enough to still be running when the signal lands right after the first token (about 2 s on a quiet
# 2-core machine), short enough to finish well inside the drain timeout on a loaded one.
MAX_NEW = 400
DRAIN_TIMEOUT_S = 240


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_requests(tiny_model_dir):
    server = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "2048",
                     "--graceful-termination-timeout", str(DRAIN_TIMEOUT_S)])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/generate_stream", body=json.dumps({"inputs": "Hello", "parameters": {
            "max_new_tokens": MAX_NEW, "ignore_eos_token": True, "details": True}}),
            headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        first = stream.readline()
        assert first.startswith(b"data: ") and b'"index":1,' in first

        server.proc.send_signal(signal.SIGTERM)
        server.stderr.wait_for("draining requests in flight", 60)
        status, _, body = post(f"{server.url}/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert (status, body) == (503, {"error": "The server is shutting down", "error_type": "shutting_down"})

        events = [json.loads(first[len(b"data: "):])]
        for line in iter(stream.readline, b""):
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
        conn.close()
        assert "error" not in events[-1], events[-1]
        assert [e["index"] for e in events] == list(range(1, MAX_NEW + 1))
        assert events[-1]["details"]["finish_reason"] == "length"
        assert server.proc.wait(DRAIN_TIMEOUT_S) == 0, server.stderr.text[-3000:]
    finally:
        server.stop()
