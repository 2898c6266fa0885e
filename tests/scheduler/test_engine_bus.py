"""Scheduler and worker ranks as real processes over real ipc sockets, with the fake runner.

The test plays the frontend with raw sockets, so what is checked is the bus contract itself: handshake,
continuous batching, finishing, aborts, and failure reporting.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from llmbus.bus import messages as m
from llmbus.bus.rundir import RunDir
from llmbus.bus.sockets import recv, send
from llmbus.testing import SupervisorSocket
from llmbus.testing.raw_frontend import RawFrontend, expected_tokens

WORLD_SIZE = 2
MAX_RESTARTS = 1  # the crash-loop test restarts once, and the second loss gives up


@pytest.fixture(scope="module")
def engine():
    run_dir = RunDir()
    sup = SupervisorSocket(run_dir.path)
    env = dict(os.environ, **sup.env)
    common = ["--run-dir", str(run_dir.path)]
    workers_argv = [sys.executable, "-m", "llmbus.workers", *common, "--model-dir", "none", "--gpus", str(WORLD_SIZE),
                    "--runner", "fake", "--num-blocks", "64", "--block-size", "4"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "llmbus.scheduler", *common, "--world-size", str(WORLD_SIZE),
                          "--max-restarts", str(MAX_RESTARTS)], env=env),
        # its own session, as `llmbus up` starts it: the test kills the whole group when asked to restart it
        subprocess.Popen(workers_argv, env=env, start_new_session=True),
    ]

    def restart_workers() -> None:
        """What the supervisor does on RestartService: SIGKILL what is left of the group, start a new one."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        procs[1] = subprocess.Popen(workers_argv, env=env, start_new_session=True)

    frontends: list[RawFrontend] = []

    def frontend(frontend_id: str) -> RawFrontend:
        """A frontend that stays connected until the scheduler has exited: at its exit the scheduler gives the
        events queued for a frontend whose process still runs (this one) 2 s to leave, and a closed one's
        heartbeats never would."""
        fe = RawFrontend(run_dir, frontend_id)
        frontends.append(fe)
        return fe

    try:
        sup.wait_ready("scheduler", timeout=120)
        yield SimpleNamespace(procs=procs, sup=sup, restart_workers=restart_workers, frontend=frontend)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[1].pid, signal.SIGKILL)  # ranks of a group the test started last
        for fe in frontends:
            fe.close()
        sup.close()
        run_dir.close()


def test_hello_reports_kv_capacity(engine):
    fe = engine.frontend("hello")
    assert fe.hello.max_batch_total_tokens == 64 * 4 and fe.hello.block_size == 4


def test_concurrent_requests_batch_together_and_finish(engine):
    fe = engine.frontend("batch")
    prompts = {str(i): list(range(1, 2 + i)) for i in range(8)}
    for rid, prompt in prompts.items():
        fe.add(rid, prompt, max_new_tokens=5)
    tokens, reasons, batches = fe.collect(len(prompts))
    for rid, prompt in prompts.items():
        assert tokens[f"batch-{rid}"] == expected_tokens(prompt, 5)
        assert reasons[f"batch-{rid}"] is m.FinishReason.LENGTH
    # one message per step, not one per token: 8 requests x 5 tokens in far fewer than 40 messages
    assert batches < 8 * 5
    stats = fe.wait_for_idle_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == 64, stats


def test_queue_time_rides_on_the_first_token_only(engine):
    fe = engine.frontend("queue")
    arrived = time.time() - 5.0  # as if validation had taken 5 s: the scheduler counts from arrival
    send(fe.requests, m.AddRequest("queue-a", fe.id, [3, 4], m.SamplingParams(), m.StoppingParams(3, []),
                                   arrival_time=arrived))
    queue_times = []
    while len(queue_times) < 3:
        ev = fe.next_event()
        queue_times += [q for rid, q in zip(ev.rids, ev.queue_times) if rid == "queue-a"]
    assert 5.0 <= queue_times[0] < 60 and queue_times[1:] == [0.0, 0.0]


def test_eos_and_abort(engine):
    fe = engine.frontend("abort")
    prompt = [5, 6, 7]
    eos_at_3 = expected_tokens(prompt, 3)[-1]
    fe.add("eos", prompt, max_new_tokens=10, eos=[eos_at_3])
    fe.add("long", [9, 9], max_new_tokens=60)
    seen_long = 0
    eos_done = False
    while not (eos_done and seen_long >= 2):
        ev = fe.next_event()
        for rid, tok, fin in zip(ev.rids, ev.token_ids, ev.finish_reasons):
            if rid == "abort-eos" and fin:
                assert fin == m.FinishReason.EOS_TOKEN and tok == eos_at_3
                eos_done = True
            if rid == "abort-long":
                seen_long += 1
    send(fe.requests, m.AbortRequest(["abort-long"]))
    # A fresh request after the abort still completes. The scheduler reads the abort before the new request
    # (one socket, in order), so once the new one has a token the aborted one gets none: a step computed
    # for it before the abort (one may be running and one scheduled ahead) drops its token. How many of its
    # tokens were already on their way when the abort was sent depends on how fast this process reads.
    fe.add("after", [1], max_new_tokens=3)
    order, finished = [], {}
    while "abort-after" not in finished:
        ev = fe.next_event()
        for rid, fin in zip(ev.rids, ev.finish_reasons):
            order.append(rid)
            if fin:
                finished[rid] = m.FinishReason(fin)
    assert finished == {"abort-after": m.FinishReason.LENGTH}
    assert "abort-long" not in order[order.index("abort-after"):], order
    stats = fe.wait_for_idle_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "the aborted request kept its blocks"


