"""One launch with two tensor-parallel ranks and two HTTP frontends sharing a port: /metrics counts every
request whichever frontend answers the scrape, and /health is 200 only while every rank answers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmbus.testing import Server, rank_pids
from llmbus.testing.http import get, metrics, post

REQUESTS = 16  # each on a new connection: the kernel spreads them over both frontends


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "256",
                  "--num-blocks", "64", "--run-dir", str(tmp_path_factory.mktemp("scale") / "run"),
                  "--gpus", "2", "--num-frontends", "2", "--health-check-timeout", "1"])
    yield srv
    srv.stop()


def test_every_frontend_counts_every_request(server):
    for i in range(REQUESTS):
        status, _, body = post(f"{server.url}/generate", {"inputs": f"Hello {i}", "parameters": {"max_new_tokens": 3}})
        assert status == 200, body
    served_by = {line.split("service=")[1].split()[0] for line in server.stderr.lines
                 if " request " in f" {line} " and "service=" in line}
    assert served_by == {"frontend0", "frontend1"}, served_by
    # Each frontend hears the other's counts a moment later (a count sent between a request's start and
    # its success is completed by the next); after that every scrape, whichever frontend it reaches,
    # reports all of them.
    expected = {"tgi_request_count": REQUESTS, "tgi_request_success": REQUESTS,
                "tgi_request_duration_count": REQUESTS, "tgi_request_generated_tokens_sum": 3 * REQUESTS}
    deadline = time.monotonic() + 30
    agreeing = 0
    while agreeing < 8:
        samples = metrics(server.url)  # a new connection each time
        agreeing = agreeing + 1 if {k: samples[k] for k in expected} == expected else 0
        assert time.monotonic() < deadline, {k: samples[k] for k in expected}


def test_health_needs_every_rank(server):
    assert get(f"{server.url}/health")[0] == 200
    ranks = rank_pids(server)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGSTOP)  # alive, but answering nothing: what a hung collective looks like
    try:
        started = time.monotonic()
        status, body = get(f"{server.url}/health")
        assert (status, body) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
        assert time.monotonic() - started < 1 + 2, "the check waits for its timeout, not longer"
        server.stderr.wait_for("rank(s) 1 did not answer", timeout=10)
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    assert get(f"{server.url}/health")[0] == 200
    status, _, body = post(f"{server.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert status == 200, body
