"""A worker rank against a scheduler played by the test: handshake order and the step-gap rule."""

import subprocess
import sys

import zmq

from llmbus.bus import messages as m
from llmbus.bus.rundir import RunDir
from llmbus.bus.sockets import open_socket, recv, send


def step(step_id: int, rid: str, tokens: list[int], new: bool) -> m.StepCommand:
    new_reqs = [m.NewRequestData(rid, m.SamplingParams(), [0], len(tokens))] if new else []
    return m.StepCommand(step_id=step_id, new_requests=new_reqs, rids=[rid], num_computed=[0 if new else 3],
                         num_new=[len(tokens)], token_ids=tokens, sample=[True])


def test_rank_answers_steps_and_dies_loudly_on_a_gap():
    with RunDir() as run_dir:
        ctx = zmq.Context()
        ep = run_dir.endpoints
        steps = open_socket(ctx, zmq.XPUB, ep.steps)
        results = open_socket(ctx, zmq.PULL, ep.results)
        control = open_socket(ctx, zmq.PULL, ep.control)
        proc = subprocess.Popen([sys.executable, "-m", "llmbus.workers", "--run-dir", str(run_dir.path),
                                 "--model-dir", "none", "--runner", "fake", "--rank", "0"])
        try:
            assert steps.poll(60_000) and steps.recv() == b"\x01"  # subscribed before anything else
            assert control.poll(60_000)
            hello = recv(control)
            assert isinstance(hello, m.WorkerHello) and hello.wire_version == m.WIRE_VERSION
            assert control.poll(60_000) and isinstance(recv(control), m.WorkerReady)
            send(steps, step(1, "a", [1, 2, 3], new=True))
            assert results.poll(30_000)
            res = recv(results)
            assert res.step_id == 1 and res.rids == ["a"] and len(res.token_ids) == 1
            send(steps, step(3, "a", [res.token_ids[0]], new=False))  # step 2 never came
            assert control.poll(30_000)
            fatal = recv(control)
            assert isinstance(fatal, m.WorkerFatal) and "got step 3 after step 1" in fatal.error
            assert proc.wait(30) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for s in (steps, results, control):
                s.close(0)
            ctx.term()