def test_malformed_frames_do_not_kill_the_scheduler(engine):
    fe = engine.frontend("junk")
    fe.requests.send_multipart([b"\x01", b"\xc1not msgpack"])
    fe.requests.send_multipart([b"\xff", b"\x90"])
    fe.requests.send(b"single frame")
    fe.add("ok", [3, 4], max_new_tokens=2)
    tokens, reasons, _ = fe.collect(1)
    assert tokens["junk-ok"] == expected_tokens([3, 4], 2)
    assert all(p.poll() is None for p in engine.procs)


def _kill_a_rank(group: subprocess.Popen, which: int) -> None:
    rank_pids = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(group.pid)]).split()]
    assert len(rank_pids) == WORLD_SIZE
    os.kill(rank_pids[which], signal.SIGKILL)


def test_lost_ranks_are_restarted_and_requests_resume_until_a_crash_loop(engine):
    """Runs last in this module: it takes the engine down. The test plays the supervisor: on each
    RestartService it starts a new worker group."""
    procs, sup = engine.procs, engine.sup
    fe = engine.frontend("kill")
    fe.add("x", [1, 2], max_new_tokens=120)
    fe.add("y", [7, 8, 9], max_new_tokens=80)
    tokens: dict[str, list[int]] = {}
    finished = set()

    def pump(until) -> None:
        """Take tokens and heartbeats until ``until()``."""
        while not until():
            assert fe.events.poll(30_000), "the scheduler went silent"
            ev = recv(fe.events)
            if isinstance(ev, m.SchedulerStats):
                fe.stats = ev
                continue
            assert isinstance(ev, m.TokenBatch), ev
            for rid, tok, fin in zip(ev.rids, ev.token_ids, ev.finish_reasons):
                tokens.setdefault(rid, []).append(tok)
                if fin:
                    finished.add(rid)

    def restarts() -> int:
        return fe.stats.worker_restarts if fe.stats else 0

    pump(lambda: tokens)
    # One restart (a worker group's start is most of this test's time): a rank mid-decode. Resuming after a
    # loss of rank 0 is test_recovery.py's (one rank) and a whole group's test_overlap_bus.py's (two ranks).
    _kill_a_rank(procs[1], -1)
    restart = sup.wait_for(m.RestartService)
    assert restart.service == "workers" and "worker rank" in restart.reason, restart
    engine.restart_workers()
    pump(lambda: restarts() == 1)  # the new ranks are ready: a loss from now on is theirs
    pump(lambda: len(finished) == 2)
    # every token exactly once, as an undisturbed run computes them
    assert tokens["kill-x"] == expected_tokens([1, 2], 120)
    assert tokens["kill-y"] == expected_tokens([7, 8, 9], 80)
    # The loss was restarted (--max-restarts 1 in 60 s); the next, rank 0 of the new group (the scheduler
    # watches the ranks that came back), is a crash loop: EngineDead.
    _kill_a_rank(procs[1], 0)
    ev = fe.next_event()
    assert isinstance(ev, m.EngineDead) and "giving up" in ev.reason and "worker rank 0" in ev.reason, ev
    assert procs[0].wait(30) == 1  # the scheduler exits non-zero so a supervisor tears everything down


def test_events_for_a_frontend_that_exited_do_not_hold_the_schedulers_exit():
    """At exit a running frontend's sockets linger (its last tokens must get out), an exited one's do not: the
    heartbeats queued for it would hold the scheduler's close for the whole linger, at every stop."""
    import zmq

    from llmbus.scheduler.process import SchedulerService

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    ctx = zmq.Context()
    try:
        sockets = {name: ctx.socket(zmq.PUSH) for name in ("running", "exited", "remote")}
        service = SimpleNamespace(frontends=sockets, frontend_pids={"running": os.getpid(), "exited": exited.pid})
        SchedulerService.let_last_events_out(service)  # "remote": over tcp, no pid known
        assert {name: sock.getsockopt(zmq.LINGER) for name, sock in sockets.items()} == {
            "running": 2000, "exited": 0, "remote": 2000}
    finally:
        ctx.destroy(linger=0)
