"""Scheduling ahead (overlap), the policy alone: a driver that sends the next step before the last one's
result is applied, against a simulated rank group that runs the steps in the order sent, each only when its
result is awaited (so a step scheduled ahead allocates blocks before the step in flight writes its own),
resolves SAMPLED_LAST from the token it sampled last for the request, and skips a step sent ahead of one
that failed. The rank keeps its own token history per request (from the commands alone), checks that every
position a step relies on holds K/V of that very prefix, and samples a function of the prefix.

Over random workloads (arrivals, aborts, EOS and max_new_tokens anywhere, preemptions in a small pool,
prefix hits, chunked prompts, a failed step, a lost rank group) every request's tokens reach the client
exactly once and equal those it produces alone, in lock-step and overlapped alike, one step ahead or two.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import SAMPLED_LAST, FinishReason, SamplingParams, StoppingParams
from llmbus.scheduler.config import SchedulerProcessConfig, default_steps_ahead
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request, RequestStatus, ScheduledBatch
from llmbus.testing.policy_sim import check_budgets, next_token, solo_output

EOS = 3


@dataclass
class Command:
    """What the scheduler sends for a batch, copied when sent (the policy's requests move on)."""

    new: list[tuple[str, list[int], list[int]]]  # rid, block table, cached ids
    seqs: list[tuple[str, int, list[int], bool, list[int]]]  # rid, num_computed, tokens, sample, table
    added: list[tuple[str, list[int]]]
    finished: list[str]
    ahead: bool


def command(batch: ScheduledBatch, ahead: bool) -> Command:
    return Command(new=[(r.rid, list(r.block_table), r.tokens(0, r.num_computed)) for r in batch.new_requests],
                   seqs=[(s.request.rid, s.num_computed, list(s.token_ids), s.sample, list(s.request.block_table))
                         for s in batch.seqs],
                   added=[(rid, list(blocks)) for rid, blocks in batch.added_blocks],
                   finished=list(batch.finished_rids), ahead=ahead)


@dataclass
class Ranks:
    block_size: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    history: dict[str, list[int]] = field(default_factory=dict)  # rid -> the tokens it was fed, by position
    last_sampled: dict[str, int] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, slot) -> hash of the prefix
    last_failed: bool = False

    def run(self, cmd: Command, fail: bool) -> dict | None:
        """The sampled tokens by rid; None for a step that failed or was skipped."""
        bs = self.block_size
        for rid in cmd.finished:
            self.tables.pop(rid, None)
            self.history.pop(rid, None)
            self.last_sampled.pop(rid, None)
        for rid, table, cached in cmd.new:
            self.tables[rid], self.history[rid] = list(table), list(cached)
            self.last_sampled.pop(rid, None)
        for rid, blocks in cmd.added:
            self.tables[rid].extend(blocks)
        if cmd.ahead and self.last_failed:  # so is a step sent ahead of this one: it stays failed until one runs
            return None
        if fail:
            self.last_failed = True
            self.last_sampled.clear()
            return None
        self.last_failed = False
        sampled, writes = {}, {}
        for rid, num_computed, tokens, sample, table in cmd.seqs:
            assert self.tables[rid] == table, f"{rid}: the ranks' table {self.tables[rid]} != {table}"
            if SAMPLED_LAST in tokens:
                assert cmd.ahead and tokens[-1] == SAMPLED_LAST and tokens.count(SAMPLED_LAST) == 1, tokens
                tokens = tokens[:-1] + [self.last_sampled[rid]]
            history = self.history[rid]
            assert len(history) >= num_computed, f"{rid}: no token at position {len(history)}"
            del history[num_computed:]
            history += tokens
            assert len(table) * bs >= len(history), f"{rid}: {len(history)} tokens in {len(table)} blocks"
            for p in range(num_computed):
                assert self.kv.get((table[p // bs], p % bs)) == hash(tuple(history[:p + 1])), \
                    f"{rid}: stale K/V at position {p}"
            for p in range(num_computed, len(history)):
                slot = (table[p // bs], p % bs)
                assert slot not in writes, f"two sequences write block slot {slot} in one step"
                writes[slot] = hash(tuple(history[:p + 1]))
            if sample:
                sampled[rid] = self.last_sampled[rid] = next_token(tuple(history), EOS)
        self.kv.update(writes)
        return {rid: (token, -0.5) for rid, token in sampled.items()}


@dataclass
class InFlight:
    batch: ScheduledBatch
    cmd: Command
    void: bool = False


def run_workload(config: dict, specs: list[dict], overlap: bool, steps_ahead: int = 1):
    """Drive the policy as scheduler/process.py does (``steps_ahead`` steps sent past the one awaited); the
    events each request's client got."""
    def new_pool():
        return KVBlockManager(config["num_blocks"], config["block_size"], prefix_caching=config["caching"])

    policy = Scheduler(SchedulerConfig(config["prefill"], config["max_batch_size"],
                                       prefill_chunking=config["chunking"], waiting_served_ratio=0.5,
                                       max_waiting_tokens=3, steps_ahead=steps_ahead), new_pool())
    ranks = Ranks(config["block_size"])
    requests = [Request(rid=f"r{i}", frontend_id="f", prompt_ids=spec["prompt"], sampling=SamplingParams(),
                        stopping=StoppingParams(spec["max_new_tokens"], [EOS])) for i, spec in enumerate(specs)]
    events: dict[str, list[tuple[int, FinishReason]]] = {r.rid: [] for r in requests}
    aborted, failed, refused = set(), set(), set()
    in_flight: deque[InFlight] = deque()
    tick = 0
    last_arrival = max(spec["arrive_at"] for spec in specs)

    def send(batch: ScheduledBatch, ahead: bool) -> None:
        check_budgets(policy, batch)
        in_flight.append(InFlight(batch, command(batch, ahead)))

    while tick < 3000:
        for spec, req in zip(specs, requests):
            if spec["arrive_at"] == tick:
                try:
                    policy.add(req)
                except ValueError:
                    refused.add(req.rid)
        if not in_flight:
            batch = policy.schedule()
            if batch is not None:
                send(batch, ahead=False)
        if not in_flight:
            assert not policy.has_work, "work left but nothing scheduled"
            if tick > last_arrival:
                break
            tick += 1
            continue
        while (overlap and len(in_flight) <= steps_ahead
               and not any(f.void or not policy.may_schedule_ahead(f.batch) for f in in_flight)):
            batch = policy.schedule()
            if batch is None:
                break
            send(batch, ahead=True)
        for spec, req in zip(specs, requests):  # aborts arrive while the ranks compute
            if spec["abort_at"] == tick and policy.abort([req.rid]):
                aborted.add(req.rid)
        if tick == config["lose_ranks_at"]:
            in_flight.clear()
            ranks = Ranks(config["block_size"])
            for req in policy.restart(new_pool()):
                refused.add(req.rid)
            tick += 1
            continue
        flight = in_flight.popleft()
        sampled = ranks.run(flight.cmd, fail=tick == config["fail_at"] and not flight.void)
        if flight.void:
            assert sampled is None, "a step sent ahead of a failed one was computed"
        elif sampled is None:
            failed.update(r.rid for r in policy.fail_step(flight.batch))
            for later in in_flight:
                policy.discard(later.batch)
                later.void = True
        else:
            for ev in policy.update(flight.batch, sampled):
                events[ev.request.rid].append((ev.token_id, ev.finish_reason))
        policy.kv.check([r.block_table for r in policy.running])
        tick += 1
    assert not policy.has_work and not in_flight, "some admitted request never finished"
    assert policy.kv.num_available == policy.kv.num_blocks, "blocks leaked"
    return requests, events, aborted | failed, refused


request_st = st.fixed_dictionaries({
    "arrive_at": st.integers(0, 20),
    "prompt": st.lists(st.integers(10, 13), min_size=1, max_size=20),
    "max_new_tokens": st.integers(1, 12),
    "abort_at": st.one_of(st.none(), st.integers(0, 40)),
})

config_st = st.fixed_dictionaries({
    "num_blocks": st.integers(10, 30),
    "block_size": st.sampled_from([1, 2, 4]),
    "prefill": st.integers(1, 32),
    "max_batch_size": st.one_of(st.none(), st.integers(1, 6)),
    "chunking": st.booleans(),
    "caching": st.booleans(),
    "fail_at": st.one_of(st.none(), st.integers(0, 30)),
    "lose_ranks_at": st.one_of(st.none(), st.integers(0, 30)),
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=config_st, specs=st.lists(request_st, min_size=1, max_size=10))
def test_overlapped_streams_equal_lock_step_exactly_once(config, specs):
    for overlap, steps_ahead in ((False, 1), (True, 1), (True, 2)):
        requests, events, cut_short, refused = run_workload(config, specs, overlap, steps_ahead)
        for spec, req in zip(specs, requests):
            if req.rid in refused:
                continue
            solo = solo_output(spec["prompt"], spec["max_new_tokens"], EOS)
            tokens = [token for token, _ in events[req.rid]]
            reasons = [reason for _, reason in events[req.rid]]
            assert tokens == req.output_ids, f"{req.rid}: the client's tokens differ from the request's"
            if req.rid in cut_short:
                assert tokens == solo[:len(tokens)] and FinishReason.NONE == (reasons[-1] if reasons else 0)
                continue
            assert req.status is RequestStatus.FINISHED
            assert tokens == solo, (overlap, steps_ahead, req.rid)
            assert all(r is FinishReason.NONE for r in reasons[:-1]) and reasons[-1] is not FinishReason.NONE


def test_a_step_scheduled_ahead_feeds_the_pending_token_and_reserves_its_slot():
    kv = KVBlockManager(8, 2, prefix_caching=True)
    policy = Scheduler(SchedulerConfig(max_batch_prefill_tokens=16), kv)
    req = Request(rid="a", frontend_id="f", prompt_ids=[10, 11, 12], sampling=SamplingParams(),
                  stopping=StoppingParams(3, [EOS]))
    policy.add(req)
    first = policy.schedule()
    assert first.seqs[0].token_ids == [10, 11, 12] and len(req.block_table) == 2
    second = policy.schedule()  # ahead: the prompt's token is not known yet
    assert [(s.num_computed, s.token_ids, s.is_decode) for s in second.seqs] == [(3, [SAMPLED_LAST], True)]
    assert len(req.block_table) == 2, "position 3 fits the second block"
    assert policy.update(first, {"a": (20, -1.0)})[0].token_id == 20
    third = policy.schedule()  # ahead of the second step: its token is pending, position 4 needs a block
    assert [(s.num_computed, s.token_ids) for s in third.seqs] == [(4, [SAMPLED_LAST])]
    assert len(req.block_table) == 3
    policy.update(second, {"a": (21, -1.0)})
    # its third token is its last (max_new_tokens 3): nothing is scheduled past it
    assert policy.schedule() is None
    events = policy.update(third, {"a": (22, -1.0)})
    assert [(e.token_id, e.finish_reason) for e in events] == [(22, FinishReason.LENGTH)]
    assert req.output_ids == [20, 21, 22] and kv.num_available == kv.num_blocks


def test_a_request_that_ended_drops_the_token_of_the_step_scheduled_ahead():
    kv = KVBlockManager(8, 4, prefix_caching=False)
    policy = Scheduler(SchedulerConfig(max_batch_prefill_tokens=16), kv)
    req = Request(rid="a", frontend_id="f", prompt_ids=[10, 11], sampling=SamplingParams(),
                  stopping=StoppingParams(10, [EOS]))
    policy.add(req)
    first = policy.schedule()
    second = policy.schedule()
    events = policy.update(first, {"a": (EOS, -1.0)})
    assert [(e.token_id, e.finish_reason) for e in events] == [(EOS, FinishReason.EOS_TOKEN)]
    assert kv.num_available == kv.num_blocks, "its blocks went back at once"
    assert policy.update(second, {"a": (30, -1.0)}) == [], "the token computed ahead reaches nobody"
    assert not policy.has_work and req.output_ids == [EOS]


def test_ranks_on_a_gpu_get_two_steps_ahead_by_default_and_cpu_ranks_one():
    assert SchedulerProcessConfig.__dataclass_fields__["steps_ahead"].default is None  # decided by the ranks
    assert default_steps_ahead("cuda:0") == default_steps_ahead("cuda") == 2
    assert default_steps_ahead("cpu") == 1
