"""The rank feeding a step sent ahead from the step before's sampled ids (issue #39; what it does on a GPU),
through the whole stack on the CPU: `llmbus up` with ``LLMBUS_DEVICE_FEED=hold`` keeps each step's answer
until the next command arrives, launches that one first, then answers. Greedy output equals transformers',
concurrent greedy, seeded and penalised requests equal their solo runs, and the rank says it fed tokens so; one
step ahead (the default), two (``--steps-ahead 2``), and two with two launched behind the answered one
(``--launch-depth 2``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmbus.testing import Server
from llmbus.testing.http import all_blocks_free, wait_for_metrics
from llmbus.testing.tiny_prompts import PROMPTS, generate, greedy_matches_reference, ids_of, tiny_server_args

FED_LOG = "its tokens fed on the device"


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=["one-ahead", "two-ahead", "two-deep"])
def server(tiny_model_dir, request):
    """Overlap as by default, with two steps sent past the one awaited (--steps-ahead 2), and so with the rank
    keeping two launched behind the one it answers (--launch-depth 2)."""
    steps_ahead, depth = request.param
    srv = Server(tiny_server_args(tiny_model_dir) + ["--steps-ahead", str(steps_ahead), "--launch-depth", str(depth)],
                 env={"LLMBUS_DEVICE_FEED": "hold"})
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


def test_greedy_fed_on_the_device_matches_transformers(server, reference):
    greedy_matches_reference(server, reference)
    assert server.log_lines(FED_LOG), "no step was fed on the device"


def test_concurrent_requests_of_every_kind_equal_their_solo_runs(server):
    kinds = [{}, {"do_sample": True, "temperature": 0.8, "top_k": 40}, {"repetition_penalty": 1.3},
             {"do_sample": True, "frequency_penalty": 0.5, "top_p": 0.9}]
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i % 3), 4 + (i * 5) % 13, kinds[i % 4]) for i in range(12)]

    def run(job):
        prompt, n, kind = job
        return ids_of(generate(server, prompt, n, **kind, **({"seed": n} if kind.get("do_sample") else {}))[0])
    solo = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == solo
    wait_for_metrics(server.url, all_blocks_free)
