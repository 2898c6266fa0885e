"""Worker ranks that die or hang are restarted and every request resumes: `llmbus up` on the tiny model.

Chaos under 16 concurrent greedy streams: SIGKILL rank 0 before the first tokens (mid-prefill), and
mid-decode twice in a row, SIGSTOP it past --step-timeout, and at --gpus 2 SIGKILL rank 1. Every stream must end
with exactly transformers' float32 tokens (the undisturbed run; the prompts' margins are checked decisive),
/metrics counts the restarts and /health fails while the ranks are away. Then the ends: a crash loop
stops the launch with a clear error and leaves nothing behind; a killed scheduler gets every client an
in-band error event within 2 s; one of two frontends that dies is restarted while the other serves.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from llmbus.bus.procfs import command_line, descendants, process_alive
from llmbus.testing import Server, rank_pids
from llmbus.testing.http import get, metrics, wait_for_metrics

SYSTEM = "You are a helpful assistant. Answer briefly, precisely and politely. "
QUESTIONS = ["What is two plus two?", "Name a colour.", "Why is the sky blue?", "Count to five.",
             "Say hello in French.", "What is a prime number?", "Tell me a joke.", "Spell cat.",
             "Where is Paris?", "Is water wet?", "Define entropy.", "Who are you?",
             "What is rain?", "Name a fruit.", "How old is the sun?", "Say goodbye."]
MAX_NEW = 24
COMMON = ["--dtype", "float32", "--max-total-tokens", "96", "--max-input-tokens", "64",
          "--max-concurrent-requests", "256", "--num-blocks", "256", "--block-size", "16"]
WAIT = 120


class Stream(threading.Thread):
    """One /generate_stream request, read event by event."""

    def __init__(self, url: str, prompt: str, max_new_tokens: int = MAX_NEW):
        super().__init__(daemon=True)
        self.host, self.port = url.removeprefix("http://").split(":")
        self.body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens,
                                                                 "details": True}})
        self.tokens: list[int] = []
        self.final: dict | None = None
        self.error: dict | None = None
        self.error_at = 0.0
        self.cond = threading.Condition()
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=WAIT)
        try:
            conn.request("POST", "/generate_stream", self.body, {"Content-Type": "application/json"})
            for line in conn.getresponse():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                with self.cond:
                    if "error" in event:
                        self.error, self.error_at = event, time.monotonic()
                    else:
                        self.tokens.append(event["token"]["id"])
                        if event.get("generated_text") is not None:
                            self.final = event
                    self.cond.notify_all()
        finally:
            conn.close()
            with self.cond:
                self.cond.notify_all()

    def wait_tokens(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.tokens) >= n or self.final or self.error, WAIT)

    def result(self) -> list[int]:
        self.join(WAIT)
        assert not self.is_alive() and self.error is None and self.final is not None, (self.error, self.tokens)
        return self.tokens


def streams(server: Server) -> list[Stream]:
    return [Stream(server.url, SYSTEM + q) for q in QUESTIONS]


def assert_undisturbed(started: list[Stream], expected: list[list[int]]) -> None:
    for stream, exp in zip(started, expected):
        got = stream.result()
        assert got == exp[:len(got)], (stream.body, got, exp)
        assert len(got) == MAX_NEW or stream.final["details"]["finish_reason"] == "eos_token"


def restarts(server: Server) -> float:
    return metrics(server.url).get("llmbus_worker_restarts_total", 0.0)


def lost_steps(server: Server) -> float:
    """tgi_batch_inference_failure, both methods."""
    return sum(v for k, v in metrics(server.url, labels=True).items() if k.startswith("tgi_batch_inference_failure"))


def wait_restarted(server: Server, n: int) -> None:
    wait_for_metrics(server.url, lambda s: s.get("llmbus_worker_restarts_total", 0) >= n, timeout=WAIT)


@pytest.fixture(scope="module")
def expected(reference):
    return [reference(SYSTEM + q, MAX_NEW) for q in QUESTIONS]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(["--model-id", str(tiny_model_dir), *COMMON, "--step-timeout", "4", "--max-restarts", "10"])
    yield srv
    srv.stop()


# The tiny model computes all 16 streams about half a second after the test sees a stream's first tokens,
# so a signal sent on seeing them may land after the last token (the test process is the one that waits
# when the machine is loaded). Each case below therefore counts a restart once /metrics shows it, not as
# soon as the streams end, and where a loss must hit running requests, rank 0 is stopped first: from then
# on nothing is computed until it is killed or its step times out.


def test_killed_rank_0_before_first_tokens_mid_decode_and_twice_in_a_row(server, expected):
    # before any token: the prompts are being computed (or still queued) when rank 0 dies
    rank_0 = rank_pids(server)[0]
    os.kill(rank_0, signal.SIGSTOP)
    started = streams(server)
    os.kill(rank_0, signal.SIGKILL)
    status, body = get(f"{server.url}/health")
    assert status == 503, body  # recovering (or the probe found the rank gone): not healthy
    assert_undisturbed(started, expected)
    wait_restarted(server, 1)
    assert restarts(server) == 1
    assert get(f"{server.url}/health")[0] == 200
    # mid-decode (or, where the streams outran the test, idle: restarted all the same), then twice in a row:
    # the new rank 0 dies as soon as it is ready, before computing anything. The streams resume after the
    # second restart, mid-decode, which is what a single mid-decode loss asks of a restart too (a rank's
    # restart is seconds of this test: one fewer than a case of its own).
    rank_0 = rank_pids(server)[0]
    started = streams(server)
    started[0].wait_tokens(4)
    os.kill(rank_0, signal.SIGKILL)
    wait_restarted(server, 2)
    os.kill(rank_pids(server)[0], signal.SIGKILL)
    assert_undisturbed(started, expected)
    wait_restarted(server, 3)
    assert restarts(server) == 3
    assert "worker ranks lost: restarting them" in server.stderr.text
    # the figures, for whoever runs this with -s: how long each recovery took, and what it resumed
    print("\n".join(line for line in server.stderr.lines if "worker ranks back" in line))


def test_stopped_rank_past_the_step_timeout_is_restarted(server, expected):
    before, lost_before = restarts(server), lost_steps(server)
    stopped = rank_pids(server)[0]
    started = streams(server)
    started[0].wait_tokens(3)
    os.kill(stopped, signal.SIGSTOP)
    # sent after the stop, this request needs a step that cannot finish: a step always runs past the
    # deadline, even where the other streams ended before the signal landed
    started.append(Stream(server.url, SYSTEM + QUESTIONS[0]))
    assert_undisturbed(started, expected + expected[:1])
    wait_restarted(server, before + 1)
    assert restarts(server) == before + 1
    assert "got no result within 4.0s" in server.stderr.text
    assert not process_alive(stopped)
    assert lost_steps(server) > lost_before  # the step that timed out, at least (TGI's failure counter)


def test_killed_scheduler_gives_every_client_an_in_band_error_within_2s(server):
    """Runs last on this server: it ends the launch."""
    started = streams(server)
    started[0].wait_tokens(2)
    # freeze the rank so the streams are still running when the scheduler dies
    os.kill(rank_pids(server)[0], signal.SIGSTOP)
    scheduler = next(p for p in descendants(server.proc.pid) if "llmbus.scheduler" in command_line(p))
    procs = descendants(server.proc.pid)
    killed_at = time.monotonic()
    os.kill(scheduler, signal.SIGKILL)
    for stream in started:
        stream.join(WAIT)
        if stream.final is None:  # a stream that had finished before the kill has nothing to report
            assert stream.error is not None, stream.tokens
            assert stream.error["error_type"] == "generation" and "scheduler" in stream.error["error"]
            assert stream.error_at - killed_at < 2.0, stream.error_at - killed_at
    assert server.proc.wait(WAIT) != 0
    leftovers = [p for p in procs if process_alive(p)]
    assert leftovers == [], [command_line(p) for p in leftovers]


def test_tp2_rank_1_and_a_frontend_restarted_then_a_crash_loop_stops_cleanly(tiny_model_dir, tmp_path, expected):
    run_dir = tmp_path / "run"
    server = Server(["--model-id", str(tiny_model_dir), *COMMON, "--gpus", "2", "--num-frontends", "2",
                     "--max-restarts", "1", "--run-dir", str(run_dir)])
    try:
        # One of two frontends dies: the other serves meanwhile (the streams below start once the launcher
        # saw it exit, so every one of them is frontend1's), and it comes back. Its restart runs beside the
        # ranks' below: each takes seconds.
        frontend0 = next(p for p in descendants(server.proc.pid)
                         if "llmbus.frontend" in command_line(p) and "frontend0" in command_line(p))
        os.kill(frontend0, signal.SIGKILL)
        server.stderr.wait_for("restarting frontend0", WAIT)
        # rank 1 dies mid-decode
        started = streams(server)
        started[0].wait_tokens(4)
        os.kill(rank_pids(server)[1], signal.SIGKILL)
        assert_undisturbed(started, expected)
        while "] ready" not in server.stderr.wait_for("service=frontend0", WAIT):
            pass
        wait_restarted(server, 1)  # the frontends learn it from the scheduler's next stats, which may come later
        assert restarts(server) == 1
        # a second loss within 60 s is one more than --max-restarts 1: the launch stops, loudly
        procs = descendants(server.proc.pid)
        started = streams(server)
        started[0].wait_tokens(2)
        os.kill(rank_pids(server)[0], signal.SIGKILL)
        code = server.proc.wait(WAIT)
        for stream in started:
            stream.join(WAIT)
            assert stream.final is not None or (stream.error and stream.error["error_type"] == "generation")
    finally:
        server.stop()
    assert code != 0
    log = server.stderr.text
    assert "restarted 1 times in 60 s already: giving up" in log, log[-3000:]
    leftovers = [p for p in procs if process_alive(p)]
    assert leftovers == [], [command_line(p) for p in leftovers]
    assert not run_dir.exists()
