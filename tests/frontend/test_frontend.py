"""The aiohttp frontend against a fake scheduler, over real sockets (zmq ipc + HTTP on localhost).

The fake scheduler and the frontend in a thread are ``llmbus.testing.fake_scheduler``'s: the scheduler
answers each AddRequest with a scripted reply (REPLY, three tokens per batch, then EOS) and records what it
receives; words in the prompt pick the script: HOLD (wait for ``release``), FAIL (RequestFailed). Tests
wait on conditions, never sleep.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from llmbus.bus import messages as m
from llmbus.bus.sockets import open_socket, recv, send
from llmbus.frontend.engine_client import DRAIN_BATCH, TIMED_OUT, EngineClient, Mailbox
from llmbus.frontend.tokenizer import load_tokenizer
from llmbus.testing.fake_scheduler import (BOS, EOS, REPLY, WAIT, FakeScheduler, Frontend, last_rid, parse_sse,
                                           reply_ids)


@pytest.fixture
def fe(make_frontend):
    return make_frontend()


# ------------------------------------------------------------------------------------------------
# Generation: shapes, headers, text
# ------------------------------------------------------------------------------------------------


def test_generate_shape_headers_and_text(fe):
    status, headers, body = fe.post("/generate", {"inputs": "hello world",
                                                  "parameters": {"details": True, "max_new_tokens": 50}})
    assert status == 200, body
    assert list(body) == ["generated_text", "details"]
    assert body["generated_text"] == REPLY
    d = body["details"]
    assert list(d) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]  # no top_tokens
    assert d["finish_reason"] == "eos_token" and d["seed"] is None and d["prefill"] == []
    tokens = d["tokens"]
    assert d["generated_tokens"] == len(tokens) == len(fe.sched.reply) + 1
    assert all(list(t) == ["id", "text", "logprob", "special"] for t in tokens)
    assert tokens[0]["logprob"] == -0.25
    # the emoji's four byte tokens: three empty texts, the fourth carries the whole char
    texts = [t["text"] for t in tokens]
    i = texts.index("🙂")
    assert texts[i - 3:i] == ["", "", ""]
    assert tokens[-1] == {"id": EOS, "text": "</s>", "logprob": tokens[-1]["logprob"], "special": True}
    assert "".join(t["text"] for t in tokens if not t["special"]) == body["generated_text"]
    for name in ("x-compute-time", "x-compute-characters", "x-prompt-tokens", "x-generated-tokens",
                 "x-total-time", "x-validation-time", "x-queue-time", "x-inference-time",
                 "x-time-per-token", "x-compute-type"):
        assert name in headers, name
    assert headers["x-compute-characters"] == str(len("hello world"))
    assert headers["x-generated-tokens"] == str(len(tokens))
    assert float(headers["x-compute-time"]) >= 0 and int(headers["x-total-time"]) >= 0
    req = fe.sched.adds[last_rid(fe)]
    assert req.rid.startswith("fe1-") and req.frontend_id == "fe1"
    assert headers["x-prompt-tokens"] == str(len(req.input_ids))
    assert req.input_ids[0] == BOS and req.stopping.stop_token_ids == [EOS]
    assert req.stopping.max_new_tokens == 50 and req.sampling.do_sample is False
    assert req.arrival_time > 0 and req.prompt_logprobs is False


def test_generate_without_details_and_length_finish(fe):
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 4}})
    assert status == 200 and list(body) == ["generated_text"]
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 4, "details": True}})
    assert body["details"]["finish_reason"] == "length" and body["details"]["generated_tokens"] == 4
    assert body["generated_text"] == fe.sched.tok.decode(fe.sched.reply[:4])
    # the 4th token is the emoji's first byte: the text ends with U+FFFD, carried by the last token
    assert body["generated_text"].endswith(" \ufffd")
    assert body["details"]["tokens"][-1]["text"] == "\ufffd"


def test_default_max_new_tokens_fills_max_total(fe):
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {}})
    assert status == 200
    req = fe.sched.adds[last_rid(fe)]
    assert req.stopping.max_new_tokens == 64 - len(req.input_ids)


def test_stream_bytes_match_generate(fe):
    payload = {"inputs": "hello world", "parameters": {"details": True, "max_new_tokens": 50}}
    _, _, full = fe.post("/generate", payload)
    status, headers, raw = fe.request("POST", "/generate_stream", payload)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-accel-buffering"] == "no" and headers["x-compute-characters"] == "11"
    events = parse_sse(raw)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    for e in events[:-1]:
        assert list(e) == ["index", "token", "generated_text", "details"]
        assert e["generated_text"] is None and e["details"] is None
    last = events[-1]
    assert last["generated_text"] == full["generated_text"] == REPLY
    rid = last_rid(fe)
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": len(events), "seed": None,
                               "input_length": len(fe.sched.adds[rid].input_ids)}
    assert [e["token"] for e in events] == full["details"]["tokens"]
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == REPLY
    # details=false: the last event has the text but null details
    _, _, raw = fe.request("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})
    events = parse_sse(raw)
    assert events[-1]["details"] is None and events[-1]["generated_text"] == fe.sched.tok.decode(fe.sched.reply[:3])


def test_compat_route_list_stream_and_full_text(fe):
    status, _, body = fe.post("/", {"inputs": "hello", "parameters": {"max_new_tokens": 50}})
    assert status == 200 and isinstance(body, list) and len(body) == 1
    assert body[0] == {"generated_text": "hello" + REPLY}  # no pipeline tag: return_full_text defaults on
    _, _, body = fe.post("/", {"inputs": "hello", "parameters": {"return_full_text": False}})
    assert body == [{"generated_text": REPLY}]
    status, headers, raw = fe.request("POST", "/", {"inputs": "hello", "stream": True,
                                                     "parameters": {"return_full_text": False}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert parse_sse(raw)[-1]["generated_text"] == REPLY
    _, _, body = fe.post("/generate", {"inputs": "hello", "parameters": {"return_full_text": True}})
    assert body == {"generated_text": "hello" + REPLY}


def test_sampling_seed_and_do_sample_default(fe):
    # no `parameters` at all: TGI's default_parameters() sets do_sample=true
    fe.post("/generate", {"inputs": "hi"})
    req = fe.sched.adds[last_rid(fe)]
    assert req.sampling.do_sample is True
    # `parameters: {}`: do_sample=false, greedy, seed null
    fe.post("/generate", {"inputs": "hi", "parameters": {}})
    assert fe.sched.adds[last_rid(fe)].sampling.do_sample is False
    # a client seed is passed on and reported
    _, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"do_sample": True, "seed": 42, "details": True}})
    req = fe.sched.adds[last_rid(fe)]
    assert body["details"]["seed"] == 42 and req.sampling.seed == 42 and req.sampling.do_sample
    # a warper alone turns sampling on; the drawn 64-bit seed is the one reported
    _, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"temperature": 0.7, "top_k": 5,
                                                                      "top_p": 0.9, "typical_p": 0.5,
                                                                      "repetition_penalty": 1.2,
                                                                      "frequency_penalty": 0.5,
                                                                      "watermark": True, "details": True}})
    req = fe.sched.adds[last_rid(fe)]
    s = req.sampling
    assert s.do_sample and body["details"]["seed"] == s.seed and 0 <= s.seed < 2**64
    assert (s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty, s.frequency_penalty,
            s.watermark) == (pytest.approx(0.7), 5, pytest.approx(0.9), 0.5, pytest.approx(1.2), 0.5, True)


def test_top_tokens_and_prefill(fe):
    status, _, body = fe.post("/generate", {"inputs": "hello world", "parameters": {
        "max_new_tokens": 3, "top_n_tokens": 2, "decoder_input_details": True}})
    assert status == 200
    d = body["details"]
    assert list(d) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"]
    req = fe.sched.adds[last_rid(fe)]
    assert req.prompt_logprobs is True and req.sampling.top_n_tokens == 2
    assert [p["id"] for p in d["prefill"]] == req.input_ids
    assert d["prefill"][0] == {"id": BOS, "text": "<s>", "logprob": None}
    assert all(p["logprob"] == -1.5 for p in d["prefill"][1:])
    assert len(d["top_tokens"]) == 3
    first = d["top_tokens"][0]
    assert first[0]["id"] == d["tokens"][0]["id"] and first[1] == {"id": EOS, "text": "</s>", "logprob": -5.0,
                                                                   "special": True}
    _, _, raw = fe.request("POST", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                                        "top_n_tokens": 2}})
    events = parse_sse(raw)
    assert list(events[0]) == ["index", "token", "top_tokens", "generated_text", "details"]


def test_prefill_logprobs_are_opt_in_at_launch(make_frontend):
    # TGI >= 3: without --enable-prefill-logprobs, decoder_input_details gives an empty prefill and the
    # engine is not asked to compute prompt logprobs.
    fe = make_frontend(enable_prefill_logprobs=False)
    status, _, body = fe.post("/generate", {"inputs": "hello world", "parameters": {
        "max_new_tokens": 2, "decoder_input_details": True}})
    assert status == 200
    assert body["details"]["prefill"] == []
    assert fe.sched.adds[last_rid(fe)].prompt_logprobs is False


def test_best_of(fe):
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {
        "best_of": 2, "do_sample": True, "details": True, "max_new_tokens": 5}})
    assert status == 200, body
    seqs = body["details"]["best_of_sequences"]
    assert len(seqs) == 1 and seqs[0]["generated_text"] == body["generated_text"]
    assert list(seqs[0]) == ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "hi", "parameters": {"best_of": 0}}),
    ("/generate", {"inputs": "\ud800 hi"}),
    ("/tokenize", {"inputs": "\ud800"}),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["\udc00"], "top_k": "\ud800"}}),  # an invalid field
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "\ud83d"}]}),
])
def test_bad_input_found_by_fuzzing_is_a_422_and_the_server_keeps_serving(fe, path, body):
    """best_of 0 and lone UTF-16 surrogates (``"\\ud800"`` in the JSON) were 500s (IndexError, then
    UnicodeEncodeError in the tokenizer or in the error message itself)."""
    status, _, answer = fe.post(path, body)
    assert status == 422, answer
    text = json.dumps(answer)
    assert ("`best_of` must be > 0 and <= 2. Given: 0" in text
            or "Failed to parse the request body as JSON: lone surrogate \\\\ud" in text), text
    assert fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})[0] == 200


def test_stop_sequence_finishes_and_aborts(fe):
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {
        "stop": ["nothing", "wörld"], "details": True, "max_new_tokens": 50}})
    assert status == 200
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"].endswith("wörld") and body["generated_text"] == REPLY[:REPLY.index("wörld") + 5]
    rid = last_rid(fe)
    fe.sched.wait_for(lambda: rid in fe.sched.aborts, "AbortRequest after the stop sequence")
    # streaming: the last event is the one that completed the stop sequence
    _, _, raw = fe.request("POST", "/generate_stream",
                           {"inputs": "hi", "parameters": {"stop": ["🙂"], "details": True}})
    events = parse_sse(raw)
    assert events[-1]["token"]["text"] == "🙂" and events[-1]["details"]["finish_reason"] == "stop_sequence"
    rid = last_rid(fe)
    fe.sched.wait_for(lambda: rid in fe.sched.aborts, "AbortRequest after the streamed stop sequence")


def test_health_info_and_ping(fe):
    for path in ("/health", "/", "/ping"):
        status, _, raw = fe.request("GET", path)
        assert status == 200 and raw == b"", path
    status, _, raw = fe.request("GET", "/info")
    info = json.loads(raw)
    assert status == 200
    assert list(info) == ["model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
                          "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
                          "max_client_batch_size", "router", "version", "sha", "docker_label", "quantize", "dtype",
                          "attention_backend", "devices", "sampling_defaults"]
    assert info["sampling_defaults"] == {}  # the test model's generation_config.json recommends nothing
    assert info["quantize"] is None
    # the fake scheduler's hello says nothing of the ranks' compute
    assert (info["dtype"], info["attention_backend"], info["devices"]) == (None, None, [])
    assert info["model_id"] == "tiny-test" and info["router"] == "text-generation-router"
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (40, 64)
    assert (info["max_concurrent_requests"], info["max_best_of"], info["max_stop_sequences"],
            info["max_client_batch_size"]) == (128, 2, 4, 4)
    assert len(fe.sched.hellos) == 1 and fe.sched.hellos[0].frontend_id == "fe1"


def test_limits_follow_model_and_scheduler(make_frontend):
    fe = make_frontend(max_input_tokens=None, max_total_tokens=None)
    info = json.loads(fe.request("GET", "/info")[2])
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (255, 256)  # config.json positions


# ------------------------------------------------------------------------------------------------
# Validation and bad bodies
# ------------------------------------------------------------------------------------------------

VALIDATION_CASES = [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1.5, "top_p": 1.0}, "`temperature` must be strictly positive"),  # TGI's order
    ({"temperature": 5e-324}, "`temperature` must be strictly positive"),  # 0 as the f32 TGI reads
    ({"top_p": 1e-46}, "`top_p` must be > 0.0 and < 1.0"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -2.1}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"presence_penalty": 2.5}, "`presence_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": -3}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 40. Given: 0"),
    ({"truncate": 41}, "`truncate` must be strictly positive and less than 40. Given: 41"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2, "do_sample": True, "seed": 7}, "`seed` must not be set when `best_of` > 1"),
    ({"grammar": {"type": "json", "value": 5}}, "grammar is not supported"),
    ({"grammar": {"type": "json", "value": {"type": "objectx"}}},
     "grammar is not valid: 'objectx' is not valid under any of the given schemas"),
]


@pytest.fixture(scope="module")
def shared_fe(model_dir):
    fe = Frontend(model_dir)
    yield fe
    fe.close()


@pytest.mark.parametrize("params, message", VALIDATION_CASES + [(None, "`inputs` cannot be empty")],
                         ids=lambda v: next(iter(v), "inputs") if isinstance(v, dict) else None)
def test_validation_rule(shared_fe, params, message):
    fe = shared_fe
    before = len(fe.sched.adds)
    body = {"inputs": "hi", "parameters": params} if params is not None else {"inputs": "", "parameters": {}}
    status, _, answer = fe.post("/generate", body)
    assert (status, answer) == (422, {"error": f"Input validation error: {message}",
                                      "error_type": "validation"})
    assert len(fe.sched.adds) == before, "nothing invalid reaches the scheduler"


def test_best_of_not_allowed_when_max_best_of_is_1(make_frontend):
    fe = make_frontend(max_best_of=1)
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}})
    assert (status, body["error"]) == (422, "Input validation error: `best_of` != 1 is not allowed for this "
                                            "endpoint")


def test_stream_validation_errors_are_in_band(fe):
    cases = [({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
             ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
             ({"decoder_input_details": True},
              "`decoder_input_details` == true is not supported when streaming tokens")]
    for params, message in cases:
        status, headers, raw = fe.request("POST", "/generate_stream", {"inputs": "hi", "parameters": params})
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert raw == b'data: {"error":"Input validation error: ' + message.encode() + \
            b'","error_type":"validation"}\n\n'


def test_bad_bodies_are_422_json(fe):
    cases = [
        (b"{not json", "Failed to parse the request body as JSON: "),
        (b'{"inputs":"x","parameters":{"temperature":NaN}}', "Failed to parse the request body as JSON: "),
        (b"", "Failed to parse the request body as JSON: "),
        (b'{"parameters":{}}', "Failed to deserialize the JSON body into the target type: missing field `inputs`"),
        (b"[]", "Failed to deserialize the JSON body into the target type: invalid type: sequence, "
                "expected struct "),
        (b'{"inputs":5}', "Failed to deserialize the JSON body into the target type: inputs: invalid type: "
                          "integer `5`, expected a string"),
        (b'{"inputs":"x","parameters":{"max_new_tokens":"x"}}', "Failed to deserialize the JSON body into the "
         'target type: parameters.max_new_tokens: invalid type: string "x", expected u32'),
        (b'{"inputs":"x","parameters":{"max_new_tokens":-1}}', "Failed to deserialize the JSON body into the "
         "target type: parameters.max_new_tokens: invalid value: integer `-1`, expected u32"),
        (b'{"inputs":"x","parameters":{"max_new_tokens":2.5}}', "Failed to deserialize the JSON body into the "
         "target type: parameters.max_new_tokens: invalid type: floating point `2.5`, expected u32"),
        (b'{"inputs":"x","parameters":{"do_sample":null}}', "Failed to deserialize the JSON body into the "
         "target type: parameters.do_sample: invalid type: null, expected a boolean"),
        (b'{"inputs":"x","parameters":{"stop":["a",1]}}', "Failed to deserialize the JSON body into the "
         "target type: parameters.stop[1]: invalid type: integer `1`, expected a string"),
        (b'{"inputs":"x","parameters":null}', "Failed to deserialize the JSON body into the target type: "
         "parameters: invalid type: null, expected struct GenerateParameters"),
    ]
    for path in ("/generate", "/generate_stream", "/"):
        for raw, message in cases:
            status, headers, body = fe.request("POST", path, raw)
            assert status == 422 and headers["content-type"].startswith("application/json"), (path, raw)
            body = json.loads(body)
            assert body["error_type"] == "validation" and body["error"].startswith(message), (path, raw, body)
    assert b"struct CompatGenerateRequest" in fe.request("POST", "/", b"[]")[2]
    assert b"struct GenerateRequest" in fe.request("POST", "/generate", b"[]")[2]
    status, _, body = fe.request("POST", "/", b'{"inputs":"x","stream":"yes"}')
    assert status == 422 and b"stream: invalid type" in body
    # unknown keys are ignored, like serde
    status, _, _ = fe.post("/generate", {"inputs": "x", "foo": 1, "parameters": {"bar": [], "max_new_tokens": 2}})
    assert status == 200


def test_prompt_length_limits_and_truncate(fe):
    tok = fe.sched.tok
    prompt = " ".join(["hello"] * 44)
    n = len(tok.encode(prompt).ids)
    assert 40 < n < 64
    status, _, body = fe.post("/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 30}})
    assert (status, body["error"]) == (422, "Input validation error: `inputs` tokens + `max_new_tokens` must be "
                                            f"<= 64. Given: {n} `inputs` tokens and 30 `max_new_tokens`")
    status, _, body = fe.post("/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 2}})
    assert (status, body["error"]) == (422, f"Input validation error: `inputs` must have less than 40 tokens. "
                                            f"Given: {n}")
    status, _, body = fe.post("/generate", {"inputs": prompt, "parameters": {}})  # default max_new_tokens
    assert (status, body["error"]) == (422, f"Input validation error: `inputs` must have less than 40 tokens. "
                                            f"Given: {n}")
    long_prompt = " ".join(["hello"] * 80)
    m_ = len(tok.encode(long_prompt).ids)
    status, _, body = fe.post("/generate", {"inputs": long_prompt, "parameters": {}})
    assert body["error"] == ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 64. "
                             f"Given: {m_} `inputs` tokens and 0 `max_new_tokens`")
    status, _, body = fe.post("/generate", {"inputs": prompt, "parameters": {"truncate": 10, "max_new_tokens": 2,
                                                                              "details": True}})
    assert status == 200, body
    req = fe.sched.adds[last_rid(fe)]
    assert req.input_ids == tok.encode(prompt).ids[-10:]
    assert fe.request("POST", "/generate", {"inputs": prompt, "parameters": {"truncate": 10}})[1][
        "x-prompt-tokens"] == "10"


# ------------------------------------------------------------------------------------------------
# Admission, cancellation, keep-alive, engine failures
# ------------------------------------------------------------------------------------------------


class Background:
    """An HTTP request on a thread; ``result()`` joins it."""

    def __init__(self, fe: Frontend, path: str, body):
        self.value = None
        self._thread = threading.Thread(target=self._run, args=(fe, path, body), daemon=True)
        self._thread.start()

    def _run(self, fe, path, body):
        self.value = fe.request("POST", path, body)

    def result(self):
        self._thread.join(WAIT)
        assert not self._thread.is_alive(), "request did not finish"
        return self.value


def test_overloaded_429(make_frontend):
    # one of two frontends of a launch: it admits its share of --max-concurrent-requests 3 (it admitted all 3,
    # and the launch twice the limit) ...
    fe = make_frontend(max_concurrent_requests=3, frontends_sharing=2, max_client_batch_size=1, max_best_of=1)
    # ... but never fewer than one request may take (a share of 1 would refuse n=2 always)
    floored = make_frontend(max_concurrent_requests=4, frontends_sharing=4, max_client_batch_size=2)
    status, _, body = floored.post("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 2, body
    held = [Background(fe, "/generate", {"inputs": "HOLD", "parameters": {"max_new_tokens": 5}}) for _ in range(2)]
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 2, "two requests in flight")
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 5}})
    assert (status, body) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    status, _, raw = fe.request("POST", "/generate_stream", {"inputs": "hi"})
    assert (status, raw) == (200, b'data: {"error":"Model is overloaded","error_type":"overloaded"}\n\n')
    for rid in list(fe.sched.adds):
        fe.sched.release(rid)
    assert [h.result()[0] for h in held] == [200, 200]
    assert fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})[0] == 200


def _open_and_drop(fe: Frontend, path: str, body: dict) -> None:
    """Send a request on a raw socket and hang up once the scheduler has it."""
    before = len(fe.sched.adds)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((fe.host, fe.port), timeout=WAIT)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    fe.sched.wait_for(lambda: len(fe.sched.adds) > before, "the request to reach the scheduler")
    sock.close()


@pytest.mark.parametrize("path", ["/generate_stream", "/generate", "/"])
def test_client_disconnect_aborts(make_frontend, path):
    fe = make_frontend(max_concurrent_requests=1)
    _open_and_drop(fe, path, {"inputs": "HOLD", "stream": True})
    rid = last_rid(fe)
    fe.sched.wait_for(lambda: rid in fe.sched.aborts, f"AbortRequest for {rid}")
    # the admission permit came back with the abort
    assert fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})[0] == 200


def test_keepalive_comments_while_waiting(make_frontend):
    fe = make_frontend(keepalive_s=0.05)
    conn = http.client.HTTPConnection(fe.host, fe.port, timeout=WAIT)
    conn.request("POST", "/generate_stream", body=json.dumps({"inputs": "HOLD", "parameters": {"max_new_tokens": 50}}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = b""
    while b":\n\n" not in seen:
        chunk = resp.read1(64)
        assert chunk, "stream ended before a keep-alive"
        seen += chunk
    assert seen.startswith(b":\n\n")
    fe.sched.release(last_rid(fe))
    raw = seen + resp.read()
    conn.close()
    events = parse_sse(raw)
    assert events[-1]["generated_text"] == REPLY


def test_engine_dead_fails_in_flight_and_health(fe):
    blocking = Background(fe, "/generate", {"inputs": "HOLD", "parameters": {"max_new_tokens": 5}})
    streaming = Background(fe, "/generate_stream", {"inputs": "HOLD", "parameters": {"max_new_tokens": 5}})
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 2, "two requests in flight")
    fe.sched.engine_dead("worker rank 1 died")
    expected = {"error": "Request failed during generation: worker rank 1 died", "error_type": "generation"}
    status, _, raw = blocking.result()
    assert (status, json.loads(raw)) == (424, expected)
    status, _, raw = streaming.result()
    assert status == 200 and parse_sse(raw) == [expected]
    for path in ("/health", "/", "/ping"):
        status, _, raw = fe.request("GET", path)
        assert (status, json.loads(raw)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    status, _, body = fe.post("/generate", {"inputs": "hi"})
    assert (status, body) == (424, expected)
    assert fe.sched.aborts == []


def _wait_health(fe: Frontend, status: int) -> None:
    deadline = time.monotonic() + WAIT
    while fe.request("GET", "/health")[0] != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"


def test_a_silent_scheduler_fails_requests_in_band_and_its_next_heartbeat_heals(make_frontend):
    # The fake scheduler's process (this one) runs: silent, it counts as hung after --scheduler-hang-timeout.
    fe = make_frontend(scheduler_hang_timeout_s=1.5)
    streaming = Background(fe, "/generate_stream", {"inputs": "HOLD", "parameters": {"max_new_tokens": 5}})
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "a request in flight")
    fe.sched.heartbeat = False  # as a stuck scheduler: nothing arrives anymore
    status, _, raw = streaming.result()
    events = parse_sse(raw)
    assert status == 200 and events[-1]["error_type"] == "generation", events
    assert "the scheduler sent nothing for 1.5 s: it hangs" in events[-1]["error"]
    # aborted too: a scheduler that was only stalled would otherwise finish a request nobody reads
    rid = last_rid(fe)
    fe.sched.wait_for(lambda: rid in fe.sched.aborts, "the failed request aborted in the scheduler")
    _wait_health(fe, 503)
    fe.sched.heartbeat = True  # it was only slow after all
    _wait_health(fe, 200)
    status, _, body = fe.post("/generate", {"inputs": "hi"})
    assert status == 200 and body["generated_text"] == REPLY


def test_over_tcp_a_silent_scheduler_gets_the_hang_timeout_not_a_second(make_frontend):
    """Over tcp the scheduler's process cannot be asked whether it runs: a silence is a hang after
    --scheduler-hang-timeout, as for a live one, not a death after one second."""
    fe = make_frontend(transport="tcp", scheduler_hang_timeout_s=2.5)
    streaming = Background(fe, "/generate_stream", {"inputs": "HOLD", "parameters": {"max_new_tokens": 5}})
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "a request in flight")
    fe.sched.heartbeat = False
    status, _, raw = streaming.result()
    events = parse_sse(raw)
    assert status == 200 and "the scheduler sent nothing for 2.5 s: it died or hangs" in events[-1]["error"]


def test_a_forged_engine_dead_lasts_until_the_next_heartbeat(make_frontend):
    fe = make_frontend()
    fe.sched.heartbeat = False  # held back until the forged message has taken effect
    fe.sched.send_event(m.EngineDead(reason="forged by a stranger"))
    _wait_health(fe, 503)
    fe.sched.heartbeat = True  # the scheduler lives on
    _wait_health(fe, 200)
    status, _, body = fe.post("/generate", {"inputs": "hi"})
    assert status == 200 and body["generated_text"] == REPLY


SHUTTING_DOWN = {"error": "The server is shutting down", "error_type": "shutting_down"}


def test_stop_drains_requests_in_flight_and_refuses_new_ones(make_frontend):
    fe = make_frontend(shutdown_timeout_s=WAIT)
    held = Background(fe, "/generate_stream", {"inputs": "HOLD", "parameters": {"max_new_tokens": 50}})
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "the request in flight")
    fe.request_stop()
    deadline = time.monotonic() + WAIT
    while fe.request("GET", "/health")[0] != 503:  # the stop is handled on the frontend's loop
        assert time.monotonic() < deadline, "the frontend did not start draining"
    status, _, raw = fe.request("GET", "/health")
    assert (status, json.loads(raw)) == (503, SHUTTING_DOWN)
    status, _, body = fe.post("/generate", {"inputs": "hi"})
    assert (status, body) == (503, SHUTTING_DOWN)
    status, _, raw = fe.request("POST", "/v1/completions", {"prompt": "hi"})
    assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
    assert len(fe.sched.adds) == 1, "nothing new reached the scheduler"
    fe.sched.release(last_rid(fe))
    status, _, raw = held.result()
    assert status == 200 and parse_sse(raw)[-1]["generated_text"] == REPLY
    fe._thread.join(WAIT)
    assert not fe._thread.is_alive(), "the frontend did not exit once drained"
    assert fe.sched.aborts == []


@pytest.mark.parametrize("how", ["second signal", "timeout"])
def test_drain_cut_short_ends_what_is_left(make_frontend, how):
    fe = make_frontend(shutdown_timeout_s=WAIT if how == "second signal" else 0.3)
    held = Background(fe, "/generate_stream", {"inputs": "HOLD", "parameters": {"max_new_tokens": 50}})
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 1, "the request in flight")
    fe.request_stop()
    if how == "second signal":
        fe.request_abort()
    status, _, raw = held.result()
    assert status == 200 and parse_sse(raw) == [SHUTTING_DOWN]  # in-band, as every stream error
    fe.sched.wait_for(lambda: fe.sched.aborts == [last_rid(fe)], "the abort of what was left")
    fe._thread.join(WAIT)
    assert not fe._thread.is_alive()


def test_health_after_a_failed_generation_runs_a_real_one(fe):
    assert fe.post("/generate", {"inputs": "GENFAIL"})[0] == 424
    fe.sched.fail_generations = True  # the engine keeps failing: the liveness generation fails too
    adds = len(fe.sched.adds)
    status, _, raw = fe.request("GET", "/health")
    assert (status, json.loads(raw)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    liveness = fe.sched.adds[last_rid(fe)]
    assert len(fe.sched.adds) == adds + 1 and liveness.stopping.max_new_tokens == 1
    assert fe.sched.tok.decode(liveness.input_ids, skip_special_tokens=True) == "liveness"
    fe.sched.fail_generations = False  # it recovered: the next check generates once and passes
    assert fe.request("GET", "/health")[0] == 200 and len(fe.sched.adds) == adds + 2
    assert fe.request("GET", "/health")[0] == 200 and len(fe.sched.adds) == adds + 2, "no check needed now"


def run_concurrently(call, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: call(), range(n)))


def test_health_asks_the_scheduler_to_probe_every_rank(make_frontend):
    fe = make_frontend(health_check_timeout_s=0.5)
    assert fe.request("GET", "/health")[0] == 200
    assert fe.sched.health_checks[-1].frontend_id == "fe1" and fe.sched.health_checks[-1].timeout_s == 0.5
    fe.sched.health = "fail"  # a rank missed the probe
    status, _, raw = fe.request("GET", "/health")
    assert (status, json.loads(raw)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    fe.sched.health = "silent"  # the scheduler itself is stuck: the frontend stops waiting on its own
    checks = len(fe.sched.health_checks)
    results = run_concurrently(lambda: fe.request("GET", "/health")[0], 3)
    assert results == [503] * 3 and len(fe.sched.health_checks) == checks + 1, "concurrent checks share a probe"
    fe.sched.health = "ok"
    assert fe.request("GET", "/health")[0] == 200


def test_request_failed_maps_to_its_error(fe):
    status, _, body = fe.post("/generate", {"inputs": "FAIL"})
    assert (status, body) == (422, {"error": "Input validation error: bad thing", "error_type": "validation"})
    status, _, raw = fe.request("POST", "/generate_stream", {"inputs": "FAIL"})
    assert (status, parse_sse(raw)) == (200, [body])
    assert fe.request("GET", "/health")[0] == 200


def test_api_key(make_frontend):
    fe = make_frontend(api_key="Secret")
    assert fe.request("POST", "/generate", {"inputs": "hi"})[0] == 401
    status, _, _ = fe.request("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                              headers={"Authorization": "bearer SECRET", "Content-Type": "application/json"})
    assert status == 200
    assert fe.request("GET", "/health")[0] == 200 and fe.request("GET", "/info")[0] == 200


# ------------------------------------------------------------------------------------------------
# Start-up: handshake, CLI, service protocol
# ------------------------------------------------------------------------------------------------


def test_handshake_timeout_names_the_endpoint(tmp_path):
    d = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
    try:
        client = EngineClient(f"ipc://{d}/nobody.sock", f"ipc://{d}/ev.sock", "fe9")
        with pytest.raises(RuntimeError, match="no SchedulerHello within 0.2 s.*nobody.sock"):
            asyncio.run(client.start(0.2))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_mailbox_loses_nothing_to_a_timeout_or_a_cancel():
    async def run():
        box = Mailbox()
        assert await box.get(0.01) is TIMED_OUT
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)  # the reader is now waiting on the mailbox
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put_nowait("a")
        box.put_nowait("b")
        assert await box.get(0.01) == "a" and await box.get() == "b" and box.empty()
        late = asyncio.ensure_future(box.get(WAIT))
        await asyncio.sleep(0)
        box.put_nowait("c")
        assert await late == "c"

    asyncio.run(run())


@pytest.mark.parametrize("steal_the_signal", [False, True])
def test_engine_reader_takes_every_event_of_a_burst(steal_the_signal):
    """More TokenBatches at once than one reader callback takes (DRAIN_BATCH), all in order; and with the
    descriptor's signal taken by someone else reading EVENTS (the watchdog does), they still arrive."""
    d = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
    ctx = zmq.Context()
    requests = open_socket(ctx, zmq.PULL, f"ipc://{d}/requests.sock")
    events = open_socket(ctx, zmq.PUSH, f"ipc://{d}/ev.sock")
    client = EngineClient(f"ipc://{d}/requests.sock", f"ipc://{d}/ev.sock", "fe1")

    async def run():
        starting = asyncio.ensure_future(client.start(WAIT))
        assert isinstance(await asyncio.to_thread(recv, requests), m.FrontendHello)
        send(events, m.SchedulerHello(max_batch_total_tokens=1, block_size=1))
        await starting
        box = Mailbox()
        client._channels["fe1-1"] = box
        n = 3 * DRAIN_BATCH + 7
        for i in range(n):
            send(events, m.TokenBatch(rids=["fe1-1"], token_ids=[i], logprobs=[0.0], finish_reasons=[0]))
        if steal_the_signal:  # a blocking poll, so the loop's reader gets no turn before it
            assert client._pull.poll(int(WAIT * 1000)) == zmq.POLLIN
        got = []
        while len(got) < n:
            item = await box.get(WAIT)
            assert item is not TIMED_OUT, f"{len(got)} of {n} events arrived"
            got.extend(t.token_id for t in item.tokens)
        assert got == list(range(n))

    async def run_and_close():
        try:
            await run()
        finally:
            await client.close()

    try:
        asyncio.run(run_and_close())
    finally:
        events.close()
        requests.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def _cli(model_dir: Path, d: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, LLMBUS_SUPERVISOR_ENDPOINT=f"ipc://{d}/supervisor.sock")
    return subprocess.Popen(
        [sys.executable, "-m", "llmbus.frontend", "--model-dir", str(model_dir), "--hostname", "127.0.0.1",
         "--port", "0", "--requests-endpoint", f"ipc://{d}/requests.sock", "--events-endpoint",
         f"ipc://{d}/events-fe7.sock", "--frontend-id", "fe7", "--max-total-tokens", "64", *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_cli_ready_serves_and_stops_on_sigterm(model_dir):
    d = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
    ctx = zmq.Context()
    supervisor = open_socket(ctx, zmq.PULL, f"ipc://{d}/supervisor.sock")
    sched = FakeScheduler(f"ipc://{d}/requests.sock", model_dir)
    proc = _cli(model_dir, d)
    try:
        assert supervisor.poll(int(WAIT * 1000)), "no ServiceReady from the frontend"
        ready = recv(supervisor)
        assert isinstance(ready, m.ServiceReady) and ready.service == "frontend" and ready.pid == proc.pid
        host, port = ready.detail.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
        conn.request("POST", "/generate", body=json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 50}}))
        assert json.loads(conn.getresponse().read()) == {"generated_text": REPLY}
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        sched.close()
        supervisor.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def test_cli_without_scheduler_reports_fatal(model_dir):
    d = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
    ctx = zmq.Context()
    supervisor = open_socket(ctx, zmq.PULL, f"ipc://{d}/supervisor.sock")
    proc = _cli(model_dir, d, "--scheduler-timeout", "0.3")
    try:
        assert proc.wait(WAIT) == 1
        assert supervisor.poll(int(WAIT * 1000))
        fatal = recv(supervisor)
        assert isinstance(fatal, m.ServiceFatal) and "no SchedulerHello" in fatal.error
        assert "requests.sock" in fatal.error
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        supervisor.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def test_cli_sigterm_during_handshake_exits_cleanly(model_dir):
    d = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
    proc = _cli(model_dir, d, "--scheduler-timeout", "60")
    try:
        events = Path(d) / "events-fe7.sock"  # bound right before the FrontendHello goes out
        deadline = time.monotonic() + WAIT
        while not events.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "frontend never bound its events socket"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Detokenizer
# ------------------------------------------------------------------------------------------------


def test_detokenizer_multibyte_both_implementations(model_dir, monkeypatch):
    from llmbus.frontend import detokenizer
    tok = load_tokenizer(model_dir)
    ids = reply_ids(tok.tokenizer) + [EOS]
    prompt = tok.encode("hello")

    def run():
        d = tok.detokenizer(prompt)
        return [d.step(i) for i in ids]

    rust = run()
    monkeypatch.setattr(detokenizer, "DecodeStream", None)
    python = run()
    assert rust == python
    assert "".join(rust) == REPLY + "</s>"
    i = rust.index("🙂")
    assert rust[i - 3:i] == ["", "", ""]
    assert tok.eos_token_ids == [EOS] and tok.special_ids == {BOS, EOS}
    assert tok.model_max_length == 256
