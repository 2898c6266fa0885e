"""Scheduling through the whole stack: outputs do not depend on prefix caching, chunked prefill or
preemption, and cut streams leave every KV block free.

Two servers on the tiny model in float32: ``plain`` (no prefix caching, no chunking, ample KV) and
``tight`` (prefix caching and chunking on, 24 tokens per step, 40 blocks of 4 tokens: far too little
KV for the load, so requests are preempted and recomputed). Greedy outputs must equal transformers'
generate on both; seeded sampled outputs must equal each other.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from llmbus.testing import Server, stop_all
from llmbus.testing.http import all_blocks_free, get, metrics, post, wait_for_metrics
from llmbus.testing.tiny_prompts import QUESTIONS, SYSTEM

MAX_NEW = 20
COMMON = ["--dtype", "float32", "--max-total-tokens", "96", "--max-input-tokens", "64",
          "--max-concurrent-requests", "256"]
CONFIGS = {
    "plain": ["--prefix-caching", "false", "--prefill-chunking", "false", "--num-blocks", "256",
              "--block-size", "16"],
    "tight": ["--max-batch-prefill-tokens", "24", "--num-blocks", "40", "--block-size", "4"],
}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    # Started side by side: one's processes compute while the other's wait on their ranks' load and warmup.
    with ThreadPoolExecutor(len(CONFIGS)) as pool:
        starts = {name: pool.submit(Server, ["--model-id", str(tiny_model_dir), *COMMON, *args])
                  for name, args in CONFIGS.items()}
    started = {name: start.result() for name, start in starts.items() if start.exception() is None}
    try:
        for start in starts.values():
            start.result()  # a server that did not start (it stopped itself), once the other is stopped below
        yield started
    finally:
        for srv, status in zip(started.values(), stop_all(started.values())):
            assert status == 0, srv.stderr.text[-3000:]


@pytest.fixture(scope="module")
def expected(reference) -> list[list[int]]:
    """transformers' greedy tokens for each of the prompts, for both servers."""
    return [reference(SYSTEM + q, MAX_NEW) for q in QUESTIONS]


def generate(server, prompt: str, max_new_tokens: int = MAX_NEW, **params) -> dict:
    status, _, body = post(f"{server.url}/generate", {
        "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **params}})
    assert status == 200, body
    return body


def token_ids(body) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


def _over_labels(samples: dict[str, float]) -> dict[str, float]:
    """Labelled samples summed per name (``method="prefill"`` and ``"decode"``, each concat reason)."""
    totals: dict[str, float] = {}
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        totals[name] = totals.get(name, 0) + value
    return totals


def assert_matches_reference(body, expected: list[int]) -> None:
    got = token_ids(body)
    assert got == expected[:len(got)]
    if len(got) < MAX_NEW:
        assert body["details"]["finish_reason"] == "eos_token"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_greedy_outputs_equal_transformers(servers, expected, name):
    server = servers[name]
    prompts = [SYSTEM + q for q in QUESTIONS]
    before = metrics(server.url)
    before_labelled = metrics(server.url, labels=True)
    generated = 0
    for _ in range(2):  # the second wave finds the shared prefix (and whole prompts) cached
        with ThreadPoolExecutor(len(prompts)) as pool:
            bodies = list(pool.map(lambda p: generate(server, p), prompts))
        for body, exp in zip(bodies, expected):
            assert_matches_reference(body, exp)
            generated += body["details"]["generated_tokens"]
    after = wait_for_metrics(server.url, all_blocks_free)
    grew = {name: total - _over_labels(before_labelled).get(name, 0)
            for name, total in _over_labels(metrics(server.url, labels=True)).items()}
    # TGI's step metrics (its Grafana dashboard's): every step succeeded, each timed once, each of a request's
    # tokens sampled once (no speculation here: nothing skipped), even through preemptions
    steps = grew["tgi_batch_inference_count"]
    assert steps > 0 and grew["tgi_batch_inference_success"] == steps and grew["tgi_batch_inference_failure"] == 0
    assert grew["tgi_batch_decode_duration_count"] == grew["tgi_batch_filter_duration_count"] == steps
    assert grew["tgi_request_skipped_tokens_count"] == generated and grew["tgi_request_skipped_tokens_sum"] == 0
    assert grew["tgi_batch_concat_duration_count"] == grew["tgi_batch_concat"]
    hits = after["llmbus_prefix_cache_hit_tokens_total"] - before["llmbus_prefix_cache_hit_tokens_total"]
    preemptions = after["llmbus_preemptions_total"] - before["llmbus_preemptions_total"]
    print(f"{name}: {preemptions:.0f} preemptions, {hits:.0f} prompt tokens from the prefix cache")
    if name == "tight":
        assert preemptions > 0, "the tight server was meant to run out of KV blocks"
        assert hits > 0
        assert after["tgi_batch_concat"] >= 0  # exported; reasons counted by the policy tests
    else:
        assert preemptions == 0 and hits == 0


def test_seeded_sampling_is_the_same_whatever_the_schedule(servers):
    params = {"do_sample": True, "seed": 1234, "temperature": 0.9, "top_k": 40, "repetition_penalty": 1.3}
    prompt = SYSTEM + "Write a short poem about the sea."
    alone = {name: token_ids(generate(srv, prompt, **params)) for name, srv in servers.items()}
    assert alone["plain"] == alone["tight"]
    # Inside a load that preempts on the tight server: still the same tokens.
    server = servers["tight"]
    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(generate, server, SYSTEM + q) for q in QUESTIONS[:7]]
        sampled = pool.submit(generate, server, prompt, **params)
        [f.result() for f in busy]
    assert token_ids(sampled.result()) == alone["plain"]


def test_200_streams_cut_mid_stream_leave_every_block_free(servers, expected):
    server = servers["tight"]

    async def cut_stream(session: aiohttp.ClientSession, i: int) -> int:
        body = {"inputs": SYSTEM + QUESTIONS[i % len(QUESTIONS)] + " " * (i % 5),
                "parameters": {"max_new_tokens": 60}}
        async with session.post(f"{server.url}/generate_stream", json=body) as resp:
            assert resp.status == 200
            events = 0
            async for line in resp.content:
                if line.startswith(b"data:"):
                    events += 1
                    if events == 1 + i % 4:
                        break  # leaving the block closes the connection mid-stream
            return events

    async def run_all() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(cut_stream(session, i) for i in range(200)))

    counts = asyncio.run(run_all())
    assert all(c >= 1 for c in counts)
    idle = wait_for_metrics(server.url, all_blocks_free, timeout=120)
    assert idle["llmbus_kv_blocks_free"] == idle["llmbus_kv_blocks_total"] == 40
    status, _ = get(f"{server.url}/health")
    assert status == 200
    assert_matches_reference(generate(server, SYSTEM + QUESTIONS[0]), expected[0])


def test_queue_time_header_counts_the_wait_for_admission(servers):
    # On the tight server most of 12 concurrent requests wait for blocks: that wait is x-queue-time,
    # and the inference time no longer includes it.
    server = servers["tight"]

    def timed(prompt):
        status, headers, body = post(f"{server.url}/generate", {
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW}})
        assert status == 200, body
        headers = {k.lower(): v for k, v in headers.items()}
        return {k: int(headers[k]) for k in ("x-queue-time", "x-inference-time", "x-total-time")}

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        timings = list(pool.map(timed, [SYSTEM + q for q in QUESTIONS]))
    assert max(t["x-queue-time"] for t in timings) > 0
    for t in timings:
        assert t["x-queue-time"] + t["x-inference-time"] <= t["x-total-time"] + 2
