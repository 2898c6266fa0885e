"""TGI's per-request metrics on /metrics, against the fake scheduler (llmbus.testing.fake_scheduler): every outcome
a generation request can have, on every route, counted once, with TGI's exact names."""

from __future__ import annotations

import json
import socket
import time

from llmbus.bus import messages as m
from llmbus.testing.fake_scheduler import WAIT, parse_sse
from llmbus.testing.http import parse_exposition


def scrape(fe) -> tuple[str, dict]:
    status, _, raw = fe.request("GET", "/metrics")
    assert status == 200
    text = raw.decode()
    return text, parse_exposition(text, labels=True)


def test_request_counters_and_histograms(make_frontend, chat_model_dir):
    fe = make_frontend(chat_model_dir)
    ok = [("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 5}}),
          ("/", {"inputs": "hi", "parameters": {"max_new_tokens": 5}}),
          ("/generate_stream", {"inputs": "hi"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
          ("/v1/completions", {"prompt": "hi", "stream": True}),
          ("/invocations", {"inputs": "hi"})]
    for path, body in ok:
        status, _, raw = fe.request("POST", path, body)
        assert status == 200, raw
        if path in ("/generate_stream", "/v1/completions"):
            assert b'"error"' not in raw
    # one request, two generations: counted once, observed twice
    assert fe.request("POST", "/generate", {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}})[0] == 200
    failures = [("/generate", {"inputs": "hi", "parameters": {"top_p": 1.0}}),  # validation
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 9}),  # validation
                ("/generate", {"inputs": "FAIL"})]  # the engine fails it: RequestFailed(validation)
    for path, body in failures:
        assert fe.request("POST", path, body)[0] == 422
    status, _, raw = fe.request("POST", "/generate_stream", {"inputs": "FAIL"})  # in-band, HTTP 200
    assert status == 200 and parse_sse(raw)[0]["error_type"] == "validation"
    assert fe.request("GET", "/health")[0] == 200 and fe.request("POST", "/tokenize", {"inputs": "x"})[0] == 200

    text, samples = scrape(fe)
    assert "# TYPE tgi_request_count counter\ntgi_request_count 11.0\n" in text  # TGI's names: no _total
    assert samples["tgi_request_success"] == 7
    assert samples['tgi_request_failure{err="validation"}'] == 4
    generations = 6 + 2  # best_of 2 made two
    for name in ("duration", "validation_duration", "queue_duration", "inference_duration",
                 "mean_time_per_token_duration", "input_length", "generated_tokens", "max_new_tokens"):
        assert samples[f"tgi_request_{name}_count"] == generations, name
    assert samples["tgi_request_queue_duration_sum"] > 0
    assert samples["tgi_request_max_new_tokens_sum"] >= 5 + 5


def test_overloaded_and_dropped(make_frontend):
    fe = make_frontend(max_concurrent_requests=1)
    conn = socket.create_connection((fe.host, fe.port), timeout=WAIT)
    body = json.dumps({"inputs": "HOLD", "parameters": {"max_new_tokens": 3}}).encode()
    conn.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "the held request")
    assert fe.request("POST", "/generate", {"inputs": "hi"})[0] == 429
    conn.close()
    fe.sched.wait_for(lambda: fe.sched.aborts, "the abort of the dropped stream")
    _, samples = scrape(fe)
    assert samples["tgi_request_count"] == 2
    assert samples['tgi_request_failure{err="overloaded"}'] == 1
    # the abort is sent from the handler's finally, in the same event-loop step as the outcome is counted
    assert samples['tgi_request_failure{err="dropped"}'] == 1
    assert samples["tgi_request_success"] == 0


def test_peer_frontends_counts_add_up(make_frontend):
    # Another frontend's counts, as the scheduler relays them: a scrape here reports the sum, and this
    # frontend's own counts go out to the others.
    fe = make_frontend()
    assert fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})[0] == 200
    fe.sched.wait_for(lambda: any(s.request_count == 1 and s.request_success == 1 for s in fe.sched.frontend_stats),
                      "this frontend's FrontendStats")
    own = fe.sched.frontend_stats[-1]
    assert own.frontend_id == "fe1" and dict(zip(own.histogram_names, own.histograms))["duration"].counts[-1] == 0
    durations = dict(zip(own.histogram_names, own.histograms))["duration"]
    peer = m.FrontendStats("fe2", 5, 3, ["validation", "generation"], [1, 1], ["duration"],
                           [m.Histogram(durations.buckets, [0] * len(durations.buckets) + [3], 120.0)],
                           ["/generate", "/v1/messages"], [3, 2])
    fe.sched.send_event(peer)
    deadline = time.monotonic() + WAIT
    while (samples := scrape(fe)[1])["tgi_request_count"] != 6:
        assert time.monotonic() < deadline, samples
    assert samples["tgi_request_success"] == 4
    assert samples['tgi_request_failure{err="validation"}'] == 1
    assert samples['tgi_request_failure{err="generation"}'] == 1
    assert samples["tgi_request_duration_count"] == 4 and samples['tgi_request_duration_bucket{le="+Inf"}'] == 4
    assert samples["tgi_request_duration_sum"] >= 120.0
    assert samples["tgi_request_input_length_count"] == 1  # only this frontend observed lengths
    # the requests per route, this frontend's and the peer's summed
    assert samples['llmbus_request_route_count{route="/generate"}'] == 4
    assert samples['llmbus_request_route_count{route="/v1/messages"}'] == 2


def test_unreadable_bodies_and_the_servers_own_failures_answer_in_the_routes_envelope(make_frontend, chat_model_dir,
                                                                                       monkeypatch):
    """A body its Content-Encoding does not decode is the client's (422, each route's envelope); a schema too
    deep to check is a validation error, on a stream too; anything a handler raises that it should not is a
    500 in the route's envelope (never aiohttp's text page), logged, and counted like every other outcome."""
    from llmbus.frontend import routes

    fe = make_frontend(chat_model_dir)
    gzip_claimed = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, _, raw = fe.request("POST", "/generate", {"inputs": "hi"}, headers=gzip_claimed)
    assert (status, json.loads(raw)) == (422, {"error": "Failed to read the request body: Can not decode "
                                                        "content-encoding: gzip", "error_type": "validation"})
    status, _, raw = fe.request("POST", "/v1/chat/completions", {"messages": []}, headers=gzip_claimed)
    assert status == 422 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw
    status, _, raw = fe.request("POST", "/v1/messages", {"messages": []}, headers=gzip_claimed)
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw

    deep = {"type": "integer"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}}
    grammar = {"type": "json", "value": deep}
    status, _, raw = fe.request("POST", "/generate", {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert (status, json.loads(raw)["error"]) == (422, "Input validation error: grammar is not valid: the schema "
                                                       "nests too deeply"), raw
    status, _, raw = fe.request("POST", "/generate_stream", {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert status == 200 and parse_sse(raw)[0]["error"].endswith("the schema nests too deeply"), raw

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes, "parse_request", broken)
    status, _, raw = fe.request("POST", "/generate", {"inputs": "hi"})
    assert (status, json.loads(raw)) == (500, {"error": "Internal server error", "error_type": "internal"})
    assert fe.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})[0] == 200

    _, samples = scrape(fe)
    assert samples["tgi_request_count"] == 7 and samples["tgi_request_success"] == 1, samples
    assert samples['tgi_request_failure{err="validation"}'] == 5, samples
    assert samples['tgi_request_failure{err="internal"}'] == 1, samples
