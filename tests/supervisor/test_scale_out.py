"""One launch with two tensor-parallel ranks and two HTTP frontends sharing a port: /metrics counts every
request whichever frontend answers the scrape, and /health is 200 only while every rank answers; last, a rank
killed takes the launch down loudly and cleanly (one two-rank launch for all three: the kill ends it)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from llmbus.bus.procfs import command_line, descendants, process_alive
from llmbus.testing import Server, rank_pids
from llmbus.testing.http import get, metrics, post

REQUESTS = 16  # each on a new connection: the kernel spreads them over both frontends


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # --max-restarts 0 is TGI's behaviour, which the last test checks (test_recovery.py covers restarting);
    # the tests before it kill nothing.
    run_dir = tmp_path_factory.mktemp("scale") / "run"
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "256",
                  "--num-blocks", "64", "--run-dir", str(run_dir), "--max-restarts", "0",
                  "--gpus", "2", "--num-frontends", "2", "--health-check-timeout", "1"])
    srv.run_dir = run_dir
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


# Last: it ends the module's launch.
def test_killed_rank_stops_everything_within_10s_without_restarts(server):
    # Two ranks: the survivor is inside a collective when its peer dies, the case that must not hang.
    srv, run_dir = server, server.run_dir
    assert srv.proc.poll() is None, "the launch must still be serving: this test kills it, and runs last"
    try:
        assert any(p.name.endswith(".sock") for p in run_dir.iterdir())
        procs = descendants(srv.proc.pid)
        ranks = sorted(p for p in procs if "--rank" in command_line(p))
        assert len(ranks) == 2 and len(procs) >= 6  # scheduler, workers group, 2 ranks, 2 frontends
        # a request in flight when the rank dies gets an error, not a hang
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=post(f"{srv.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 200}}, timeout=60)))
        t.start()
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        code = srv.proc.wait(60)
        stopped_after = time.monotonic() - killed_at
        t.join(60)
    finally:
        srv.stop()
    assert code != 0
    assert stopped_after < 10, f"the launch took {stopped_after:.1f}s to stop after a rank died"
    log = srv.stderr.text
    # Whoever notices first (the worker group, or the scheduler watching the ranks' control sockets)
    # exits, and the launcher names the dead rank.
    # (the group seeing its rank exit, the scheduler seeing the rank's socket close, or the surviving
    # rank's collective failing: all three name a rank).
    summary = [line for line in log.splitlines() if line.startswith("llmbus:")]
    assert any("exited with code" in line for line in summary), log[-3000:]
    assert "rank" in log.split("exited with code", 1)[1], log[-3000:]
    leftovers = [p for p in procs if process_alive(p)]
    assert leftovers == [], [command_line(p) for p in leftovers]
    assert not run_dir.exists()
    if "r" in result:  # the request either failed with 424 or its connection was closed
        assert result["r"][0] in (200, 424), result
