"""The scheduling policy: a pure object (no sockets, no torch, no clocks it does not get handed).

Algorithm, once per step:
1. Every running request decodes one token (its last sampled one) — continuous batching: the batch is
   re-formed every step, finished requests leave it immediately.
2. Waiting requests are admitted first-come-first-served (head-of-line: a request that does not fit
   blocks the ones behind it, so long prompts are not starved) while the batch stays under
   ``max_batch_size``, the new prompts under ``max_batch_prefill_tokens``, and the KV blocks for the
   whole request (prompt + max_new_tokens) can be reserved now, as TGI v3 does; reserving up front
   means a running request can never run out of KV memory mid-generation.
3. New prompts and decode tokens go into the same forward pass.
``update`` takes the sampled tokens of that step and decides which requests finished (length before
EOS, as TGI checks). Finished and aborted requests free their blocks at once; their ids ride on the next
step so workers drop their state.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from llmbus.bus.messages import FinishReason, SamplingParams, StoppingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """The scheduler's view of one request."""

    rid: str
    frontend_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    prompt_logprobs: bool = False
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    admitted_time: float | None = None
    prompt_logprob_values: list[float] = field(default_factory=list)  # prompt tokens 1..n-1, as computed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_kv_tokens(self) -> int:
        # The last sampled token is never fed back, so its K/V is never written.
        return len(self.prompt_ids) + self.stopping.max_new_tokens - 1


class BlockAllocator:
    """Fixed pool of KV block ids; O(1) allocate and free."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._owned = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self._owned[b] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._owned[b]:
                raise AssertionError(f"block {b} freed twice")
            self._owned[b] = False
            self._free.append(b)


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_prefill_tokens: int = 4096
    max_batch_size: int | None = None  # None = bounded by KV blocks only

    def __post_init__(self) -> None:
        if self.max_batch_prefill_tokens < 1:
            raise ValueError("`max_batch_prefill_tokens` must be > 0")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("`max_batch_size` must be > 0")


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    token_ids: list[int]  # tokens computed this step
    num_computed: int  # before this step
    sample: bool


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work, from which the process builds a StepCommand."""

    new_requests: list[Request]  # first time on the workers
    seqs: list[ScheduledSeq]  # batch order: running decodes first, then new prefills
    finished_rids: list[str]  # workers drop these before the step


@dataclass(slots=True)
class TokenEvent:
    request: Request
    token_id: int
    logprob: float
    finish_reason: FinishReason
    prompt_logprobs: list[float] | None = None  # on a request's first token, when it asked for them


class Scheduler:
    """Waiting queue + running batch + KV block accounting. Drive it with schedule() / update()."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._dropped_rids: list[str] = []  # workers must forget these on the next step

    # ------------------------------------------------------------------ intake

    def add(self, request: Request) -> None:
        if request.rid in self._by_rid:
            raise ValueError(f"duplicate request id {request.rid!r}")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if self.allocator.blocks_for(request.max_kv_tokens) > self.allocator.num_blocks:
            raise ValueError(f"request needs {request.max_kv_tokens} KV tokens, more than the "
                             f"{self.allocator.num_blocks * self.allocator.block_size} the cache holds")
        request.status = RequestStatus.WAITING
        self._by_rid[request.rid] = request
        self.waiting.append(request)

    def abort(self, rids: list[str]) -> list[Request]:
        """Remove requests wherever they are; returns the ones that were known."""
        aborted = []
        for rid in rids:
            req = self._by_rid.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
                del self._by_rid[rid]
                req.status = RequestStatus.FINISHED
            else:
                self._finish(req)
            aborted.append(req)
        return aborted

    def abort_all(self) -> list[Request]:
        return self.abort(list(self._by_rid))

    # ------------------------------------------------------------------ stepping

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_requests(self) -> int:
        return len(self._by_rid)

    def schedule(self, now: float = 0.0) -> ScheduledBatch | None:
        seqs = [ScheduledSeq(r, [r.output_ids[-1]], r.num_computed, True) for r in self.running]
        new: list[Request] = []
        prefill_tokens = 0
        max_size = self.config.max_batch_size
        while self.waiting:
            if max_size is not None and len(seqs) >= max_size:
                break
            req = self.waiting[0]
            prompt_len = len(req.prompt_ids)
            # The first prompt of an empty batch is always admitted budget-wise: validation keeps prompts
            # under max_input_tokens <= max_batch_prefill_tokens, and refusing it would stall forever.
            if prefill_tokens + prompt_len > self.config.max_batch_prefill_tokens and (new or seqs):
                break
            blocks = self.allocator.allocate(self.allocator.blocks_for(req.max_kv_tokens))
            if blocks is None:
                break
            self.waiting.popleft()
            req.block_table = blocks
            req.status = RequestStatus.RUNNING
            req.admitted_time = now
            self.running.append(req)
            new.append(req)
            seqs.append(ScheduledSeq(req, list(req.prompt_ids), 0, True))
            prefill_tokens += prompt_len
        finished, self._dropped_rids = self._dropped_rids, []
        if not seqs:
            self._dropped_rids = finished
            return None
        return ScheduledBatch(new_requests=new, seqs=seqs, finished_rids=finished)

    def update(self, batch: ScheduledBatch, sampled: dict[str, tuple[int, float]],
               prompt_logprobs: dict[str, list[float]] | None = None) -> list[TokenEvent]:
        """Apply one step's sampled tokens (and the prompt logprobs computed in it, per rid); returns one
        event per token that reaches a client."""
        events = []
        for seq in batch.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran: its token is dropped
            req.num_computed = seq.num_computed + len(seq.token_ids)
            if prompt_logprobs and req.rid in prompt_logprobs:
                # A recomputed prompt (after preemption) reports its values again: keep the first ones.
                room = len(req.prompt_ids) - 1 - len(req.prompt_logprob_values)
                req.prompt_logprob_values.extend(prompt_logprobs[req.rid][:max(0, room)])
            if not seq.sample:
                continue
            token_id, logprob = sampled[req.rid]
            req.output_ids.append(token_id)
            reason = self._finish_reason(req, token_id)
            if reason is not FinishReason.NONE:
                self._finish(req)
            first_with_prompt = req.prompt_logprobs and len(req.output_ids) == 1
            events.append(TokenEvent(req, token_id, logprob, reason,
                                     req.prompt_logprob_values if first_with_prompt else None))
        return events

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _finish_reason(req: Request, token_id: int) -> FinishReason:
        if len(req.output_ids) >= req.stopping.max_new_tokens:
            return FinishReason.LENGTH
        if not req.stopping.ignore_eos and token_id in req.stopping.stop_token_ids:
            return FinishReason.EOS_TOKEN
        return FinishReason.NONE

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        del self._by_rid[req.rid]
        self.allocator.free(req.block_table)
        req.block_table = []
        self._dropped_rids.append(req.rid)
