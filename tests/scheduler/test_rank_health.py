"""The scheduler's rank health probes as a pure object: who waits, which ranks still owe an answer."""

from llmbus.scheduler.health import Answer, RankHealth


def test_ok_once_every_rank_acknowledged_a_probe_sent_after_the_check():
    h = RankHealth(world_size=2)
    assert h.probe_to_send() is None  # nobody asked
    h.check("f0", 1, timeout_s=5, now=0)
    probe = h.probe_to_send()
    assert probe == 1 and h.probe_to_send() is None  # one probe out at a time
    h.check("f1", 7, timeout_s=5, now=0.1)  # arrives while the probe is out: waits for the next one
    assert h.ack(0, probe) == []
    assert h.ack(0, probe) == [], "a rank counts once"
    assert h.ack(1, probe) == [Answer("f0", 1, True)]
    second = h.probe_to_send()
    assert second == 2
    assert h.ack(1, second) == [] and h.ack(0, second) == [Answer("f1", 7, True)]
    assert h.next_deadline() is None


def test_a_rank_that_does_not_answer_fails_the_check_and_its_late_answer_is_ignored():
    h = RankHealth(world_size=3)
    h.check("f0", 1, timeout_s=2, now=10)
    probe = h.probe_to_send()
    h.ack(0, probe)
    h.ack(2, probe)
    assert h.expire(11.9) == [] and h.next_deadline() == 12
    (answer,) = h.expire(12)
    assert (answer.ok, answer.message) == (False, "worker rank(s) 1 did not answer a health probe in time")
    assert h.ack(1, probe) == []  # too late
    h.check("f0", 2, timeout_s=2, now=13)
    fresh = h.probe_to_send()
    assert fresh == probe + 1, "the next check does not wait on the abandoned probe"
    assert [h.ack(r, fresh) for r in range(3)][-1] == [Answer("f0", 2, True)]


def test_a_step_result_answers_the_checks_waiting_and_the_probe_out_answers_nobody_after():
    """The probe queues behind the steps the ranks hold (two long prompt steps outlast the check's timeout):
    a step's result, which every rank must have computed, answers the checks instead."""
    h = RankHealth(world_size=2)
    h.check("f0", 1, timeout_s=5, now=0)
    probe = h.probe_to_send()
    h.check("f1", 2, timeout_s=5, now=1)
    assert h.progress() == [Answer("f0", 1, True), Answer("f1", 2, True)]
    assert h.next_deadline() is None and h.expire(100) == []
    assert h.ack(0, probe) == [] and h.ack(1, probe) == []
    h.check("f0", 3, timeout_s=5, now=101)  # idle again: a probe answers it
    fresh = h.probe_to_send()
    assert fresh == probe + 1 and [h.ack(r, fresh) for r in range(2)][-1] == [Answer("f0", 3, True)]


def test_a_result_waiting_past_the_step_deadline_is_taken_not_blamed_on_the_ranks(tmp_path):
    """A scheduler that was itself stopped (SIGSTOP, swapped out) wakes past its step's deadline with the result
    already waiting: it takes it (it used to declare the ranks hung and restart a healthy group)."""
    import os

    import pytest
    import structlog
    import zmq

    from llmbus.bus import messages as m
    from llmbus.bus.rundir import Endpoints
    from llmbus.bus.sockets import open_socket, send
    from llmbus.scheduler.ranks import RankGroup, ServiceHooks, WorkersLost

    ctx = zmq.Context()
    endpoints = Endpoints.in_dir(tmp_path)
    intake = open_socket(ctx, zmq.PULL, endpoints.requests)
    hooks = ServiceHooks(intake=intake, drain_intake=lambda: None, heartbeat=lambda: None, heartbeat_interval_s=1.0,
                         to_frontend=lambda *_: None)
    group = RankGroup(endpoints, 1, 1.0, ctx, structlog.get_logger(), hooks)
    rank0 = ctx.socket(zmq.PUSH)
    try:
        group.pids[0] = os.getpid()  # this process plays rank 0
        with pytest.raises(WorkersLost, match="step 1 got no result within 0.0s"):
            group.wait_result(1, deadline_s=0.0)  # nothing came: the ranks are blamed, as before
        rank0.connect(endpoints.results)
        send(rank0, m.StepResult(step_id=1, rids=[], token_ids=[], logprobs=[]))
        while not group.results.poll(1000):  # arrived before the scheduler looks (it was stopped meanwhile)
            pass
        assert group.wait_result(1, deadline_s=0.0).step_id == 1
    finally:
        for sock in (rank0, group.steps, group.results, group.control, group.control_monitor, intake):
            sock.close(0)
        ctx.term()
