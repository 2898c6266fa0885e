"""A step that runs out of memory fails its requests, not the ranks: the policy's rule (pure), a ModelRunner
step whose forward pass or sampling raises torch.OutOfMemoryError, and the whole path through a real
scheduler and worker rank (the fake runner runs out of memory on OUT_OF_MEMORY_TOKEN)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from llmbus.bus import messages as m
from llmbus.bus.rundir import RunDir
from llmbus.frontend.errors import engine_error
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request
from llmbus.testing import SupervisorSocket
from llmbus.testing.raw_frontend import RawFrontend, expected_tokens
from llmbus.workers import model_runner as mr
from llmbus.workers.fake import OUT_OF_MEMORY_TOKEN, FakeRunner


def _request(rid: str, prompt: list[int], max_new_tokens: int = 8) -> Request:
    return Request(rid=rid, frontend_id="f", prompt_ids=prompt, sampling=m.SamplingParams(),
                   stopping=m.StoppingParams(max_new_tokens))


def _run(policy: Scheduler, batch, token: int = 5) -> None:
    policy.update(batch, {s.request.rid: (token, -1.0) for s in batch.seqs if s.sample})


def test_policy_fails_the_prompts_of_a_failed_step_and_the_decodes_run_on():
    kv = KVBlockManager(32, 4, prefix_caching=True)
    policy = Scheduler(SchedulerConfig(max_batch_prefill_tokens=64), kv)
    policy.add(_request("old", [1, 2, 3, 4, 5, 6]))
    _run(policy, policy.schedule())  # its prompt is in the cache now, and it decodes
    policy.add(_request("new", list(range(10, 20))))
    batch = policy.schedule()
    assert [(s.request.rid, s.is_decode) for s in batch.seqs] == [("old", True), ("new", False)]
    old = policy.running[0]
    before = (old.num_computed, list(old.block_table), list(old.output_ids))
    failed = policy.fail_step(batch)
    assert [r.rid for r in failed] == ["new"]
    assert (old.num_computed, old.block_table, old.output_ids) == before, "the decode keeps its state"
    again = policy.schedule()
    assert [(s.request.rid, s.num_computed, s.token_ids) for s in again.seqs] == [("old", 6, [5])]
    assert again.finished_rids == ["new"], "the ranks drop the failed request's state"
    # a step of decodes alone that fails: every one of them fails
    assert [r.rid for r in policy.fail_step(again)] == ["old"]
    assert not policy.has_work and kv.num_available == kv.num_blocks
    # only what earlier steps computed was cached: old's prompt (one full block of 4), nothing of "new"
    assert kv.num_cached == 1


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return mr.ModelRunner(str(tiny_model_dir), num_blocks=16, block_size=16)


def _seq(rid: str, tokens: list[int], blocks: list[int]) -> mr.SeqInput:
    return mr.SeqInput(rid=rid, token_ids=tokens, num_computed=0, block_table=blocks, sample=True,
                       sampling=m.SamplingParams(), prompt_len=len(tokens))


def test_runner_reports_a_step_that_ran_out_of_memory_and_runs_the_next(runner, monkeypatch):
    seqs = [_seq("a", [1, 2, 3], [0]), _seq("b", [4, 5], [1])]
    expected = runner.step(seqs)
    real_forward = runner.model.forward

    def forward_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.2 GiB is free. Including non-PyTorch memory ...\n")

    monkeypatch.setattr(runner.model, "forward", forward_out_of_memory)
    out = runner.step(seqs)
    assert out.rids == [] and out.token_ids == []
    assert out.failed == ("Server error: out of memory computing a step of 5 tokens for 2 request(s): CUDA out of "
                          "memory. Tried to allocate 8.00 GiB. Lower `--max-batch-prefill-tokens` or "
                          "`--cuda-memory-fraction`")
    # with tensor parallelism an out-of-memory error inside the forward pass stays a group failure
    monkeypatch.setattr(runner, "world_size", 2)
    with pytest.raises(torch.OutOfMemoryError):
        runner.step(seqs)
    # ... but after it (rank 0's sampling) the step fails alone, once rank 0 has given the other ranks, which
    # wait in the broadcast of its sampled ids (a step sent ahead feeds on them), placeholders
    monkeypatch.setattr(runner.model, "forward", real_forward)

    def sample_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory in sampling")

    broadcasts = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src: broadcasts.append((t.tolist(), src)))
    monkeypatch.setattr(mr, "sample", sample_out_of_memory)
    assert runner.step(seqs).failed.endswith("out of memory in sampling. Lower `--max-batch-prefill-tokens` or "
                                             "`--cuda-memory-fraction`")
    assert broadcasts == [([0, 0], 0)]
    monkeypatch.undo()
    again = runner.step(seqs)
    assert (again.rids, again.token_ids) == (expected.rids, expected.token_ids)


def test_the_frontend_answers_with_tgis_generation_error():
    error = engine_error("generation", "Server error: out of memory computing a step of 5 tokens")
    assert error.status == 424 and error.body() == {
        "error": "Request failed during generation: Server error: out of memory computing a step of 5 tokens",
        "error_type": "generation"}


def test_fake_runner_runs_out_of_memory_on_its_prompt_token_only():
    fake = FakeRunner()
    oom = _seq("x", [1, OUT_OF_MEMORY_TOKEN], [0])
    assert fake.step([oom]).failed.startswith("Server error: out of memory computing a step of 2 tokens")
    decode = mr.SeqInput(rid="y", token_ids=[OUT_OF_MEMORY_TOKEN], num_computed=3, block_table=[0], sample=True,
                         sampling=m.SamplingParams(), prompt_len=3)
    assert fake.step([decode]).failed == "", "a sampled token equal to it is an ordinary decode"


def test_a_step_out_of_memory_fails_its_prompt_and_the_rest_go_on():
    """Real scheduler and worker rank processes: a request whose step runs out of memory gets TGI's
    generation error while a running request completes, the ranks are not restarted and every KV block is
    free at the end."""
    run_dir = RunDir()
    sup = SupervisorSocket(run_dir.path)
    env = dict(os.environ, **sup.env)
    common = ["--run-dir", str(run_dir.path)]
    procs = [subprocess.Popen([sys.executable, "-m", "llmbus.scheduler", *common, "--world-size", "1"], env=env),
             subprocess.Popen([sys.executable, "-m", "llmbus.workers", *common, "--model-dir", "none", "--gpus", "1",
                               "--runner", "fake", "--num-blocks", "64", "--block-size", "4"], env=env,
                              start_new_session=True)]
    fe = None
    try:
        sup.wait_ready("scheduler", timeout=120)
        fe = RawFrontend(run_dir, "oom")
        fe.add("long", [1, 2, 3], max_new_tokens=60)
        tokens: dict[str, list[int]] = {}
        failures: dict[str, m.RequestFailed] = {}
        finished: set[str] = set()

        def pump(until) -> None:
            while not until():
                ev = fe.next_event()
                if isinstance(ev, m.RequestFailed):
                    failures[ev.rid] = ev
                    continue
                assert isinstance(ev, m.TokenBatch), ev
                for rid, token, reason in zip(ev.rids, ev.token_ids, ev.finish_reasons):
                    tokens.setdefault(rid, []).append(token)
                    if reason:
                        finished.add(rid)

        pump(lambda: tokens.get("oom-long"))
        fe.add("big", [4, 5, OUT_OF_MEMORY_TOKEN, 6, 7], max_new_tokens=10)  # joins the running request's steps
        pump(lambda: "oom-big" in failures)
        failure = failures["oom-big"]
        assert failure.error_type == "generation" and failure.message.startswith(
            "Server error: out of memory computing a step of "), failure
        assert "oom-big" not in tokens
        fe.add("after", [8, 9], max_new_tokens=4)
        pump(lambda: {"oom-long", "oom-after"} <= finished)
        assert tokens["oom-long"] == expected_tokens([1, 2, 3], 60), "the running request lost no token"
        assert tokens["oom-after"] == expected_tokens([8, 9], 4)
        fe.wait_for_idle_stats()
        assert fe.stats.worker_restarts == 0 and fe.stats.kv_blocks_free == fe.stats.kv_blocks_total == 64, fe.stats
        assert all(p.poll() is None for p in procs), "no process died"
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
        if fe is not None:  # once the scheduler is gone: it lingers on events queued for a closed frontend
            fe.close()
        sup.close()
        run_dir.close()
