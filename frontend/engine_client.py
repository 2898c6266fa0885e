"""The frontend's side of the bus: one PUSH to the scheduler, one bound PULL for its events.

``start`` binds the events PULL, connects the requests PUSH, sends ``FrontendHello`` and waits for
``SchedulerHello``. Then the event loop's reader callback on the PULL's file descriptor drains every
message ready and demultiplexes the columnar ``TokenBatch`` into one ``Mailbox`` per request (one item per
request per batch), turns ``RequestFailed`` into an error for that request and ``EngineDead`` into an
error for every request in flight (and an unhealthy engine). The PULL is a plain socket read without
blocking, not a ``zmq.asyncio`` one: at one stream, pyzmq's asyncio receive (a future, a poller
registration and a callback per message) was the largest part of the frontend's CPU (design notes, "What
a served single stream is made of"), and on a small CPU machine that CPU is taken from the worker's step.
Aborts are batched: ``abort`` never blocks (it is called from ``finally`` blocks of cancelled handlers)
and a sender task ships every pending rid in one ``AbortRequest``. ``check_ranks`` asks the scheduler to
probe every rank (/health); concurrent checks share one probe. Other frontends' request metrics arrive
relayed by the scheduler and are kept in ``peer_stats``.

The scheduler sends something at least every few hundred milliseconds (its SchedulerStats heartbeat), so
a watchdog task takes SCHEDULER_SILENCE_S without any message for a dead scheduler and fails every request in
flight with an in-band error instead of leaving clients waiting. Where the scheduler's process is known (ipc)
and still runs, it was only starved or is stuck: the watchdog gives it ``hang_timeout_s`` (--scheduler-hang-
timeout) before failing the requests as hung, since a loaded machine can hold a live scheduler's heartbeat
past a second (the full test suite on 2 cores did, now and then). Over tcp its process cannot be asked, and a
network adds its own pauses: the watchdog waits ``hang_timeout_s`` there too. Any message that arrives
later (a scheduler that was only slow, or a forged EngineDead followed by the real scheduler's heartbeat)
makes the engine healthy again.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from llmbus.bus import messages as m
from llmbus.bus.procfs import process_alive
from llmbus.bus.sockets import asend, decode_frames, log_dropped, open_socket
from llmbus.frontend.errors import ApiError, engine_error, generation_error

log = structlog.get_logger("llmbus.frontend")

SCHEDULER_ANSWER_MARGIN_S = 2.0  # beyond a health check's own timeout, before the scheduler counts as stuck
SCHEDULER_SILENCE_S = 1.0  # four of the scheduler's heartbeats (scheduler/process.py HEARTBEAT_INTERVAL_S)
DRAIN_BATCH = 256  # messages read in one callback before the loop gets a turn (64 streams: one batch each)


@dataclass(slots=True)
class TokenEvent:
    token_id: int
    logprob: float
    finish_reason: int  # FinishReason
    top_tokens: list | None  # [[ids], [logprobs]] or None
    queue_time: float  # seconds queued (first token only, else 0)


@dataclass(slots=True)
class EngineTokens:
    """What one TokenBatch carried for one request."""

    tokens: list[TokenEvent]
    prompt_logprobs: list | None = None
    prompt_top_tokens: list | None = None  # per prompt token scored: [[ids], [logprobs]] (top_n_tokens asked)
    received_at: float = 0.0
    speculation: tuple[int, int] | None = None  # (guessed, kept) once a request that speculated finishes
    cached_tokens: int = 0  # prompt tokens the prefix cache held (with the first tokens)


@dataclass(slots=True)
class EngineFailure:
    error: ApiError


TIMED_OUT = object()  # Mailbox.get's answer when nothing came in time


class Mailbox:
    """One request's engine events in order, for one reader. Cheaper than ``asyncio.Queue`` with
    ``wait_for`` (a task per wait): a wait is one future and, with a timeout, one timer; a wait that times
    out or is cancelled loses nothing, the items stay for the next ``get``."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self):
        return self._items.popleft()  # IndexError when empty, like any deque

    async def get(self, timeout: float | None = None):
        """The next item; ``TIMED_OUT`` if none came within ``timeout`` seconds."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                return TIMED_OUT
        return self._items.popleft()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class EngineClient:
    def __init__(self, requests_endpoint: str, events_endpoint: str, frontend_id: str,
                 zmq_ctx: zmq.asyncio.Context | None = None, hang_timeout_s: float = 10.0):
        self.requests_endpoint = requests_endpoint
        self.events_endpoint = events_endpoint
        self.hang_timeout_s = hang_timeout_s
        self.frontend_id = frontend_id
        self._own_ctx = zmq_ctx is None
        self._ctx = zmq_ctx or zmq.asyncio.Context()
        self._push = None
        self._pull: zmq.Socket | None = None  # plain, not asyncio: read by _drain
        self._reading = False  # _drain is the loop's reader of the PULL's descriptor
        self._channels: dict[str, Mailbox] = {}
        self._next_id = 0
        self._pending_aborts: list[str] = []
        self._abort_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.hello: m.SchedulerHello | None = None
        self.stats: m.SchedulerStats | None = None  # the scheduler's latest gauges
        self.peer_stats: dict[str, m.FrontendStats] = {}  # other frontends' request metrics, by id
        self.dead_reason: str | None = None
        self._last_heard = 0.0  # loop time of the scheduler's latest message
        self._scheduler_pid: int | None = None  # over ipc: the sender of SchedulerHello; no one else is heard
        self._health_checks: dict[int, asyncio.Future] = {}
        self._health_check: asyncio.Future | None = None  # the check in flight, shared by concurrent callers
        self._next_check_id = 0

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters the ranks hold (SchedulerHello), by the names requests select them with."""
        return self.hello.lora_adapters if self.hello is not None else []

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, timeout_s: float) -> m.SchedulerHello:
        try:
            msg = await self._handshake(timeout_s)
        except BaseException:
            if self._push is not None:
                self._push.setsockopt(zmq.LINGER, 0)  # an unanswered hello need not get out
            await self.close()
            raise
        self.hello = msg
        loop = asyncio.get_running_loop()
        self._last_heard = loop.time()
        loop.add_reader(self._pull.getsockopt(zmq.FD), self._drain)
        self._reading = True
        loop.call_soon(self._drain)  # what came with or after the hello: the descriptor may not signal it
        self._tasks = [asyncio.create_task(self._abort_loop(), name="engine-aborts"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        log.info("connected to scheduler", max_batch_total_tokens=msg.max_batch_total_tokens,
                 block_size=msg.block_size)
        return msg

    async def _handshake(self, timeout_s: float) -> m.SchedulerHello:
        self._pull = open_socket(zmq.Context.shadow(self._ctx.underlying), zmq.PULL, self.events_endpoint)
        self._push = open_socket(self._ctx, zmq.PUSH, self.requests_endpoint, linger_ms=1000)
        await asend(self._push, m.FrontendHello(frontend_id=self.frontend_id,
                                                events_endpoint=self.events_endpoint))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._readable(remaining):
                raise RuntimeError(
                    f"no SchedulerHello within {timeout_s:g} s: is the scheduler running and reading "
                    f"{self.requests_endpoint}? (this frontend listens on {self.events_endpoint})")
            try:
                msg, sender = decode_frames(self._pull.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                continue
            if isinstance(msg, m.SchedulerHello):
                self._scheduler_pid = sender
                break
            log.warning("message before SchedulerHello ignored", kind=type(msg).__name__)
        if msg.wire_version != m.WIRE_VERSION:
            raise RuntimeError(f"scheduler speaks wire version {msg.wire_version}, this frontend "
                               f"{m.WIRE_VERSION}: run the same llmbus version everywhere")
        return msg

    async def _readable(self, timeout_s: float) -> bool:
        """Whether the PULL has a message within ``timeout_s`` (before the reader callback exists)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        fd = self._pull.getsockopt(zmq.FD)
        # the descriptor signals any change of the socket's state (a peer connecting too): ask the
        # socket whether that was a message
        while not self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            signalled = loop.create_future()
            loop.add_reader(fd, _wake, signalled)
            try:
                await asyncio.wait_for(signalled, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                loop.remove_reader(fd)
        return True

    async def close(self) -> None:
        """Abort what is still in flight, stop the tasks, close the sockets."""
        rids = self._pending_aborts + list(self._channels)
        self._pending_aborts, self._channels = [], {}
        if self._push is not None and rids and self.dead_reason is None:
            try:
                await asyncio.wait_for(asend(self._push, m.AbortRequest(rids=rids)), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        self._tasks = []
        if self._reading:
            asyncio.get_running_loop().remove_reader(self._pull.getsockopt(zmq.FD))
            self._reading = False
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close()
        self._push = self._pull = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    # --- state ----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.hello is not None and self.dead_reason is None

    @property
    def in_flight(self) -> int:
        return len(self._channels)

    def new_rid(self) -> str:
        self._next_id += 1
        return f"{self.frontend_id}-{self._next_id}"

    async def check_ranks(self, timeout_s: float) -> str | None:
        """None when every rank answered a probe within ``timeout_s``; else why not."""
        if self._health_check is None or self._health_check.done():
            self._health_check = asyncio.ensure_future(self._check_ranks(timeout_s))
        return await asyncio.shield(self._health_check)

    async def _check_ranks(self, timeout_s: float) -> str | None:
        if self.dead_reason is not None:
            return self.dead_reason
        self._next_check_id += 1
        check_id = self._next_check_id
        reply = self._health_checks[check_id] = asyncio.get_running_loop().create_future()
        try:
            await asend(self._push, m.HealthCheck(self.frontend_id, check_id, timeout_s))
            # the scheduler answers by the deadline itself; past that it is the scheduler that is stuck
            msg = await asyncio.wait_for(reply, timeout_s + SCHEDULER_ANSWER_MARGIN_S)
        except asyncio.TimeoutError:
            return f"the scheduler did not answer a health check within {timeout_s + SCHEDULER_ANSWER_MARGIN_S:g} s"
        finally:
            self._health_checks.pop(check_id, None)
        return None if msg.ok else msg.message

    async def send_stats(self, stats: m.FrontendStats) -> None:
        if self.dead_reason is None:
            await asend(self._push, stats)

    # --- per request ----------------------------------------------------------------------------

    async def submit(self, request: m.AddRequest) -> Mailbox:
        """Register ``request.rid`` and send it; its events arrive on the returned queue."""
        if self.dead_reason is not None:
            raise generation_error(self.dead_reason)
        mailbox = self._channels[request.rid] = Mailbox()
        try:
            await asend(self._push, request)
        except BaseException:
            # cancelled (client gone) or failed mid-send: it may have gone out, so abort it too
            self.release(request.rid, abort=True)
            raise
        return mailbox

    def release(self, rid: str, *, abort: bool) -> None:
        """Forget ``rid``; with ``abort`` tell the scheduler to drop it (never blocks)."""
        if self._channels.pop(rid, None) is not None and abort and self.dead_reason is None:
            self._pending_aborts.append(rid)
            self._abort_wakeup.set()

    async def _abort_loop(self) -> None:
        while True:
            await self._abort_wakeup.wait()
            self._abort_wakeup.clear()
            rids, self._pending_aborts = self._pending_aborts, []
            if rids:
                await asend(self._push, m.AbortRequest(rids=rids))

    # --- events ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        """The loop's reader callback: every message ready, up to DRAIN_BATCH (then the loop gets a turn
        and this runs again). ZeroMQ's descriptor signals only changes of state, so this reads until the
        socket says there is nothing left rather than once per signal."""
        if not self._reading:
            return  # closed while this callback was queued
        try:
            for _ in range(DRAIN_BATCH):
                try:
                    frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._receive(*decode_frames(frames))
            asyncio.get_running_loop().call_soon(self._drain)
        except Exception as e:  # noqa: BLE001 - the reader is gone: nothing can be served anymore
            log.error("engine reader failed", error=repr(e))
            self._engine_dead(f"frontend lost the event channel: {e}")

    def _receive(self, msg: m.Message | None, sender: int | None) -> None:
        if msg is None:
            return  # malformed, already logged
        if sender is not None and self._scheduler_pid is not None and sender != self._scheduler_pid:
            # any local process may write to our events socket: EngineDead from one would fail
            # every request, a TokenBatch would put words in the model's mouth
            log_dropped(type(msg).__name__, "event from a process that is not the scheduler",
                        peer_pid=sender, scheduler_pid=self._scheduler_pid)
            return
        self._last_heard = asyncio.get_running_loop().time()
        if self.dead_reason is not None and not isinstance(msg, m.EngineDead):
            log.warning("the scheduler is answering again: engine healthy", after=self.dead_reason)
            self.dead_reason = None
        try:
            self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - one bad message must not stop the reader
            log.error("cannot dispatch engine message", kind=type(msg).__name__, error=repr(e))

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.TokenBatch):
            self._on_tokens(msg)
        elif isinstance(msg, m.RequestFailed):
            mailbox = self._channels.pop(msg.rid, None)
            if mailbox is not None:
                mailbox.put_nowait(EngineFailure(engine_error(msg.error_type, msg.message)))
        elif isinstance(msg, m.EngineDead):
            self._engine_dead(msg.reason)
        elif isinstance(msg, m.SchedulerStats):
            self.stats = msg
        elif isinstance(msg, m.HealthReply):
            reply = self._health_checks.get(msg.check_id)
            if reply is not None and not reply.done():
                reply.set_result(msg)
        elif isinstance(msg, m.FrontendStats):
            if msg.frontend_id != self.frontend_id:
                self.peer_stats[msg.frontend_id] = msg
        elif isinstance(msg, m.SchedulerHello):
            log.info("scheduler said hello again", max_batch_total_tokens=msg.max_batch_total_tokens)
        else:
            log.warning("unexpected message on the events channel", kind=type(msg).__name__)

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SCHEDULER_SILENCE_S / 4)
            silent = loop.time() - self._last_heard
            if self.dead_reason is not None or silent < SCHEDULER_SILENCE_S:
                continue
            if self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                # this loop was busy, not the scheduler silent; reading EVENTS took the descriptor's
                # signal, so the reader callback would not run for what is waiting: read it here
                self._drain()
                continue
            pid = self._scheduler_pid
            if pid is not None and not process_alive(pid):
                self._engine_dead(f"the scheduler sent nothing for {SCHEDULER_SILENCE_S:g} s: it exited")
                continue
            if silent < self.hang_timeout_s:
                continue  # alive but starved or stuck, or over tcp where its process is unknown: not dead yet
            self._engine_dead(f"the scheduler sent nothing for {self.hang_timeout_s:g} s: "
                              + ("it hangs" if pid is not None else "it died or hangs"), abort=True)

    def _on_tokens(self, batch: m.TokenBatch) -> None:
        now = asyncio.get_running_loop().time()
        n = len(batch.rids)
        top = batch.top_tokens if len(batch.top_tokens) == n else None
        queue_times = batch.queue_times if len(batch.queue_times) == n else None
        per_request: dict[str, EngineTokens] = {}
        for i in range(n):
            rid = batch.rids[i]
            if rid not in self._channels:
                continue  # finished, aborted or unknown: drop
            item = per_request.get(rid)
            if item is None:
                item = per_request[rid] = EngineTokens(tokens=[], received_at=now)
            item.tokens.append(TokenEvent(
                token_id=batch.token_ids[i], logprob=batch.logprobs[i],
                finish_reason=batch.finish_reasons[i], top_tokens=top[i] if top else None,
                queue_time=queue_times[i] if queue_times else 0.0))
        for entry in batch.prompt_logprobs:
            if isinstance(entry, list) and len(entry) == 3 and entry[0] in per_request:
                per_request[entry[0]].prompt_logprobs = entry[1]
                per_request[entry[0]].prompt_top_tokens = entry[2]
        for entry in batch.speculation:
            if isinstance(entry, list) and len(entry) == 3 and entry[0] in per_request:
                per_request[entry[0]].speculation = (entry[1], entry[2])
        for entry in batch.cached_tokens:
            if isinstance(entry, list) and len(entry) == 2 and entry[0] in per_request:
                per_request[entry[0]].cached_tokens = entry[1]
        for rid, item in per_request.items():
            self._channels[rid].put_nowait(item)

    def fail_all(self, error: ApiError, abort: bool | None = None) -> list[str]:
        """End every request in flight with ``error`` (their handlers answer it) and abort them in the
        scheduler (by default while it is alive); the rids."""
        channels, self._channels = self._channels, {}
        for mailbox in channels.values():
            mailbox.put_nowait(EngineFailure(error))
        if (self.dead_reason is None if abort is None else abort) and channels:
            self._pending_aborts.extend(channels)
            self._abort_wakeup.set()
        return list(channels)

    def _engine_dead(self, reason: str, *, abort: bool = False) -> None:
        """``abort``: the scheduler may only be stalled, and would finish the failed requests once it runs again
        (the aborts wait in the socket for it); a dead one needs none."""
        if self.dead_reason is None:
            log.error("engine dead: failing every request in flight", reason=reason,
                      in_flight=len(self._channels))
        self.dead_reason = reason
        self.fail_all(generation_error(reason), abort=abort)
        for check_id, reply in self._health_checks.items():
            if not reply.done():
                reply.set_result(m.HealthReply(check_id, False, reason))
