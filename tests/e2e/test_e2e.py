"""The whole stack: `llmbus up` on the tiny demo model, real processes, sockets and HTTP.

Token-exactness is checked against transformers' own greedy `generate` on the same checkpoint.
Random-weight models can have near-tied logits, where two correct implementations may pick different
tokens; the demo `tiny` model is built with a large init std so its greedy margins are wide, and
`reference_greedy` asserts that every compared step's top-1 margin is decisive (> MIN_MARGIN, far
above float32 noise) — so a mismatch here is a real bug, never a coin flip.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llmbus.bus.procfs import command_words, descendants
from llmbus.testing import Server
from llmbus.testing.http import all_blocks_free, get, post, sse_events, stream, wait_for_metrics
from llmbus.testing.tiny_prompts import (MAX_NEW, PROMPTS, generate, greedy_matches_reference, ids_of,
                                        tiny_server_args)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server([*tiny_server_args(tiny_model_dir), "--enable-prefill-logprobs"])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


def test_greedy_matches_transformers(server, reference):
    for body, headers in greedy_matches_reference(server, reference):
        assert int(headers["x-generated-tokens"]) == len(ids_of(body))


def test_concurrent_requests_equal_solo(server):
    prompts = [(PROMPTS * 3)[i] + " " * (i % 3) for i in range(16)]
    lengths = [4 + (i * 5) % 17 for i in range(16)]
    solo = [ids_of(generate(server, p, n)[0]) for p, n in zip(prompts[:6], lengths[:6])]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda pn: ids_of(generate(server, *pn)[0]), zip(prompts, lengths)))
    assert together[:6] == solo
    for i, n in enumerate(lengths):
        assert len(together[i]) <= n
    # and the rest equal their own solo runs too
    assert together[6:] == [ids_of(generate(server, p, n)[0]) for p, n in zip(prompts[6:], lengths[6:])]


def test_stream_concatenation_equals_generate(server):
    for prompt in PROMPTS[:3] + PROMPTS[4:5]:
        body, _ = generate(server, prompt)
        raw = stream(f"{server.url}/generate_stream", {
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True}})
        assert raw.startswith(b"data: {") and raw.endswith(b"\n\n")
        events = sse_events(raw)
        assert [e["token"]["id"] for e in events] == ids_of(body)
        assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == body["generated_text"]
        assert all(e["generated_text"] is None for e in events[:-1])
        last = events[-1]
        assert last["generated_text"] == body["generated_text"]
        assert last["details"]["finish_reason"] == body["details"]["finish_reason"]
        assert last["details"]["generated_tokens"] == len(events)


@pytest.mark.parametrize("raw, message", [
    (b'{"inputs": "Hello", ', "Failed to parse the request body as JSON"),
    (json.dumps({"parameters": {"max_new_tokens": 5}}).encode(), "missing field `inputs`"),
    (json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 0}}).encode(),
     "Input validation error: `max_new_tokens` must be strictly positive"),
    (json.dumps({"inputs": "word " * 150, "parameters": {"max_new_tokens": 5}}).encode(),
     "Input validation error: `inputs` must have less than 128 tokens. Given: "),
    (json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 1000}}).encode(),
     "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 256. Given: "),
], ids=["malformed-json", "missing-inputs", "max-new-tokens-0", "prompt-too-long", "total-too-long"])
def test_bad_input_is_422_and_server_keeps_serving(server, raw, message):
    status, _, body = post(f"{server.url}/generate", None, raw=raw)
    assert status == 422
    assert body["error_type"] == "validation" and message in body["error"], body
    assert get(f"{server.url}/health")[0] == 200
    generate(server, "still serving", 2)


def test_info(server, tiny_model_dir):
    status, info = get(f"{server.url}/info")
    assert status == 200
    assert info["max_input_tokens"] == 128 and info["max_total_tokens"] == 256
    assert info["model_id"] == str(tiny_model_dir)
    # what the ranks compute with (llmbus's keys), from each rank's WorkerReady through the scheduler's hello
    from llmbus.workers.attention import attention_backend_class

    backend = attention_backend_class("auto", torch.device("cpu")).name
    assert (info["dtype"], info["attention_backend"], info["devices"]) == ("float32", backend, ["cpu"])


def test_logprobs_match_transformers_log_softmax(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    body, _ = generate(server, prompt, 6, decoder_input_details=True)
    prefill, tokens = body["details"]["prefill"], body["details"]["tokens"]
    ids = tok(prompt).input_ids
    assert [p["id"] for p in prefill] == ids
    assert prefill[0]["logprob"] is None  # nothing predicts the first token
    full = torch.tensor([ids + [t["id"] for t in tokens]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    expected = logprobs[:-1].gather(1, full[0, 1:, None]).squeeze(1)
    got = torch.tensor([p["logprob"] for p in prefill[1:]] + [t["logprob"] for t in tokens])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # OpenAI's completions, the prompt as token ids, echoed with logprobs: each prompt token's logprob and its
    # position's top 2, transformers' (what lm-eval's loglikelihood reads)
    status, _, answer = post(f"{server.url}/v1/completions", {"prompt": ids, "echo": True, "logprobs": 2,
                                                              "max_tokens": 1, "temperature": 0})
    assert status == 200, answer
    echoed = answer["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    torch.testing.assert_close(torch.tensor(echoed["token_logprobs"][1:len(ids)]), expected[:len(ids) - 1],
                               rtol=0, atol=1e-4)
    top = logprobs[:len(ids) - 1].topk(2, dim=-1)
    for position, row in enumerate(echoed["top_logprobs"][1:len(ids)]):
        texts = [tok.decode([i]) for i in top.indices[position].tolist()]
        assert sorted(row) == sorted(texts), (position, row, texts)
        torch.testing.assert_close(torch.tensor([row[t] for t in texts]), top.values[position], rtol=0, atol=1e-4)


def _wait_for_gauges(server, condition, timeout: float = 30.0) -> dict[str, float]:
    return wait_for_metrics(server.url, condition, timeout)


def test_every_kv_block_is_free_again_after_requests_end(server):
    all_free = all_blocks_free
    # A stream held open: its blocks are in use while it runs.
    req = urllib.request.Request(f"{server.url}/generate_stream", method="POST",
                                 data=json.dumps({"inputs": PROMPTS[2], "parameters": {
                                     "max_new_tokens": 200}}).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")
    busy = _wait_for_gauges(server, lambda g: g.get("tgi_batch_current_size") == 1)
    assert busy["llmbus_kv_blocks_free"] < busy["llmbus_kv_blocks_total"]
    assert busy["tgi_batch_max_total_tokens"] == busy["llmbus_kv_blocks_total"] * 16
    resp.close()  # client gone mid-generation: the request is aborted and its blocks freed
    _wait_for_gauges(server, all_free)
    # Finished requests (EOS, length, stop sequences, best_of) free theirs too.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: generate(server, PROMPTS[i % len(PROMPTS)], 3 + i,
                                         **({"stop": ["e"]} if i % 3 == 0 else {})), range(12)))
    generate(server, PROMPTS[1], 5, best_of=2, do_sample=True)
    _wait_for_gauges(server, all_free)


def test_memory_gauges_stay_bounded(server):
    """Issue #36's gauges on /metrics: oneDNN's cache bound, and rank 0's per-request objects, which after a
    burst of requests and then one request alone count that one request's (the step that finished it is the
    last, and its state goes with the next step) and nothing the burst left behind."""
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: generate(server, PROMPTS[i % len(PROMPTS)] + " " * (i % 5), 3 + i % 7), range(32)))
    generate(server, PROMPTS[0], 4)
    samples = wait_for_metrics(server.url, all_blocks_free)
    assert samples["llmbus_onednn_cache_capacity"] == 64  # --onednn-cache-capacity's default
    assert 1 <= samples["llmbus_worker_request_state"] <= 4  # its state and token history, no one else's
    assert 0 < samples["llmbus_prefix_cache_heap_entries"] <= 2 * 256 + 64  # the bound release() keeps


def test_a_stalled_scheduler_is_waited_for_not_declared_dead(server, reference):
    """A scheduler that sends nothing for longer than a dead one gets (1 s) but whose process runs was only
    starved or stopped: its requests carry on once it runs again (a loaded machine held a live scheduler's
    heartbeat past a second now and then, which failed every stream in flight)."""
    scheduler = next(pid for pid in descendants(server.proc.pid) if "llmbus.scheduler" in command_words(pid))
    os.kill(scheduler, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(generate, server, PROMPTS[1])
            time.sleep(2.5)  # the stall under test, past the 1 s a dead scheduler is given
            os.kill(scheduler, signal.SIGCONT)
            body, _ = answer.result(timeout=60)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    got = ids_of(body)
    assert got == reference(PROMPTS[1])[:len(got)]
