"""The scheduling policy: a pure object (no sockets, no torch, no clock it is not handed).

Every step, ``schedule`` builds one forward pass and ``update`` applies its sampled tokens.

1. **Running requests** come first, oldest admission first. A request with one token left to compute
   (the token it sampled last) decodes; one still inside its prompt computes its next chunk. Each grows
   its KV blocks as it needs them. When no block is left, the most recently admitted request is
   *preempted*: its blocks are freed (their full chunks stay in the prefix cache) and it goes back to
   the head of the queue, to recompute its prompt and generated tokens later. Its output is the same as
   if it had run on; the oldest request always progresses, so every request finishes.
2. **Waiting requests** are admitted first come, first served; a request that does not fit stops the
   ones behind it (head-of-line blocking, as TGI: long prompts are not starved). Admission takes the
   blocks of the prompt's cached prefix (always leaving at least one token to compute), plus fresh
   blocks for the tokens computed this step, keeping a small watermark free for the running requests'
   growth. Nobody is admitted in a step that preempted.
3. **Budgets, TGI's semantics.** ``max_batch_prefill_tokens`` caps the tokens computed per step. With
   chunked prefill (the default) decode tokens count against it and the last prompt admitted is cut to
   what is left, so a long prompt is spread over several steps that also carry every running request's
   decode token. Without chunking a prompt is computed whole (a single one may exceed the budget), and
   while a batch runs, new requests join only in groups of ``waiting_served_ratio`` x the batch size,
   or after ``max_waiting_tokens`` steps without admission. ``max_batch_size`` caps the batch.

Finished, aborted and preempted requests release their blocks at once; their ids ride on the next
step so the workers drop their state.

5. **Scheduling ahead** (overlap; scheduler/process.py). ``schedule`` may be called again before the last
   batch's ``update``: the next step is then built as if every request of the step in flight goes on. A
   request that samples in the step in flight has one *pending* token nobody knows yet; its next decode
   feeds ``SAMPLED_LAST`` in its place (the rank puts in the token it sampled) and reserves the KV slot
   for it. With ``steps_ahead`` 2 a second step may follow before the first result: a request then has up
   to two pending tokens (each step's ``SAMPLED_LAST`` is the token the step just before it sampled).
   ``ahead`` counts the tokens of steps not yet applied, so a request's next step starts after them;
   ``update`` turns them into computed tokens, or drops a step's result for a request that finished, was
   aborted or was preempted since it was scheduled (``generation``): the step scheduled ahead of its
   end computed a token nobody sees, and a preempted one recomputes its tokens. A request is not scheduled
   ahead past ``max_new_tokens``, nor given guesses (the guess follows the token that is not known yet).
   Blocks go back to the pool at once even while a step in flight still writes to them: the ranks run
   steps in order, so whoever gets a block next writes it after that step; only computed tokens' full
   blocks enter the prefix cache, and a step in flight writes past them.

4. **Speculation** (``speculate`` > 0; scheduler/speculation.py). A decoding request also feeds up to
   ``speculate`` guessed tokens when the batch has at most ``speculate_max_batch`` decodes (beyond that a
   step is compute-bound and guesses cost more than they save) and blocks for them are free (a guess never
   preempts anyone). How many is its ``GuessRate``'s call from its recent acceptance: 0 while guesses do
   not pay, in which case an n-gram request keeps checking what it would have guessed against the token
   that comes (free) and resumes when that starts to hold, and a draft-model request probes with one
   guess after a back-off. The ranks keep the guesses their samples agree with, plus one sampled token;
   only those tokens' K/V count as computed, so a rejected guess's slots are rewritten by later tokens and
   the prefix cache only ever holds verified tokens. Never for requests with penalties, a watermark, a
   grammar, top_n_tokens or pending prompt logprobs, and never past ``max_new_tokens``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmbus.bus.messages import DRAFT_GUESS, MAX_IMAGE_BYTES, FinishReason
from llmbus.bus.shared_settings import DEFAULT_MAX_BATCH_PREFILL_TOKENS
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.requests import (Request, RequestStatus, ScheduledBatch, ScheduledSeq, TokenEvent,
                                      images_chunk_end)
from llmbus.scheduler.speculation import GuessRate, NgramIndex


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_prefill_tokens: int = DEFAULT_MAX_BATCH_PREFILL_TOKENS
    max_batch_size: int | None = None  # None = bounded by KV blocks only
    prefill_chunking: bool = True
    waiting_served_ratio: float = 0.3  # without chunking: admit while a batch runs only this many x its size
    max_waiting_tokens: int = 20  # without chunking: ... or after this many steps without admission
    watermark: float = 0.01  # share of KV blocks admission leaves free for running requests to grow into
    speculate: int = 0  # guessed tokens per decode (n-gram prompt lookup); 0 = off
    speculate_max_batch: int = 16  # speculate only in steps with at most this many decodes
    speculate_method: str = "ngram"  # "draft": guesses left to the ranks' draft model (DRAFT_GUESS)
    steps_ahead: int = 1  # steps scheduled past the one whose result is awaited (overlap; process.py)
    # LongRoPE's or dynamic NTK's original length (WorkerReady.rope_split_tokens): a prompt past it has other K/V
    # for the same tokens, so its blocks are cached apart from shorter prompts'; 0: one cache for every prompt length
    rope_split_tokens: int = 0
    # dynamic NTK (WorkerReady.rope_split_by_length): such a prompt's K/V follow its own length, so each length's
    # blocks are cached apart too
    rope_split_by_length: bool = False
    # WorkerReady.images "whole" (Gemma 3's placeholders attend each other both ways): a step computes all of an
    # image's placeholders it computes any of (``_chunk_end``)
    whole_images: bool = False
    # The bounds of these values are checked where they are set: the scheduler's declared settings
    # (scheduler/config.py, SchedulerProcessConfig).


@dataclass(slots=True)
class PolicyCounters:
    """Cumulative, for metrics."""

    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    spec_proposed: int = 0  # guessed tokens fed to the ranks
    spec_accepted: int = 0  # of those, kept
    concat: dict[str, int] = field(default_factory=lambda: {"chunking": 0, "backpressure": 0,
                                                              "wait_exceeded": 0})


class Scheduler:
    """Waiting queue + running batch + KV blocks. Drive it with schedule() / update()."""

    def __init__(self, config: SchedulerConfig, kv: KVBlockManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self._by_rid: dict[str, Request] = {}
        self._dropped_rids: list[str] = []  # workers must forget these on the next step
        self._steps_without_admission = 0
        self._watermark_blocks = int(config.watermark * kv.num_blocks)
        self.counters = PolicyCounters()

    # ------------------------------------------------------------------ intake

    def add(self, request: Request) -> None:
        if request.rid in self._by_rid:
            raise ValueError(f"duplicate request id {request.rid!r}")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if self.kv.blocks_for(request.max_kv_tokens) > self.kv.num_blocks:
            raise ValueError(f"request needs {request.max_kv_tokens} KV tokens, more than the "
                             f"{self.kv.num_blocks * self.kv.block_size} the cache holds")
        request.status = RequestStatus.WAITING
        self._by_rid[request.rid] = request
        self.waiting.append(request)

    def frontend_of(self, rid: str) -> str | None:
        req = self._by_rid.get(rid)
        return req.frontend_id if req is not None else None

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

    def fail_step(self, batch: ScheduledBatch) -> list[Request]:
        """The ranks could not compute ``batch`` (it ran out of memory) and nothing of it was applied: remove
        the requests it computed prompt tokens for (the rows whose size a step's memory depends on: chunks
        attend to their whole context), or, in a step of decodes alone, every one of them; like an abort,
        their blocks go back (only what earlier steps computed enters the prefix cache). Returns them. The
        others run on from where they were: the next step computes the same tokens again."""
        live = [seq for seq in batch.seqs if seq.request.status is RequestStatus.RUNNING]
        victims = [seq for seq in live if not seq.is_decode] or live
        failed = self.abort([seq.request.rid for seq in victims])
        self.discard(batch)
        return failed

    def discard(self, batch: ScheduledBatch) -> None:
        """Nothing of ``batch`` will be applied (it failed, or it was scheduled ahead of a step that failed):
        its requests' next steps start where they were before it. Its blocks stay where they went."""
        for seq in batch.seqs:
            req = seq.request
            if req.status is RequestStatus.RUNNING and req.generation == seq.generation:
                req.ahead -= len(seq.token_ids)
                req.pending -= seq.sample

    def restart(self, kv: KVBlockManager) -> list[Request]:
        """The ranks were replaced and every KV block (and cached prefix) went with them: continue on
        ``kv``, the new ranks' pool. Running requests go back to the head of the queue, oldest first, to
        recompute prompt and output as preempted ones do; a request the new pool can no longer hold is
        removed and returned."""
        running, self.running = self.running, []
        for req in reversed(running):
            req.block_table, req.num_computed, req.status = [], 0, RequestStatus.WAITING
            if req.wants_prompt_logprobs:
                req.prompt_logprob_values.clear()
                req.prompt_logprob_tops.clear()
            self.waiting.appendleft(req)
        for req in self.waiting:  # the steps in flight are lost with the ranks: their tokens are computed again
            req.ahead = req.pending = 0
            req.generation += 1
        self.kv = kv
        self._watermark_blocks = int(self.config.watermark * kv.num_blocks)
        self._dropped_rids = []  # the new ranks hold no state to drop
        too_big = [r.rid for r in self.waiting if kv.blocks_for(r.max_kv_tokens) > kv.num_blocks]
        return self.abort(too_big)

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
        batch = ScheduledBatch(new_requests=[], seqs=[], finished_rids=[])
        preempted, budget_left = self._schedule_running(batch)
        if not preempted and self.waiting and self._admit(batch, budget_left, now):
            self._steps_without_admission = 1  # counted like TGI's waiting_tokens: 1 after a prefill
        else:
            self._steps_without_admission += 1
        batch.finished_rids, self._dropped_rids = self._dropped_rids, []
        if not batch.seqs:
            self._dropped_rids = batch.finished_rids
            return None
        for seq in batch.seqs:
            req = seq.request
            req.ahead += len(seq.token_ids)
            req.pending += seq.sample
            seq.generation = req.generation
        return batch

    def may_schedule_ahead(self, in_flight: ScheduledBatch) -> bool:
        """Whether the next step may be scheduled before ``in_flight``'s tokens are known. Not when a
        row of it speculates (the next guess follows its kept tokens), nor while a running request could
        speculate (it would have to skip the step scheduled ahead: better to wait for its token)."""
        if in_flight.speculates:
            return False
        return not (self.config.speculate > 0 and any(_may_speculate(r) for r in self.running))

    def _prefill_budget(self) -> int:
        if not self.config.prefill_chunking:
            return self.config.max_batch_prefill_tokens
        decodes = sum(1 for r in self.running if r.scheduled_tokens - r.scheduled_computed == 1)
        return self.config.max_batch_prefill_tokens - decodes

    def _schedule_running(self, batch: ScheduledBatch) -> tuple[bool, int]:
        """Decode tokens and prompt chunks of the running requests; returns whether any was preempted and
        the prefill budget left for admissions."""
        budget = self._prefill_budget()
        preempted = False
        speculating = self.config.speculate > 0 and sum(
            1 for r in self.running
            if r.scheduled_tokens - r.scheduled_computed == 1) <= self.config.speculate_max_batch
        i = 0
        while i < len(self.running):
            req = self.running[i]
            computed = req.scheduled_computed
            remaining = req.scheduled_tokens - computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n > 0:
                n = self._chunk_end(req, computed, computed + n) - computed
            if (n <= 0 or req.pending > self.config.steps_ahead
                    or len(req.output_ids) + req.pending >= req.stopping.max_new_tokens):
                # (scheduled ahead: each pending token but the newest is fed already, and the newest is the
                # one this step would feed; none is fed past steps_ahead, nor past max_new_tokens)
                i += 1
                continue
            watched = None
            if speculating and remaining == 1 and req.output_ids and not req.pending and budget > 0:
                guessed = self._guess(req, budget, batch)
                if isinstance(guessed, ScheduledSeq):
                    i += 1
                    budget -= guessed.num_spec
                    batch.seqs.append(guessed)
                    continue
                watched = guessed
            is_decode = remaining == 1 and bool(req.output_ids or req.pending)
            if remaining == 1 and not is_decode and not self.config.prefill_chunking:
                # A one-token prompt (sent back by a step discarded with the one it was scheduled ahead of)
                # is a prompt like any other against the budget of whole prompts: alone it may exceed it.
                if budget < 1 and any(not q.is_decode for q in batch.seqs):
                    i += 1
                    continue
                budget -= 1
            need = self.kv.blocks_for(computed + n) - len(req.block_table)
            blocks = self.kv.allocate(need) if need > 0 else []
            while blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                blocks = self.kv.allocate(need)
            if blocks is None:
                continue  # req itself went back to the queue; running[i] is the next one, if any
            if blocks:
                req.block_table.extend(blocks)
                batch.added_blocks.append((req.rid, blocks))
            if remaining > 1:
                budget -= n
            batch.seqs.append(ScheduledSeq(req, req.feed(computed, computed + n), computed, n == remaining,
                                           is_decode=is_decode, watched_guess=watched))
            i += 1
        return preempted, budget

    def _chunk_end(self, req: Request, start: int, end: int) -> int:
        """Where a step computing ``req``'s tokens from ``start`` ends, given it would end at ``end``: there, or
        where ``images_chunk_end`` moves it for ranks that compute an image's placeholders in one step."""
        return images_chunk_end(req.images, start, end) if self.config.whole_images and req.images else end

    def _guess(self, req: Request, budget: int, batch: ScheduledBatch) -> ScheduledSeq | int | None:
        """A decode of ``req`` with guessed tokens after its last one, if it may speculate, its recent
        guesses pay (or a probe is due), a guess exists and blocks for it are free. Else it decodes
        plainly: None, or, when n-gram guessing is braked, the token it would have guessed (to watch)."""
        if not _may_speculate(req):
            return None
        # the kept guesses and the token sampled after them must fit in max_new_tokens
        room = req.stopping.max_new_tokens - len(req.output_ids) - 1
        most = min(self.config.speculate, room, budget)
        if req.guess_rate is None:
            req.guess_rate = GuessRate()
        draft = self.config.speculate_method == "draft"
        n = req.guess_rate.length(most, len(req.output_ids), probe=draft)
        if draft:
            guess = [DRAFT_GUESS] * n
        else:
            if req.ngrams is None:
                req.ngrams = NgramIndex(req.prompt_ids + req.output_ids)
            if n == 0:
                watch = req.ngrams.propose(1) if most > 0 else []
                return watch[0] if watch else None
            guess = req.ngrams.propose(n)
        if not guess:
            return None
        computed = req.scheduled_computed
        need = self.kv.blocks_for(computed + 1 + len(guess)) - len(req.block_table)
        blocks = self.kv.allocate(need) if need > 0 else []
        if blocks is None:
            return None
        if blocks:
            req.block_table.extend(blocks)
            batch.added_blocks.append((req.rid, blocks))
        return ScheduledSeq(req, [req.output_ids[-1], *guess], computed, True, is_decode=True, num_spec=len(guess))

    def _admit(self, batch: ScheduledBatch, budget: int, now: float) -> bool:
        cfg, kv = self.config, self.kv
        chunking = cfg.prefill_chunking
        was_running = bool(self.running)
        min_size, reason = 0, None
        if was_running:
            if chunking:
                reason = "chunking"
            elif self._steps_without_admission >= cfg.max_waiting_tokens:
                reason = "wait_exceeded"
            else:
                min_size, reason = int(len(self.running) * cfg.waiting_served_ratio), "backpressure"
        # Prompt rows the running requests already put in the batch (whole prompts sent back by a discarded
        # step): a prompt admitted beside them is not alone.
        prefill_tokens = sum(len(q.token_ids) for q in batch.seqs if not q.is_decode)
        admitted: list[tuple[Request, ScheduledSeq]] = []
        image_bytes = 0  # of the requests admitted: the step command carries their images
        while self.waiting:
            if cfg.max_batch_size is not None and len(self.running) >= cfg.max_batch_size:
                break
            if chunking and budget <= 0:
                break
            req = self.waiting[0]
            if admitted and image_bytes + req.image_bytes > MAX_IMAGE_BYTES:
                break
            image_bytes += req.image_bytes
            total = req.num_tokens
            cached_blocks = [] if req.wants_prompt_logprobs else kv.match(req.cache_keys(0, total),
                                                                               (total - 1) // kv.block_size,
                                                                               self._cache_namespace(req))
            cached = len(cached_blocks) * kv.block_size
            todo = total - cached
            if chunking:
                n = self._chunk_end(req, cached, cached + min(todo, budget)) - cached
            else:
                if prefill_tokens and todo > budget:
                    break  # alone, a prompt may exceed the budget; recomputed requests can be that long
                n = todo
            kv.acquire(cached_blocks)
            need = kv.blocks_for(cached + n) - len(cached_blocks)
            reserve = self._watermark_blocks if self.running else 0
            blocks = kv.allocate(need) if kv.num_available - need >= reserve else None
            if blocks is None:
                kv.release(cached_blocks)
                break
            self.waiting.popleft()
            req.block_table = cached_blocks + blocks
            req.num_computed = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seq = ScheduledSeq(req, req.tokens(cached, cached + n), cached, n == todo)
            admitted.append((req, seq))
            budget -= n
            prefill_tokens += n
        if admitted and len(admitted) < min_size:
            for req, _ in reversed(admitted):  # not worth pausing the batch for: put them back
                self.running.pop()
                kv.release(req.block_table)
                req.block_table, req.num_computed, req.status = [], 0, RequestStatus.WAITING
                self.waiting.appendleft(req)
            admitted = []
        if not admitted:
            return False
        if reason is not None:
            self.counters.concat[reason] += 1
            batch.concat_reason = reason
        for req, seq in admitted:
            if req.admitted_time is None:
                req.admitted_time = now
                req.cached_tokens = seq.num_computed  # a recomputation after preemption is not the client's
            self.counters.prefix_cache_queried_tokens += req.num_tokens
            self.counters.prefix_cache_hit_tokens += seq.num_computed
            batch.new_requests.append(req)
            batch.seqs.append(seq)
        return True

    def update(self, batch: ScheduledBatch, sampled: dict[str, tuple[int, float] | list[tuple[int, float]]],
               prompt_logprobs: dict[str, list[float]] | None = None,
               prompt_tops: dict[str, list] | None = None) -> list[TokenEvent]:
        """Apply one step's sampled tokens (and the prompt logprobs computed in it, per rid, with their positions' top
        tokens where asked); returns one event per token that reaches a client. ``sampled``: rid -> (token,
        logprob); for a sequence that speculated, the list of them the ranks kept (its accepted guesses,
        then the token sampled after)."""
        events = []
        for seq in batch.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING or req.generation != seq.generation:
                continue  # finished, aborted or preempted since it was scheduled: its token is dropped
            req.ahead -= len(seq.token_ids)
            req.pending -= seq.sample
            req.num_computed = seq.num_computed + len(seq.token_ids)
            if prompt_logprobs and req.rid in prompt_logprobs:
                req.prompt_logprob_values.extend(prompt_logprobs[req.rid])
                req.prompt_logprob_tops.extend((prompt_tops or {}).get(req.rid, ()))
            prompt_len = len(req.prompt_ids)
            if seq.num_computed < prompt_len <= req.num_computed:
                # The prompt is in the cache now: later requests sharing it can skip it at once.
                self.kv.insert(req.cache_keys(0, prompt_len), req.block_table, releasing=False,
                               namespace=self._cache_namespace(req))
            if not seq.sample:
                continue
            kept = sampled[req.rid] if seq.num_spec else [sampled[req.rid]]
            if seq.num_spec:
                # K/V of the last token and of the guesses kept; the token sampled after them comes next
                req.num_computed = seq.num_computed + len(kept)
                accepted = len(kept) - 1
                req.spec_proposed += seq.num_spec
                req.spec_accepted += accepted
                req.guess_rate.observe(accepted, seq.num_spec)
                self.counters.spec_proposed += seq.num_spec
                self.counters.spec_accepted += accepted
            elif seq.watched_guess is not None:
                req.guess_rate.observe(int(kept[0][0] == seq.watched_guess), 1)
            for token_id, logprob in kept:
                req.output_ids.append(token_id)
                if req.ngrams is not None:
                    req.ngrams.extend([token_id])
                reason = self._finish_reason(req, token_id)
                first_with_prompt = req.prompt_logprobs and len(req.output_ids) == 1
                events.append(TokenEvent(req, token_id, logprob, reason,
                                         req.prompt_logprob_values if first_with_prompt else None,
                                         req.prompt_logprob_tops if first_with_prompt else None))
                if reason is not FinishReason.NONE:
                    self._finish(req)  # an EOS among the kept guesses ends it there
                    break
        return events

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _finish_reason(req: Request, token_id: int) -> FinishReason:
        stopping = req.stopping
        if len(req.output_ids) >= stopping.max_new_tokens:
            return FinishReason.LENGTH
        # vLLM's min_tokens needs nothing here: rank 0 masks the stop ids until then, unless the request's grammar
        # allows nothing else (its text is complete), and then the stop id must end it
        if token_id in stopping.request_stop_ids or (not stopping.ignore_eos and token_id in stopping.stop_token_ids):
            return FinishReason.EOS_TOKEN
        return FinishReason.NONE

    def _cache_namespace(self, req: Request) -> str:
        """The prefix-cache tree a request's blocks are looked up in and cached under: its adapter's, and for a
        LongRoPE model apart for prompts past the original length (rotated with the long factors throughout),
        for a dynamic NTK model apart for each such length (rotated with its own base)."""
        split, length = self.config.rope_split_tokens, len(req.prompt_ids)
        if not split or length <= split:
            return req.adapter
        return f"{req.adapter}\x00{length}" if self.config.rope_split_by_length else f"{req.adapter}\x00long"

    def _release_blocks(self, req: Request) -> None:
        """Cache the request's computed full chunks, then drop its references."""
        self.kv.insert(req.cache_keys(0, req.num_computed), req.block_table, releasing=True,
                       namespace=self._cache_namespace(req))
        self.kv.release(req.block_table)
        req.block_table = []
        self._dropped_rids.append(req.rid)

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        del self._by_rid[req.rid]
        self._release_blocks(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed = req.ahead = req.pending = 0
        req.generation += 1  # a step in flight computed tokens it recomputes: their result is dropped
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        if req.wants_prompt_logprobs:
            req.prompt_logprob_values.clear()  # recomputed from the first chunk on
            req.prompt_logprob_tops.clear()
        self.waiting.appendleft(req)
        self.counters.preemptions += 1


def _may_speculate(req: Request) -> bool:
    """Guesses are verified by sampling each position alone: only what that sampling covers may speculate
    (penalties and the watermark read the tokens before, a grammar's state moves token by token)."""
    sp = req.sampling
    return (req.grammar is None and not sp.watermark and sp.top_n_tokens == 0 and not req.wants_prompt_logprobs
            and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0)
