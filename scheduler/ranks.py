"""The scheduler's worker ranks as one object: ``RankGroup`` owns their sockets (the step broadcast, rank 0's
results, every rank's control channel and its connection monitor), their pids, their startup handshake,
each step's result, their health probes and the stale messages of a lost group.

``SchedulerService`` (scheduler/process.py) holds one and decides what a loss means (restart the group, or
give up): the group only reports it, as ``WorkersLost``. While the group waits on its ranks the service's
side keeps going through ``ServiceHooks``: frontends' requests are read (they join the next step) and
heartbeats go out. Ranks are told apart from any other local process by the pids of their hellos: over ipc
the kernel names each message's sender.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from llmbus.bus import messages as m
from llmbus.bus import procfs
from llmbus.bus.rundir import Endpoints
from llmbus.bus.service import ServiceError
from llmbus.bus.sockets import log_dropped, open_socket, poll, recv_from, send
from llmbus.scheduler.health import Answer, RankHealth


class EngineFailure(ServiceError):
    pass


class WorkersLost(EngineFailure):
    """The worker ranks died, failed or hung: restarting the group and recomputing resumes every request."""


@dataclass
class ServiceHooks:
    """What the rank group keeps doing for the service while it waits on the ranks."""

    intake: zmq.Socket  # polled with the ranks' sockets, so a request wakes the wait
    drain_intake: Callable[[], None]  # read what arrived: requests queue for the next step
    heartbeat: Callable[[], None]  # stats to the frontends, whenever they are due
    heartbeat_interval_s: float  # the longest a wait may go without calling ``heartbeat``
    to_frontend: Callable[[str, m.Message], None]  # a health check's answer


class RankGroup:
    def __init__(self, endpoints: Endpoints, world_size: int, start_timeout_s: float, zmq_ctx: zmq.Context,
                 log, hooks: ServiceHooks):
        self.endpoints = endpoints
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.log = log
        self.hooks = hooks
        self.health = RankHealth(world_size)
        self.steps = open_socket(zmq_ctx, zmq.XPUB, endpoints.steps)
        self.results = open_socket(zmq_ctx, zmq.PULL, endpoints.results)
        self.control = open_socket(zmq_ctx, zmq.PULL, endpoints.control)
        # Every rank keeps a connection to `control` for its whole life, so a disconnect there is a rank
        # that died (even by SIGKILL): fail fast instead of waiting for a step deadline.
        self.control_monitor = self.control.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self.pids: dict[int, int] = {}  # rank -> pid, from each rank's WorkerHello
        self._peer_pids: dict[int, int | None] = {}  # control connections: fd -> the connecting process

    # ------------------------------------------------------------------ startup

    def wait_until_ready(self, replacing: bool = False) -> dict[int, m.WorkerReady]:
        """Hello from every rank and a subscription from every rank, then Ready from every rank. When
        ``replacing`` a lost group, requests keep arriving (queued), frontends get their heartbeats, and a
        new rank that dies or fails raises WorkersLost; otherwise a failure is an EngineFailure."""
        n = self.world_size
        deadline = time.monotonic() + self.start_timeout_s
        subscriptions, hellos, ready = 0, set(), {}
        while subscriptions < n or len(hellos) < n or len(ready) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineFailure(
                    f"timed out after {self.start_timeout_s:.0f}s waiting for {n} worker rank(s) "
                    f"(subscribed {subscriptions}, hello {sorted(hellos)}, ready {sorted(ready)}); weight "
                    f"loading or warmup may be slow: raise --worker-start-timeout")
            watched = [self.steps, self.control]
            if replacing:
                watched += [self.hooks.intake, self.control_monitor]
                self.hooks.heartbeat()
            for sock in poll(watched, int(min(remaining, self.hooks.heartbeat_interval_s) * 1000) + 1):
                if sock is self.hooks.intake:
                    self.hooks.drain_intake()
                    continue
                if sock is self.control_monitor:
                    self._control_event()
                    dead = self._dead_ranks()  # the old group's ranks are forgotten: only a new one counts
                    if dead:
                        raise WorkersLost(f"worker rank {dead[0]} died while starting")
                    continue
                if sock is self.steps:
                    frame = self.steps.recv()
                    if frame[:1] == b"\x01":
                        subscriptions += 1
                    continue
                msg, sender = recv_from(self.control, zmq.NOBLOCK)
                if isinstance(msg, m.WorkerHello) and sender not in (None, msg.pid):
                    log_dropped("WorkerHello", "hello from a process that is not the rank it names",
                                rank=msg.rank, pid=msg.pid, peer_pid=sender)
                    continue
                if not isinstance(msg, m.WorkerHello) and not self._from_rank(msg, sender):
                    continue
                if isinstance(msg, m.WorkerHello):
                    if msg.wire_version != m.WIRE_VERSION:
                        raise EngineFailure(f"rank {msg.rank} speaks wire version {msg.wire_version}, "
                                            f"the scheduler {m.WIRE_VERSION}: mixed llmbus versions")
                    if msg.world_size != n:
                        raise EngineFailure(f"rank {msg.rank} was started with world size {msg.world_size}, "
                                            f"the scheduler expects {n}")
                    hellos.add(msg.rank)
                    self.pids[msg.rank] = msg.pid
                elif isinstance(msg, m.WorkerReady):
                    ready[msg.rank] = msg
                elif isinstance(msg, m.WorkerFatal):
                    if replacing and msg.rank not in hellos:
                        continue  # a rank of the lost group, reporting its end late
                    failure = WorkersLost if replacing else EngineFailure
                    raise failure(f"worker rank {msg.rank} failed during startup: {msg.error}")
        return ready

    # ------------------------------------------------------------------ stepping

    def send_step(self, step: m.StepCommand) -> None:
        """Broadcast ``step``: the ranks run the steps they are sent in order, one at a time."""
        send(self.steps, step)

    def wait_result(self, step_id: int, deadline_s: float) -> m.StepResult:
        """Rank 0's result of step ``step_id`` (sent before; a step sent after it may be queued behind it);
        WorkersLost if a rank dies or fails first, or no result comes within ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        while True:
            remaining = deadline - time.monotonic()
            # past the deadline, one look at what came before giving up: a scheduler that was itself stopped
            # (SIGSTOP, swapped out) finds the result waiting, and must not blame the ranks for its own pause
            ready = poll([self.results, self.control, self.control_monitor, self.hooks.intake],
                         self._poll_ms(min(max(remaining, 0.0), self.hooks.heartbeat_interval_s)))
            if remaining <= 0 and self.results not in ready:
                raise WorkersLost(f"step {step_id} got no result within {deadline_s:.1f}s (--step-timeout): "
                                  f"a rank hangs")
            self._check(ready, departures_expected=False)
            if self.hooks.intake in ready:
                self.hooks.drain_intake()  # requests arriving mid-step join the next one
            self.hooks.heartbeat()
            if self.results in ready:
                msg, sender = recv_from(self.results, zmq.NOBLOCK)
                if not isinstance(msg, m.StepResult):
                    continue
                if sender is not None and sender != self.pids.get(0):
                    log_dropped("StepResult", "step result from a process that is not rank 0", peer_pid=sender)
                    continue
                if msg.step_id < step_id:
                    continue  # sent by a rank 0 that died before it was read: that step was computed again
                if msg.step_id != step_id:
                    log_dropped("StepResult", "result of a step never sent", step=msg.step_id, due=step_id)
                    continue
                self._answer_health(self.health.progress())  # (scheduler/health.py: a busy engine's checks)
                return msg

    def wait_idle(self, timeout_s: float, departures_expected: Callable[[], bool]) -> None:
        """Between steps: until a request arrives or ``timeout_s`` passes, watch the ranks (WorkersLost
        when one dies, unless ``departures_expected()``: the scheduler is stopping with nothing left to do).
        Asked when a rank leaves, not before the wait: a stop signal arriving during it stops the ranks too,
        and their leaving is then no loss."""
        ready = poll([self.hooks.intake, self.control, self.control_monitor], self._poll_ms(timeout_s))
        self._check(ready, departures_expected())

    # ------------------------------------------------------------------ health

    def check_health(self, frontend_id: str, check_id: int, timeout_s: float) -> None:
        """A frontend's /health: answered ok once every rank has acknowledged a probe sent after it came."""
        self.health.check(frontend_id, check_id, timeout_s, time.monotonic())
        self.probe()

    def probe(self) -> None:
        """Send the health probe the waiting checks need, if none is out."""
        probe_id = self.health.probe_to_send()
        if probe_id is not None:
            send(self.steps, m.HealthProbe(probe_id=probe_id))

    def _answer_health(self, answers: list[Answer]) -> None:
        for answer in answers:
            if not answer.ok:
                self.log.warning("health check failed", frontend=answer.frontend_id, reason=answer.message)
            self.hooks.to_frontend(answer.frontend_id, m.HealthReply(answer.check_id, answer.ok, answer.message))
        if answers:
            self.probe()  # checks queued behind a finished probe get theirs

    def _poll_ms(self, limit_s: float) -> int:
        """A poll timeout that wakes up in time to fail a health check whose ranks did not answer."""
        deadline = self.health.next_deadline()
        if deadline is not None:
            limit_s = min(limit_s, max(deadline - time.monotonic(), 0.0))
        return int(limit_s * 1000) + 1

    # ------------------------------------------------------------------ losses

    def forget(self, why: str) -> None:
        """The group is lost: every waiting health check fails with ``why``, the ranks' leaving is
        expected from now on, and what they sent and nobody read is dropped (a last result, a fatal
        report, a health ack, the step channel's (un)subscriptions), so a new group's startup does not
        count it as its own."""
        self._answer_health(self.health.fail_all(why))
        self.pids.clear()
        for sock in (self.control, self.results, self.steps):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def shutdown(self, reason: str) -> None:
        """Tell every rank to exit; the message gets a second to leave when the sockets close."""
        try:
            send(self.steps, m.Shutdown(reason=reason), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.steps.setsockopt(zmq.LINGER, 1000)

    def _check(self, ready: set, departures_expected: bool) -> None:
        """Raise WorkersLost if a rank reported a fatal error or its process went away; answer the health
        checks whose probe every rank acknowledged, or whose time is up."""
        if self.control in ready:
            msg, sender = recv_from(self.control, zmq.NOBLOCK)
            if not self._from_rank(msg, sender):
                msg = None
            if isinstance(msg, m.WorkerFatal):
                raise WorkersLost(f"worker rank {msg.rank} failed: {msg.error}")
            if isinstance(msg, m.HealthAck):
                self._answer_health(self.health.ack(msg.rank, msg.probe_id))
        self._answer_health(self.health.expire(time.monotonic()))
        if self.control_monitor in ready:
            event = self._control_event()
            if event["event"] == zmq.EVENT_DISCONNECTED and not departures_expected:
                # A fatal report may be right behind the disconnect: prefer its text.
                if poll([self.control], 200):
                    self._check({self.control}, departures_expected)
                dead = self._dead_ranks()
                if dead == []:
                    # any local process of ours may connect to control.sock and leave; only a rank is missed
                    log_dropped("disconnect", "a peer that is not a worker rank left the control channel; "
                                              "ignored", endpoint=self.endpoints.control,
                                peer_pid=event["peer_pid"], peer=_command_of(event["peer_pid"]))
                    return
                raise WorkersLost(f"worker rank {dead[0]} disconnected: its process died" if dead
                                  else "a worker rank disconnected: its process died")

    def _control_event(self) -> dict:
        """The next control-channel connection event; who connected is noted (the kernel's SO_PEERCRED of
        the accepted socket), so whoever leaves can be named."""
        event = recv_monitor_message(self.control_monitor)
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._peer_pids[event["value"]] = procfs.peer_pid_of_fd(event["value"])
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            event["peer_pid"] = self._peer_pids.pop(event["value"], None)
        return event

    def _from_rank(self, msg: m.Message | None, sender: int | None) -> bool:
        """Whether a control-channel message comes from a rank's own process (where that can be told)."""
        if msg is None:
            return False
        if sender is None or sender in self.pids.values():
            return True
        log_dropped(type(msg).__name__, "control message from a process that is not a worker rank",
                    peer_pid=sender)
        return False

    def _dead_ranks(self) -> list[int] | None:
        """The ranks whose process is gone, by the pids of their hellos; None where that cannot be told
        (ranks on other hosts: the control endpoint is not ipc; or no /proc)."""
        if not self.endpoints.control.startswith("ipc://") or not procfs.has_procfs():
            return None
        return [rank for rank, pid in sorted(self.pids.items()) if not procfs.process_alive(pid)]


def _command_of(pid: int | None) -> str | None:
    """What a process that left was running, for the log; None once it has exited (its pid is all there is)."""
    return procfs.command_line(pid)[:120] or None
