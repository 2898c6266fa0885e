"""The scheduler process: wires the pure policy to the bus.

Sockets (all bound here, see bus/rundir.Endpoints): PULL ``requests`` from frontends, XPUB ``steps``
to every rank, PULL ``results`` from rank 0, PULL ``control`` from every rank; plus one PUSH per
frontend, connected to the PULL that frontend announced in its FrontendHello (receivers bind, and a
PUSH never drops what it sends before the connection is up, unlike PUB/SUB).

Overlap: while the ranks compute step N the scheduler schedules and sends step N+1, as if every request of step N
goes on (up to --steps-ahead steps ahead: 1 on CPU, 2 on a GPU); it then reads N's result, applies it, and its
tokens go out while N+1 computes. A request that samples in step N feeds SAMPLED_LAST in step N+1: rank 0 puts in
the token it sampled. What the scheduler learns one step late (an EOS, a grammar's end, an abort, a failed request)
drops the token the step ahead computed for that request (scheduler/policy.py, "Scheduling ahead"). In a
tensor-parallel group rank 0 broadcasts the ids it samples, so every rank feeds SAMPLED_LAST from them. A step runs
in lock-step (scheduled once the last one's tokens are back) where its guesses need them (speculation), after a
step that failed, and with --disable-overlap. Requests that arrive meanwhile are queued by the policy and join a
later step. A rank that dies or reports a fatal error, or a step past its deadline, loses the worker group.
Launched by `llmbus up`, the scheduler then asks the supervisor to restart the group, keeps every request (the
running ones go back to the queue as if preempted: their KV is recomputed from prompt and output, so the tokens are
those of an undisturbed run) and resumes once the new ranks are ready; /health fails meanwhile. A crash loop (more
than --max-restarts in RESTART_WINDOW_S), any other failure, or no supervisor to restart the group is fatal: every
frontend gets EngineDead and the process exits non-zero so the supervisor tears the launch down.

Every frontend hears from the scheduler at least every HEARTBEAT_INTERVAL_S (SchedulerStats), so a
frontend tells a dead or stopped scheduler from a quiet one. This module is the frontends' side, the loop
and the restart policy; the ranks' side (their sockets, handshake, step results, health probes and losses)
is the RankGroup of scheduler/ranks.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq

from llmbus.bus import messages as m
from llmbus.bus import tracing
from llmbus.bus.gc_pauses import freeze_startup_heap
from llmbus.bus.procfs import process_alive
from llmbus.bus.restarts import RESTART_WINDOW_S, RestartBudget
from llmbus.bus.rundir import ensure_run_dir_or_exit
from llmbus.bus.service import ServiceContext, Terminate, ignore_stop_signals, install_stop_signals, run_service
from llmbus.bus.sockets import log_dropped, open_socket, recv_from, send
from llmbus.bus.shared_settings import DEFAULT_MAX_BATCH_PREFILL_TOKENS
from llmbus.scheduler.batch_metrics import BatchMetrics
from llmbus.scheduler.frontend_stats import FrontendStatsRelay
from llmbus.scheduler.config import (
    STEP_TIMEOUT_FLOOR_S,
    STEP_TIMEOUT_WARMUP_FACTOR,
    SchedulerProcessConfig,
    default_steps_ahead,
)
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request, ScheduledBatch
from llmbus.scheduler.ranks import EngineFailure, RankGroup, ServiceHooks, WorkersLost
from llmbus.scheduler.token_events import token_batches, trace_request

HEARTBEAT_INTERVAL_S = 0.25  # SchedulerStats at least this often, busy or idle (frontend/engine_client.py)
STATS_INTERVAL_S = 0.25  # SchedulerStats while steps run back to back
@dataclass(slots=True)
class _InFlight:
    """A step sent to the ranks whose result has not been applied yet."""

    batch: ScheduledBatch
    cmd: m.StepCommand
    # scheduled ahead of a step that failed: the ranks skip it, and the policy has discarded it
    void: bool = False


class SchedulerService:
    def __init__(self, cfg: SchedulerProcessConfig, ctx: ServiceContext):
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.step_id = 0
        self.frontends: dict[str, zmq.Socket] = {}
        self.frontend_pids: dict[str, int] = {}  # over ipc: the process that said each frontend's hello
        self.stopping = False
        self.policy: Scheduler | None = None
        self.kv_info: tuple[int, int] | None = None  # (num_blocks, block_size)
        self.compute: dict = {}  # SchedulerHello's dtype, attention_backend and devices, from the ranks
        self.image_layout: str | None = None  # WorkerReady.images (None until the ranks are ready)
        self._stats_dirty = True
        self._stats_sent_at = 0.0
        self._stats_force = False  # a request joined or left in the last step: its gauges go out next
        self._unpublished: tuple[list, dict | None] | None = None  # the last step's events: flush_events
        self.metrics = BatchMetrics()
        self.frontend_stats = FrontendStatsRelay()  # the latest of each frontend's, relayed to the others
        self.restarts = RestartBudget(cfg.max_restarts, RESTART_WINDOW_S)
        self.worker_restarts = 0
        self.onednn_cache_capacity = 0  # rank 0's, from its WorkerReady
        self.worker_request_state = 0  # rank 0's, from its last StepResult
        self.recovering: str | None = None  # why the ranks are being restarted, while they are
        self.warmup_s_per_token = 0.0
        self.warmup_step_tokens = 1
        self.vocab_size = 0  # 0: unknown (ranks of an older version)
        self.in_flight: deque[_InFlight] = deque()  # sent, oldest first: at most steps_ahead past the awaited one
        self.overlap = not cfg.disable_overlap
        self.steps_ahead = cfg.steps_ahead or 1  # until the ranks say which device they run on
        self.requests = open_socket(ctx.zmq_ctx, zmq.PULL, cfg.endpoints.requests)
        self.ranks = RankGroup(cfg.endpoints, cfg.world_size, cfg.worker_start_timeout_s, ctx.zmq_ctx, ctx.log,
                               ServiceHooks(intake=self.requests, drain_intake=self.drain_intake,
                                            heartbeat=self.publish_stats, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                                            to_frontend=self._to_frontend))

    # ------------------------------------------------------------------ startup

    def wait_for_workers(self) -> None:
        self._adopt_ranks(self.ranks.wait_until_ready())

    def _adopt_ranks(self, ready: dict[int, m.WorkerReady]) -> None:
        """Size the policy to the ranks' KV pools (first start), or hand it the new ranks' pool (restart)."""
        n = self.cfg.world_size
        num_blocks = min(r.num_blocks for r in ready.values())
        block_size = ready[0].block_size
        capacity = num_blocks * block_size
        if self.cfg.max_total_tokens is not None and self.cfg.max_total_tokens > capacity \
                and self.cfg.fit_total_tokens_to_kv:
            self.log.info("max_total_tokens lowered to the KV capacity", default=self.cfg.max_total_tokens,
                          capacity=capacity)
            self.cfg.max_total_tokens = capacity
        if self.cfg.max_total_tokens is not None and self.cfg.max_total_tokens > capacity:
            raise EngineFailure(f"Not enough memory to handle `max_total_tokens={self.cfg.max_total_tokens}`: "
                                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}); "
                                f"lower --max-total-tokens or give the KV cache more memory")
        if self.cfg.max_batch_prefill_tokens > capacity and self.cfg.fit_prefill_tokens_to_kv:
            self.log.info("max_batch_prefill_tokens lowered to the KV capacity",
                          default=self.cfg.max_batch_prefill_tokens, capacity=capacity)
            self.cfg.max_batch_prefill_tokens = capacity
        if self.cfg.max_batch_prefill_tokens > capacity:
            raise EngineFailure(f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: "
                                f"{self.cfg.max_batch_prefill_tokens} and {capacity}")
        self.kv_info = (num_blocks, block_size)
        self.compute = dict(dtype=ready[0].dtype, attention_backend=ready[0].attention_backend,
                            devices=[ready[rank].device for rank in sorted(ready)],
                            lora_adapters=list(ready[0].lora_adapters))
        self.image_layout = ready[0].images  # the images the model reads: requests with others are refused
        slowest = max(ready.values(), key=lambda r: r.warmup_step_s)
        self.warmup_step_tokens = max(slowest.warmup_step_tokens, 1)
        self.warmup_s_per_token = slowest.warmup_step_s / self.warmup_step_tokens
        self.vocab_size = ready[0].vocab_size
        self.onednn_cache_capacity = ready[0].onednn_cache_capacity
        cfg = self.cfg
        self.steps_ahead = cfg.steps_ahead or default_steps_ahead(ready[0].device)
        kv = KVBlockManager(num_blocks, block_size, prefix_caching=cfg.prefix_caching)
        if self.policy is not None:  # new ranks after a restart
            for req in self.policy.restart(kv):
                self._to_frontend(req.frontend_id, m.RequestFailed(
                    rid=req.rid, error_type="validation",
                    message=f"the restarted ranks hold {capacity} KV tokens, too few for this request"))
            return
        self.policy = Scheduler(
            SchedulerConfig(cfg.max_batch_prefill_tokens, cfg.max_batch_size, prefill_chunking=cfg.prefill_chunking,
                            waiting_served_ratio=cfg.waiting_served_ratio, max_waiting_tokens=cfg.max_waiting_tokens,
                            speculate=cfg.speculate, speculate_max_batch=cfg.speculate_max_batch,
                            speculate_method=cfg.speculate_method, steps_ahead=self.steps_ahead,
                            rope_split_tokens=ready[0].rope_split_tokens,
                            rope_split_by_length=ready[0].rope_split_by_length,
                            whole_images=ready[0].images == "whole"),
            kv)
        self.log.info("workers ready", ranks=n, kv_blocks=num_blocks, block_size=block_size,
                      max_batch_total_tokens=capacity, dtype=ready[0].dtype, device=ready[0].device,
                      attention_backend=ready[0].attention_backend, steps_ahead=self.steps_ahead if self.overlap else 0,
                      prefix_caching=cfg.prefix_caching, prefill_chunking=cfg.prefill_chunking)

    # ------------------------------------------------------------------ intake

    def handle_intake(self, msg: m.Message | None, sender: int | None = None) -> None:
        """One message from a frontend. Anything but a hello must come from a frontend that said hello,
        and over ipc from that frontend's own process: any other local process may write to the socket."""
        if msg is None:
            return
        self._stats_dirty = True
        if isinstance(msg, m.FrontendHello):
            self._hello(msg, sender)
            return
        frontend_id = getattr(msg, "frontend_id", None)
        if frontend_id is not None and not self._from_frontend(msg, frontend_id, sender):
            return
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequest):
            known = {fid for fid, pid in self.frontend_pids.items() if sender is None or pid == sender}
            rids = [rid for rid in msg.rids if self.policy.frontend_of(rid) in known]
            for req in self.policy.abort(rids):
                self.log.debug("aborted", rid=req.rid)
                if req.traceparent:
                    trace_request(req, "aborted")
        elif isinstance(msg, m.HealthCheck):
            if self.recovering:
                self._to_frontend(msg.frontend_id, m.HealthReply(msg.check_id, False, self._recovering_text()))
                return
            self.ranks.check_health(msg.frontend_id, msg.check_id, msg.timeout_s)
        elif isinstance(msg, m.FrontendStats):
            self.frontend_stats.record(msg)
            for frontend_id in list(self.frontends):
                if frontend_id != msg.frontend_id:
                    self._to_frontend(frontend_id, msg)
        else:
            log_dropped(type(msg).__name__, "unexpected message on the requests socket", peer_pid=sender)

    def _from_frontend(self, msg: m.Message, frontend_id: str, sender: int | None) -> bool:
        if frontend_id not in self.frontends:
            log_dropped(type(msg).__name__, "message for a frontend that never said hello",
                        frontend=frontend_id, peer_pid=sender)
            return False
        pid = self.frontend_pids.get(frontend_id)
        if sender is not None and pid is not None and sender != pid:
            log_dropped(type(msg).__name__, "message in another frontend's name", frontend=frontend_id,
                        peer_pid=sender, frontend_pid=pid)
            return False
        return True

    def _hello(self, msg: m.FrontendHello, sender: int | None) -> None:
        if msg.wire_version != m.WIRE_VERSION:
            log_dropped("FrontendHello", "frontend speaks another wire version: mixed llmbus versions; ignored",
                        frontend=msg.frontend_id, version=msg.wire_version, ours=m.WIRE_VERSION, peer_pid=sender)
            return
        holder = self.frontend_pids.get(msg.frontend_id)
        if holder is not None and holder != sender and process_alive(holder):
            log_dropped("FrontendHello", "hello under the id of a frontend that is still running; ignored",
                        frontend=msg.frontend_id, frontend_pid=holder, peer_pid=sender)
            return
        try:
            sock = open_socket(self.ctx.zmq_ctx, zmq.PUSH, msg.events_endpoint)
        except zmq.ZMQError as e:
            log_dropped("FrontendHello", "frontend hello with an unusable events endpoint; ignored",
                        frontend=msg.frontend_id, endpoint=msg.events_endpoint, error=str(e), peer_pid=sender)
            return
        old = self.frontends.pop(msg.frontend_id, None)
        if old is not None:
            old.close(0)
            # A frontend says hello once: this is a new process under a dead one's id (restarted by the
            # supervisor), which knows nothing of the old one's requests and will reuse their rids.
            orphans = self.policy.abort([r.rid for r in self.policy.running + list(self.policy.waiting)
                                         if r.frontend_id == msg.frontend_id])
            if orphans:
                self.log.warning("frontend restarted: its earlier requests aborted", frontend=msg.frontend_id,
                                 aborted=len(orphans))
            for stats in self.frontend_stats.retire(msg.frontend_id):  # its counts start again from 0
                for other in self.frontends:
                    self._to_frontend(other, stats)
        self.frontends[msg.frontend_id] = sock
        if sender is not None:
            self.frontend_pids[msg.frontend_id] = sender
        num_blocks, block_size = self.kv_info
        send(sock, m.SchedulerHello(max_batch_total_tokens=num_blocks * block_size, block_size=block_size,
                                    **self.compute))
        self._to_frontend(msg.frontend_id, self._stats())
        for stats in self.frontend_stats.for_frontend(msg.frontend_id):
            self._to_frontend(msg.frontend_id, stats)
        self.log.info("frontend connected", frontend=msg.frontend_id)

    def _add(self, msg: m.AddRequest) -> None:
        problem = msg.problem(self.vocab_size, self.compute.get("lora_adapters", ()), self.image_layout)
        if problem is not None:
            log_dropped("AddRequest", "request the ranks cannot take; failed", rid=msg.rid, reason=problem)
            self._to_frontend(msg.frontend_id, m.RequestFailed(rid=msg.rid, error_type="validation",
                                                               message=problem))
            return
        req = Request(rid=msg.rid, frontend_id=msg.frontend_id, prompt_ids=list(msg.input_ids),
                      sampling=msg.sampling, stopping=msg.stopping, prompt_logprobs=msg.prompt_logprobs,
                      arrival_time=msg.arrival_time, traceparent=msg.traceparent, grammar=msg.grammar,
                      adapter=msg.adapter, images=list(msg.images))
        try:
            if self.stopping:
                raise ValueError("the server is shutting down")
            self.policy.add(req)
        except ValueError as e:
            self._to_frontend(msg.frontend_id, m.RequestFailed(rid=msg.rid, error_type="validation",
                                                               message=str(e)))

    def _to_frontend(self, frontend_id: str, msg: m.Message) -> None:
        sock = self.frontends.get(frontend_id)
        if sock is None:
            log_dropped(type(msg).__name__, "event for an unknown frontend dropped", frontend=frontend_id)
            return
        try:
            # Never block the engine on one frontend: a dead one would otherwise stall every request
            # once its queue fills up.
            send(sock, msg, zmq.NOBLOCK)
        except zmq.Again:
            self.log.error("frontend not draining its events; dropping its requests", frontend=frontend_id)
            self.policy.abort([r.rid for r in self.policy.running + list(self.policy.waiting)
                               if r.frontend_id == frontend_id])

    def drain_intake(self) -> None:
        # asked first: an empty socket's zmq.Again, raised on every step otherwise, was a tenth of the
        # scheduler's CPU at one stream
        while self.requests.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg, sender = recv_from(self.requests, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle_intake(msg, sender)

    # ------------------------------------------------------------------ stepping

    def send_step(self, batch: ScheduledBatch, ahead: bool) -> None:
        """Send ``batch`` to the ranks (``ahead``: before the result of the step in flight is read)."""
        self.step_id += 1
        cmd = m.StepCommand(
            step_id=self.step_id,
            new_requests=[m.NewRequestData(rid=r.rid, sampling=r.sampling, block_table=list(r.block_table),
                                           prompt_len=len(r.prompt_ids), prompt_logprobs=r.wants_prompt_logprobs,
                                           cached_ids=r.tokens(0, r.num_computed), grammar=r.grammar,
                                           adapter=r.adapter, images=r.images_from(r.num_computed))
                          for r in batch.new_requests],
            rids=[s.request.rid for s in batch.seqs],
            num_computed=[s.num_computed for s in batch.seqs],
            num_new=[len(s.token_ids) for s in batch.seqs],
            token_ids=[t for s in batch.seqs for t in s.token_ids],
            sample=[s.sample for s in batch.seqs],
            added_blocks=[[rid, blocks] for rid, blocks in batch.added_blocks],
            finished_rids=batch.finished_rids,
            num_spec=[s.num_spec for s in batch.seqs] if any(s.num_spec for s in batch.seqs) else [],
            ahead=ahead,
        )
        self.ranks.send_step(cmd)
        self.in_flight.append(_InFlight(batch, cmd))

    def _schedule_ahead(self) -> None:
        """With steps in flight, send the next ones now, up to --steps-ahead past the oldest, where they may be
        (see the module's docstring)."""
        if not self.overlap:
            return
        while 0 < len(self.in_flight) <= self.steps_ahead:
            if any(f.void or not self.policy.may_schedule_ahead(f.batch) for f in self.in_flight):
                return
            batch = self._schedule()
            if batch is None:
                return
            self.send_step(batch, ahead=True)

    def _schedule(self) -> ScheduledBatch | None:
        started = time.monotonic()
        batch = self.policy.schedule(time.time())
        if batch is not None and batch.concat_reason is not None:  # new requests joined a running batch
            self.metrics.record_concat(time.monotonic() - started)
        return batch

    def finish_step(self) -> None:
        """Wait for the oldest step's result and apply it (a step ahead of it may be computing meanwhile)."""
        flight = self.in_flight[0]
        batch, cmd = flight.batch, flight.cmd
        started = time.monotonic()
        result = self.ranks.wait_result(cmd.step_id, self._step_timeout(len(cmd.token_ids)))
        self.in_flight.popleft()
        self.worker_request_state = result.request_state
        if flight.void:
            return  # the ranks skipped it; the policy discarded it when the step before failed
        arrived = time.monotonic()
        self.metrics.record_step(batch.has_prefill, len(batch.new_requests), result.forward_time,
                                 result.sample_time, arrived - started)
        if result.failed_error:
            self.metrics.record_failure(batch.has_prefill)
            self._fail_step(batch, result.failed_error)
            for later in self.in_flight:  # built on this step's tokens: nothing of it counts either
                self.policy.discard(later.batch)
                later.void = True
            return
        sampled = _sampled_by_rid(batch, result)
        prompt_logprobs = {rid: values for rid, values, _ in result.prompt_logprobs} if result.prompt_logprobs else None
        prompt_tops = {rid: tops for rid, _, tops in result.prompt_logprobs if tops} or None
        for rid, error_type, why in result.errors:
            # Before update: the request's last token (an end-of-sequence rank 0 forced) is not sent.
            for req in self.policy.abort([rid]):
                self.log.warning("request failed in the engine", rid=rid, error_type=error_type, reason=why)
                self._to_frontend(req.frontend_id, m.RequestFailed(rid=rid, error_type=error_type, message=why))
        events = self.policy.update(batch, sampled, prompt_logprobs, prompt_tops)
        # Per sampled rid, [[ids], [logprobs]] or [] (it asked for none); None when no request asked.
        top_tokens = dict(zip(result.rids, result.top_tokens)) if result.top_tokens else None
        self._unpublished = (events, top_tokens)
        # tokens a client gets (a request that finished meanwhile drops its step-ahead token), per request
        per_request = list(Counter(e.request.rid for e in events).values()) if result.num_tokens else None
        self.metrics.record_applied(batch.has_prefill, time.monotonic() - arrived, len(events), per_request)

    def _fail_step(self, batch: ScheduledBatch, why: str) -> None:
        """The ranks ran out of memory in this step and live on: the requests the policy blames fail with
        TGI's generation error, the rest compute the step again next time."""
        self.flush_events()  # a failed request's tokens of the last step go out before its failure
        failed = self.policy.fail_step(batch)
        self.log.warning("step failed in the engine", reason=why, failed=[r.rid for r in failed],
                         requests=len(batch.seqs))
        for req in failed:
            if req.traceparent:
                trace_request(req, "generation_error")
            self._to_frontend(req.frontend_id, m.RequestFailed(rid=req.rid, error_type="generation", message=why))

    def _step_timeout(self, num_tokens: int) -> float:
        if self.cfg.step_timeout_s is not None:
            return self.cfg.step_timeout_s
        tokens = max(num_tokens, self.warmup_step_tokens)
        return STEP_TIMEOUT_FLOOR_S + STEP_TIMEOUT_WARMUP_FACTOR * self.warmup_s_per_token * tokens

    def flush_events(self) -> None:
        """Send the frontends the tokens of the last step, held back until the next step was sent (or the
        scheduler has nothing to send): the ranks start it before the frontends' work starts competing
        for the cores."""
        if self._unpublished is not None:
            events, top_tokens = self._unpublished
            self._unpublished = None
            self._publish(events, top_tokens)

    def _publish(self, events, top_tokens: dict[str, list] | None = None) -> None:
        for frontend_id, tb in token_batches(events, top_tokens).items():
            self._to_frontend(frontend_id, tb)

    def _stats(self) -> m.SchedulerStats:
        policy, kv, counters = self.policy, self.policy.kv, self.policy.counters
        return self.metrics.fill(m.SchedulerStats(
            queue_size=len(policy.waiting), batch_size=len(policy.running),
            batch_max_tokens=sum(len(r.prompt_ids) + r.stopping.max_new_tokens for r in policy.running),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_available, block_size=kv.block_size,
            kv_blocks_cached=kv.num_cached, prefix_cache_queried_tokens=counters.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=counters.prefix_cache_hit_tokens, preemptions=counters.preemptions,
            concat_chunking=counters.concat["chunking"], concat_backpressure=counters.concat["backpressure"],
            concat_wait_exceeded=counters.concat["wait_exceeded"], worker_restarts=self.worker_restarts,
            spec_proposed=counters.spec_proposed, spec_accepted=counters.spec_accepted,
            spec_method=self.cfg.speculate_method, onednn_cache_capacity=self.onednn_cache_capacity,
            worker_request_state=self.worker_request_state, prefix_cache_heap_entries=kv.lru_entries))

    def publish_stats(self, force: bool = False) -> None:
        """Gauges to every frontend: when ``force``d (a request joined or left the batch, or the
        scheduler went idle), otherwise at most every STATS_INTERVAL_S; and unchanged ones every
        HEARTBEAT_INTERVAL_S, as a sign of life."""
        now = time.monotonic()
        since = now - self._stats_sent_at
        changed = self._stats_dirty and (force or since >= STATS_INTERVAL_S)
        if not changed and since < HEARTBEAT_INTERVAL_S:
            return
        stats = self._stats()
        for frontend_id in list(self.frontends):
            self._to_frontend(frontend_id, stats)
        self._stats_dirty, self._stats_sent_at = False, now

    def fail_everything(self, reason: str) -> None:
        for sock in self.frontends.values():
            try:
                send(sock, m.EngineDead(reason=reason), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.let_last_events_out()

    def let_last_events_out(self) -> None:
        """Before the sockets close: a running frontend's last events (final tokens, a death notice) get two
        seconds to leave, a frontend that has exited none: the heartbeats queued for it would only hold the
        close for the whole linger (2 s of every stop, the frontend stopping first)."""
        for frontend_id, sock in self.frontends.items():
            pid = self.frontend_pids.get(frontend_id)
            sock.setsockopt(zmq.LINGER, 0 if pid is not None and not process_alive(pid) else 2000)

    # ------------------------------------------------------------------ main loop

    def loop(self) -> None:
        while not self.stopping or self.policy.has_work or self.in_flight:
            try:
                self._loop_once()
            except WorkersLost as e:
                self.flush_events()
                for flight in self.in_flight:
                    if not flight.void:
                        self.metrics.record_failure(flight.batch.has_prefill)
                self.in_flight.clear()  # lost with the ranks: the policy's restart recomputes their tokens
                if self.stopping:
                    # the launcher stops the ranks with the scheduler: no restart is coming, so what is
                    # left fails as at a second signal instead of waiting for one
                    self.ctx.log.info("worker ranks left while stopping", reason=str(e))
                    raise Terminate() from e
                self.recover(str(e))
        self.flush_events()  # (a fatal error fails every request instead: EngineDead)

    def recover(self, reason: str) -> None:
        """Restart the worker group and resume every request on the new ranks; EngineFailure when that is
        not possible (no supervisor, restarts off) or the group keeps failing."""
        while True:
            if not self.ctx.can_restart_services or self.cfg.max_restarts <= 0:
                raise EngineFailure(reason)
            if not self.restarts.allow(time.monotonic()):
                raise EngineFailure(f"{reason}; the worker ranks were restarted {self.cfg.max_restarts} times in "
                                    f"{RESTART_WINDOW_S:g} s already: giving up")
            started = time.monotonic()
            self.recovering = reason
            self.log.warning("worker ranks lost: restarting them; requests resume after", reason=reason,
                             requests=self.policy.num_requests)
            self.ranks.forget(self._recovering_text())
            self.ctx.request_restart("workers", reason)
            try:
                self._adopt_ranks(self.ranks.wait_until_ready(replacing=True))
            except WorkersLost as e:
                reason = str(e)
                continue
            finally:
                self._stats_dirty = True
            self.recovering = None
            self.worker_restarts += 1
            self.log.info("worker ranks back: resuming", requests=self.policy.num_requests,
                          recovery_s=round(time.monotonic() - started, 2), restarts=self.worker_restarts)
            return

    def _recovering_text(self) -> str:
        return f"restarting the worker ranks after: {self.recovering}"

    def _loop_once(self) -> None:
        self.drain_intake()
        if not self.in_flight:
            batch = self._schedule()
            if batch is not None:
                self.send_step(batch, ahead=False)
        if self.in_flight:
            head = self.in_flight[0].batch
            running_before = len(self.policy.running) - len(head.new_requests)
            self._schedule_ahead()
            # the last step's gauges and tokens go out while the ranks compute, not between its result and the
            # next command; the gauges first, so a client whose request just ended reads them up to date
            self.publish_stats(force=self._stats_force)
            self.flush_events()
            self.finish_step()
            self._stats_dirty = True
            self._stats_force = bool(head.new_requests) or len(self.policy.running) != running_before
            return
        self.publish_stats(force=True)
        self.flush_events()
        # Idle: block until a request (or a rank's death notice) arrives, or a heartbeat is due.
        self.ranks.wait_idle(HEARTBEAT_INTERVAL_S,
                             departures_expected=lambda: self.stopping and not self.policy.has_work)


def _sampled_by_rid(batch: ScheduledBatch, result: m.StepResult) -> dict:
    """rid -> (token, logprob); for a sequence that speculated, the list of those it kept."""
    pairs = list(zip(result.token_ids, result.logprobs))
    speculated = {s.request.rid for s in batch.seqs if s.num_spec}
    if not speculated:
        return dict(zip(result.rids, pairs))
    sampled, offset = {}, 0
    for rid, n in zip(result.rids, result.num_tokens or [1] * len(result.rids)):
        sampled[rid] = pairs[offset:offset + n] if rid in speculated else pairs[offset]
        offset += n
    return sampled


def run_scheduler(cfg: SchedulerProcessConfig) -> int:
    def body(ctx: ServiceContext) -> None:
        tracing.setup(cfg.otlp_endpoint, f"{cfg.otlp_service_name}.scheduler")
        service = SchedulerService(cfg, ctx)

        def on_signal(signum: int) -> None:
            # First signal: finish what is running, admit nothing new. Second: stop now. Before the ranks are
            # ready nothing runs: stop now (the launcher stops the ranks too, and they would never come).
            if service.stopping or service.policy is None:
                raise Terminate()
            service.stopping = True
            ctx.log.info("draining before exit", requests=service.policy.num_requests if service.policy else 0)

        install_stop_signals(on_signal)
        try:
            service.wait_for_workers()
            freeze_startup_heap()  # what start built lives as long as the process (bus/gc_pauses.py)
            ctx.ready(f"{service.kv_info[0]} KV blocks of {service.kv_info[1]} tokens")
            service.loop()
            service.let_last_events_out()
            service.ranks.shutdown("scheduler stopped")
        except EngineFailure as e:
            service.fail_everything(str(e))
            service.ranks.shutdown(str(e))
            raise
        except Terminate:
            left = service.policy.abort_all() if service.policy else []
            if left:
                ctx.log.warning("stopped with requests in flight", aborted=len(left))
            service.fail_everything("the server is shutting down")
            service.ranks.shutdown("scheduler stopped")
            raise
        finally:
            ignore_stop_signals()  # before this frame ends and garbage-collects the service's sockets
            tracing.shutdown()

    return run_service("scheduler", body)


def main(argv: list[str] | None = None) -> int:
    cfg, _ = SchedulerProcessConfig.parse(argv, prog="llmbus scheduler")
    if cfg.max_batch_prefill_tokens is None:
        # the default budget may be lowered to what the KV pool holds; an explicit one is checked instead
        cfg = dataclasses.replace(cfg, max_batch_prefill_tokens=DEFAULT_MAX_BATCH_PREFILL_TOKENS,
                                  fit_prefill_tokens_to_kv=True)
    ensure_run_dir_or_exit(cfg.run_dir, "llmbus scheduler")
    return run_scheduler(cfg)
