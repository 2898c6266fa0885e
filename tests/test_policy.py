"""The scheduling policy alone: hand-made requests and step results, no model, no sockets."""

import pytest

from llmbus.bus.messages import FinishReason, SamplingParams, StoppingParams
from llmbus.scheduler.policy import BlockAllocator, Request, RequestStatus, Scheduler, SchedulerConfig


def make_request(rid: str, prompt_len: int = 4, max_new_tokens: int = 4, eos: int = 2) -> Request:
    return Request(rid=rid, frontend_id="f0", prompt_ids=list(range(10, 10 + prompt_len)),
                   sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens, [eos]))


def make_scheduler(num_blocks=64, block_size=4, prefill=4096, max_batch_size=None) -> Scheduler:
    return Scheduler(SchedulerConfig(prefill, max_batch_size), BlockAllocator(num_blocks, block_size))


def step(s: Scheduler, token: int = 100):
    batch = s.schedule()
    assert batch is not None
    events = s.update(batch, {seq.request.rid: (token, -0.5) for seq in batch.seqs if seq.sample})
    return batch, events


def test_new_requests_join_running_batch_between_steps():
    s = make_scheduler()
    s.add(make_request("a", max_new_tokens=10))
    b1, _ = step(s)
    assert [q.request.rid for q in b1.seqs] == ["a"] and b1.seqs[0].num_computed == 0
    s.add(make_request("b", prompt_len=6))
    b2, _ = step(s)
    # a decodes one token, b is prefilled, in the same step
    assert [(q.request.rid, len(q.token_ids), q.num_computed) for q in b2.seqs] == [("a", 1, 4), ("b", 6, 0)]
    assert [r.rid for r in b2.new_requests] == ["b"]


def test_length_finishes_before_eos_and_frees_blocks():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(make_request("a", prompt_len=4, max_new_tokens=2))
    step(s, token=100)
    assert s.allocator.num_free == 8 - 2  # 4 + 2 - 1 = 5 KV tokens -> 2 blocks
    _, events = step(s, token=2)  # EOS id on the last allowed token: TGI reports length
    assert events[0].finish_reason is FinishReason.LENGTH
    assert s.allocator.num_free == 8 and not s.has_work


def test_eos_finishes_and_ignore_eos_does_not():
    s = make_scheduler()
    s.add(make_request("a", max_new_tokens=5))
    r = make_request("b", max_new_tokens=5)
    r.stopping.ignore_eos = True
    s.add(r)
    _, events = step(s, token=2)
    reasons = {e.request.rid: e.finish_reason for e in events}
    assert reasons == {"a": FinishReason.EOS_TOKEN, "b": FinishReason.NONE}
    batch = s.schedule()
    assert batch.finished_rids == ["a"]  # workers are told to drop a's state


def test_prefill_budget_and_head_of_line():
    s = make_scheduler(prefill=10)
    for rid, n in (("a", 6), ("b", 6), ("c", 2)):
        s.add(make_request(rid, prompt_len=n))
    b1 = s.schedule()
    # b does not fit in the budget, and c may not jump the queue
    assert [q.request.rid for q in b1.seqs] == ["a"]


def test_oversized_first_prompt_still_admitted_alone():
    s = make_scheduler(prefill=4)
    s.add(make_request("a", prompt_len=6))
    assert [q.request.rid for q in s.schedule().seqs] == ["a"]


def test_max_batch_size():
    s = make_scheduler(max_batch_size=2)
    for rid in "abc":
        s.add(make_request(rid))
    assert len(s.schedule().seqs) == 2


def test_block_budget_queues_until_blocks_free():
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add(make_request("a", prompt_len=4, max_new_tokens=5))  # 8 KV tokens: 2 blocks
    s.add(make_request("b", prompt_len=4, max_new_tokens=9))  # 12 KV tokens: 3 blocks
    b1 = s.schedule()
    assert [q.request.rid for q in b1.seqs] == ["a"]
    s.update(b1, {"a": (100, 0.0)})
    for _ in range(4):
        step(s)
    b = s.schedule()
    assert [q.request.rid for q in b.seqs] == ["b"] and b.finished_rids == ["a"]


def test_request_that_can_never_fit_is_refused():
    s = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the 8"):
        s.add(make_request("a", prompt_len=4, max_new_tokens=6))


def test_abort_waiting_and_running():
    s = make_scheduler(num_blocks=16, block_size=4, max_batch_size=1)
    s.add(make_request("a", max_new_tokens=10))
    s.add(make_request("b"))
    batch = s.schedule()
    aborted = s.abort(["a", "b", "unknown"])
    assert {r.rid for r in aborted} == {"a", "b"}
    assert all(r.status is RequestStatus.FINISHED for r in aborted)
    assert s.allocator.num_free == 16
    # the in-flight step's token for an aborted request is dropped
    assert s.update(batch, {"a": (100, 0.0)}) == []
    assert not s.has_work
    assert s.schedule() is None


def test_allocator_refuses_double_free():
    a = BlockAllocator(4, 16)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(AssertionError):
        a.free(blocks[:1])
