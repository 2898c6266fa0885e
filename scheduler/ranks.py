"""The scheduler's side of the worker ranks: their sockets, their startup handshake, each step's result,
their deaths and hangs, and restarting them.

``RankChannel`` is mixed into ``SchedulerService`` (scheduler/process.py), which owns the policy and the
frontends; this half only talks to ranks (and, to restart them, to the supervisor). Ranks are told apart
from any other local process by the pids of their hellos: over ipc the kernel names each message's sender.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from llmbus.bus import messages as m
from llmbus.bus.service import ServiceError
from llmbus.bus.sockets import log_dropped, open_socket, poll, recv_from, send
from llmbus.scheduler.health import Answer

HEARTBEAT_INTERVAL_S = 0.25  # SchedulerStats at least this often, busy or idle (frontend/engine_client.py)
RESTART_WINDOW_S = 60.0
# The default step deadline: this floor (first steps after a start, an odd slow step) plus this many times
# what the warmup measured for the step's tokens.
STEP_TIMEOUT_FLOOR_S = 30.0
STEP_TIMEOUT_WARMUP_FACTOR = 10.0


class EngineFailure(ServiceError):
    pass


class WorkersLost(EngineFailure):
    """The worker ranks died, failed or hung: restarting the group and recomputing resumes every request."""


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, which a killed rank is until its group reaps it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            state = stat_file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class RankChannel:
    """Needs from its host: cfg, ctx, log, policy, health, restarts, recovering, publish_stats,
    drain_intake, _poll_ms, _adopt_ranks and step_id."""

    def _init_rank_sockets(self) -> None:
        ep, z = self.cfg.endpoints, self.ctx.zmq_ctx
        self.steps = open_socket(z, zmq.XPUB, ep.steps)
        self.results = open_socket(z, zmq.PULL, ep.results)
        self.control = open_socket(z, zmq.PULL, ep.control)
        # Every rank keeps a connection to `control` for its whole life, so a disconnect there is a rank
        # that died (even by SIGKILL): fail fast instead of waiting for a step deadline.
        self.control_monitor = self.control.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self.rank_pids: dict[int, int] = {}  # from each rank's WorkerHello
        self._peer_pids: dict[int, int | None] = {}  # control connections: fd -> the connecting process

    def _control_event(self) -> dict:
        """The next control-channel connection event; who connected is noted (the kernel's SO_PEERCRED of
        the accepted socket), so whoever leaves can be named."""
        event = recv_monitor_message(self.control_monitor)
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._peer_pids[event["value"]] = _peer_pid_of_fd(event["value"])
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            event["peer_pid"] = self._peer_pids.pop(event["value"], None)
        return event

    def wait_for_workers(self) -> None:
        """Hello from every rank and a subscription from every rank, then Ready from every rank. While
        ``recovering``, requests keep arriving (queued), health checks fail at once, frontends get their
        heartbeats, and a new rank that dies or fails raises WorkersLost."""
        n = self.cfg.world_size
        deadline = time.monotonic() + self.cfg.worker_start_timeout_s
        subscriptions, hellos, ready = 0, set(), {}
        while subscriptions < n or len(hellos) < n or len(ready) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineFailure(
                    f"timed out after {self.cfg.worker_start_timeout_s:.0f}s waiting for {n} worker rank(s) "
                    f"(subscribed {subscriptions}, hello {sorted(hellos)}, ready {sorted(ready)}); weight "
                    f"loading or warmup may be slow: raise --worker-start-timeout")
            watched = [self.steps, self.control]
            if self.recovering:
                watched += [self.requests, self.control_monitor]
                self.publish_stats()
            for sock in poll(watched, int(min(remaining, HEARTBEAT_INTERVAL_S) * 1000) + 1):
                if sock is self.requests:
                    self.drain_intake()
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
                    self.rank_pids[msg.rank] = msg.pid
                elif isinstance(msg, m.WorkerReady):
                    ready[msg.rank] = msg
                elif isinstance(msg, m.WorkerFatal):
                    if self.recovering and msg.rank not in hellos:
                        continue  # a rank of the lost group, reporting its end late
                    failure = WorkersLost if self.recovering else EngineFailure
                    raise failure(f"worker rank {msg.rank} failed during startup: {msg.error}")
        self._adopt_ranks(ready)
    def _from_rank(self, msg: m.Message | None, sender: int | None) -> bool:
        """Whether a control-channel message comes from a rank's own process (where that can be told)."""
        if msg is None:
            return False
        if sender is None or sender in self.rank_pids.values():
            return True
        log_dropped(type(msg).__name__, "control message from a process that is not a worker rank",
                    peer_pid=sender)
        return False

    def _probe_ranks(self) -> None:
        probe_id = self.health.probe_to_send()
        if probe_id is not None:
            send(self.steps, m.HealthProbe(probe_id=probe_id))

    def _answer_health(self, answers: list[Answer]) -> None:
        for answer in answers:
            if not answer.ok:
                self.log.warning("health check failed", frontend=answer.frontend_id, reason=answer.message)
            self._to_frontend(answer.frontend_id, m.HealthReply(answer.check_id, answer.ok, answer.message))
        if answers:
            self._probe_ranks()  # checks queued behind a finished probe get theirs

    def _step_timeout(self, num_tokens: int) -> float:
        if self.cfg.step_timeout_s is not None:
            return self.cfg.step_timeout_s
        tokens = max(num_tokens, self.warmup_step_tokens)
        return STEP_TIMEOUT_FLOOR_S + STEP_TIMEOUT_WARMUP_FACTOR * self.warmup_s_per_token * tokens

    def _await_result(self, timeout_s: float) -> m.StepResult:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkersLost(f"step {self.step_id} got no result within {timeout_s:.1f}s (--step-timeout): "
                                  f"a rank hangs")
            ready = poll([self.results, self.control, self.control_monitor, self.requests],
                         self._poll_ms(min(remaining, HEARTBEAT_INTERVAL_S)))
            self.check_workers(ready)
            if self.requests in ready:
                self.drain_intake()  # requests arriving mid-step join the next one
            self.publish_stats()
            if self.results in ready:
                msg, sender = recv_from(self.results, zmq.NOBLOCK)
                if not isinstance(msg, m.StepResult):
                    continue
                if sender is not None and sender != self.rank_pids.get(0):
                    log_dropped("StepResult", "step result from a process that is not rank 0", peer_pid=sender)
                    continue
                if msg.step_id < self.step_id:
                    continue  # sent by a rank 0 that died before it was read: that step was computed again
                if msg.step_id != self.step_id:
                    log_dropped("StepResult", "result of a step never sent", step=msg.step_id, due=self.step_id)
                    continue
                return msg

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
            self._answer_health(self.health.fail_all(self._recovering_text()))
            self.rank_pids.clear()  # the old ranks' leaving is expected from now on
            self._drain_stale_worker_messages()
            self.ctx.request_restart("workers", reason)
            try:
                self.wait_for_workers()
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

    def _drain_stale_worker_messages(self) -> None:
        """What the lost group sent and nobody read (a last result, a fatal report, a health ack, the
        step channel's (un)subscriptions): the new ranks' startup must not count it as theirs."""
        for sock in (self.control, self.results, self.steps):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def check_workers(self, ready: set) -> None:
        """Raise EngineFailure if a rank reported a fatal error or its process went away; answer the
        health checks whose probe every rank acknowledged, or whose time is up."""
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
            if event["event"] == zmq.EVENT_DISCONNECTED and (self.policy.has_work or not self.stopping):
                # A fatal report may be right behind the disconnect: prefer its text.
                if poll([self.control], 200):
                    self.check_workers({self.control})
                dead = self._dead_ranks()
                if dead == []:
                    # any local process of ours may connect to control.sock and leave; only a rank is missed
                    log_dropped("disconnect", "a peer that is not a worker rank left the control channel; "
                                              "ignored", endpoint=self.cfg.endpoints.control,
                                peer_pid=event["peer_pid"], peer=_command_of(event["peer_pid"]))
                    return
                raise WorkersLost(f"worker rank {dead[0]} disconnected: its process died" if dead
                                  else "a worker rank disconnected: its process died")

    def _dead_ranks(self) -> list[int] | None:
        """The ranks whose process is gone, by the pids of their hellos; None where that cannot be told
        (ranks on other hosts: the control endpoint is not ipc; or no /proc)."""
        if not self.cfg.endpoints.control.startswith("ipc://") or not os.path.isdir("/proc/self"):
            return None
        return [rank for rank, pid in sorted(self.rank_pids.items()) if not process_alive(pid)]

    def shutdown_workers(self, reason: str) -> None:
        try:
            send(self.steps, m.Shutdown(reason=reason), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.steps.setsockopt(zmq.LINGER, 1000)




def _peer_pid_of_fd(fd: int) -> int | None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
    except (OSError, AttributeError):  # gone already, not a unix socket, or not Linux
        return None
    return pid or None


def _command_of(pid: int | None) -> str | None:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120] if pid else None
    except OSError:
        return None  # it has exited: its pid is all there is
