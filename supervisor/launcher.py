"""`llmbus up`: run a process plan the way TGI's launcher and honcho do — boring and strict.

- Readiness comes from explicit ServiceReady messages on the supervisor's PULL socket, never from
  sleeps or files: the scheduler says ready once every rank is warmed up, the frontend once it listens.
- A child that exits unexpectedly tears everything down (SIGTERM, SIGKILL after a grace period), and
  its last stderr lines are printed so the root cause is never lost. The exit code is non-zero. Two
  exceptions, by the spec's ``restart``: the worker group is restarted when the scheduler asks
  (RestartService: it lost its ranks and resumes their requests; it owns that budget), and one of several
  frontends is restarted while the others serve (at most ``max_restarts`` times in RESTART_WINDOW_S).
- SIGTERM / Ctrl-C: the frontend drains (in-flight requests finish) and exits, then the engine is
  stopped; the launch exits 0. A second signal skips the drain.
- Children run in their own sessions (a terminal's Ctrl-C reaches only us, so we choose the order) and
  die with us (PDEATHSIG); the run dir with every ipc socket file is removed on the way out.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from llmbus.bus import messages as m
from llmbus.bus.restarts import RESTART_WINDOW_S, RestartBudget
from llmbus.bus.rundir import ENV_RUN_DIR, RunDir
from llmbus.bus.service import ENV_JSON_LOGS, ENV_SUPERVISOR, terminate_all
from llmbus.bus.sockets import open_socket, poll, recv

STDERR_TAIL_LINES = 40
FRONTEND_EXIT_GRACE_S = 10.0  # beyond the graceful timeout: a frontend's own cut-short drain and exit
# A service restarted on request that exits first: how long its requester may take to ask (it notices
# the loss within a second) before the exit counts as a failure.
RESTART_REQUEST_WAIT_S = 10.0

# How long a launch may take to be ready: weights of a large model can take minutes to load. Every service
# starts at once (the frontend's handshake waits for the scheduler this long), so the frontend's imports and
# tokenizer load overlap the workers' weight loading.
STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ProcessSpec:
    """One service of a launch: the same specs render the Procfile (a restart starts the same again)."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    reports_ready: bool = True  # False: its readiness is implied by another's (the scheduler's for workers)
    restart: str = "never"  # "on_request": when a RestartService names it; "on_exit": whenever it dies
    max_restarts: int = 0  # "on_exit": at most this many in RESTART_WINDOW_S


def json_line(service: str, event: str, level: str = "info") -> str:
    """A log line in the services' JSON shape, for text that did not come from structlog."""
    return json.dumps({"event": event, "level": level, "service": service,
                       "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}, ensure_ascii=False)


def write_line(line: str) -> None:
    """One write per line, its newline included: the pump threads and the launcher share stderr, and
    print() writes the newline apart, so another writer's line could land between the two."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Child:
    def __init__(self, spec: ProcessSpec, env: dict[str, str], *, json_output: bool = False):
        self.spec = spec
        self.json_output = json_output
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.proc = subprocess.Popen(spec.argv, env=env, stderr=subprocess.PIPE, start_new_session=True)
        self._pump = threading.Thread(target=self._pump_stderr, name=f"stderr-{spec.name}", daemon=True)
        self._pump.start()

    def _pump_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if self.json_output and not line.startswith("{"):
                # a traceback, a warning or a progress bar written past structlog: still one JSON line
                line = json_line(self.spec.name, line, level="warning")
            write_line(line)

    def stderr_tail(self) -> list[str]:
        self._pump.join(timeout=2.0)  # let the last lines of a dead child arrive
        return list(self.tail)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill_group(self) -> None:
        """SIGKILL the child and every process it started (a worker group's ranks, a stopped one too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class Launcher:
    def __init__(self, plan: list[ProcessSpec], run_dir: RunDir, *, graceful_timeout_s: float = 90.0,
                 kill_grace_s: float = 5.0, ready_timeout_s: float = STARTUP_TIMEOUT_S, json_output: bool = False,
                 echo=None):
        self.plan = plan
        self.run_dir = run_dir
        self.graceful_timeout_s = graceful_timeout_s
        self.kill_grace_s = kill_grace_s
        self.ready_timeout_s = ready_timeout_s
        self.json_output = json_output
        self.echo = echo or self._print
        self.children: list[Child] = []
        self.ready: dict[str, str] = {}
        self.fatal: dict[str, str] = {}
        self.signals = 0
        self.restart_requests: dict[str, str] = {}  # service -> why, from RestartService
        self.awaiting_request: dict[str, float] = {}  # exited "on_request" services -> deadline to be asked
        self.budgets = {s.name: RestartBudget(s.max_restarts, RESTART_WINDOW_S) for s in plan}
        self.restarts = 0

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        zctx = zmq.Context()
        self.sock = open_socket(zctx, zmq.PULL, self.run_dir.endpoints.supervisor)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._teardown(graceful=False)
            self.sock.close(0)
            zctx.term()

    # ------------------------------------------------------------------ internals

    def _print(self, text: str) -> None:
        write_line(json_line("launcher", text) if self.json_output else text)

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1

    def _env(self, spec: ProcessSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env)
        env[ENV_SUPERVISOR] = self.run_dir.endpoints.supervisor
        env[ENV_RUN_DIR] = str(self.run_dir.path)
        env["PYTHONUNBUFFERED"] = "1"
        if self.json_output:
            env[ENV_JSON_LOGS] = "1"
        return env

    def _run(self) -> int:
        t0 = time.monotonic()
        self.children = [Child(spec, self._env(spec), json_output=self.json_output) for spec in self.plan]
        expected = {s.name for s in self.plan if s.reports_ready}
        while not expected <= set(self.ready):
            if self.signals:
                self.echo("llmbus: interrupted during startup")
                return 0
            if time.monotonic() - t0 > self.ready_timeout_s:
                waiting = sorted(expected - set(self.ready))
                self.echo(f"llmbus: {', '.join(waiting)} not ready after {self.ready_timeout_s:.0f}s")
                return 1
            failed = self._watch_once()
            if failed is not None:
                return self._report_failure(failed)
        self.echo(f"llmbus: ready in {time.monotonic() - t0:.1f}s — "
                  + "; ".join(f"{k}: {v}" for k, v in self.ready.items() if v))
        while True:
            if self.signals:
                return self._graceful_stop()
            code = self._serve_once()
            if code is not None:
                return code

    def _serve_once(self) -> int | None:
        """One round of watching a launch that is ready: restarts what may restart; the launch's exit code
        when a service's exit ends it."""
        failed = self._watch_once()
        if failed is not None and failed.spec.restart == "on_request":
            # before the requests are served: the one that asks it back may have come with its exit
            self.awaiting_request.setdefault(failed.spec.name, time.monotonic() + RESTART_REQUEST_WAIT_S)
            failed = None
        self._serve_restart_requests()
        if failed is None:
            failed = self._unasked_exit()
        elif failed.spec.restart == "on_exit" and self._others_serve(failed) \
                and self.budgets[failed.spec.name].allow(time.monotonic()):
            self._restart(failed, f"it {_exit_text(failed.proc.returncode)}")
            return None
        return None if failed is None else self._report_failure(failed)

    def _watch_once(self) -> Child | None:
        """Handle supervisor messages for up to 100 ms; return a child that exited, if any."""
        if poll([self.sock], 100):
            while True:
                try:
                    msg = recv(self.sock, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(msg, m.ServiceReady):
                    self.ready[msg.service] = msg.detail
                elif isinstance(msg, m.ServiceFatal):
                    self.fatal[msg.service] = msg.error
                elif isinstance(msg, m.RestartService):
                    self.restart_requests[msg.service] = msg.reason
        for child in self.children:
            if not child.alive() and child.spec.name not in self.awaiting_request:
                return child
        return None

    def _serve_restart_requests(self) -> None:
        for name, reason in list(self.restart_requests.items()):
            del self.restart_requests[name]
            self.awaiting_request.pop(name, None)
            child = next((c for c in self.children if c.spec.name == name and c.spec.restart == "on_request"), None)
            if child is None:
                self.echo(f"llmbus: restart of {name!r} requested, but no such service restarts on request")
                continue
            self._restart(child, reason)

    def _unasked_exit(self) -> Child | None:
        """An "on_request" service that exited and was not asked back in time: a failure after all."""
        now = time.monotonic()
        for name, deadline in list(self.awaiting_request.items()):
            if now >= deadline:
                del self.awaiting_request[name]
                child = next(c for c in self.children if c.spec.name == name)
                if not child.alive():  # (a live one was asked back after all)
                    return child
        return None

    def _others_serve(self, child: Child) -> bool:
        """Another process of the same role still serves (one of several frontends)."""
        role = child.spec.name.rstrip("0123456789")
        return any(c is not child and c.alive() and c.spec.name.rstrip("0123456789") == role for c in self.children)

    def _restart(self, child: Child, reason: str) -> None:
        child.kill_group()
        child.stderr_tail()  # its last lines are printed before the new process's first
        self.restarts += 1
        self.echo(f"llmbus: restarting {child.spec.name}: {reason}")
        self.ready.pop(child.spec.name, None)
        self.children[self.children.index(child)] = Child(child.spec, self._env(child.spec),
                                                          json_output=self.json_output)

    def _report_failure(self, child: Child) -> int:
        lines = [f"llmbus: {child.spec.name} {_exit_text(child.proc.returncode)}; stopping the other services."]
        if child.spec.name in self.fatal:
            lines.append(f"llmbus: {child.spec.name} error: {self.fatal[child.spec.name]}")
        tail = child.stderr_tail()
        if tail:
            lines.append(f"llmbus: last {len(tail)} stderr lines of {child.spec.name}:")
            lines += [f"  | {line}" for line in tail]
        self.echo("\n".join(lines))
        self._teardown(graceful=False)
        return 1

    def _graceful_stop(self) -> int:
        """Frontends drain first (the engine keeps serving them), then the engine stops."""
        self.echo("llmbus: stopping: letting in-flight requests finish")
        frontends = [c for c in self.children if c.spec.name.startswith("frontend")]
        for c in frontends:
            c.signal(signal.SIGTERM)
        # the frontends cut their own drain at the same timeout, then need a moment to answer and exit
        deadline = time.monotonic() + self.graceful_timeout_s + FRONTEND_EXIT_GRACE_S
        seen = self.signals
        while any(c.alive() for c in frontends) and time.monotonic() < deadline:
            if self.signals > seen:
                self.echo("llmbus: second signal: aborting what is left")
                seen = self.signals
                for c in frontends:
                    c.signal(signal.SIGTERM)  # a frontend's second signal ends its drain now
                deadline = min(deadline, time.monotonic() + FRONTEND_EXIT_GRACE_S)
            self._watch_once()
        codes = []
        for c in frontends:
            if c.alive():
                self.echo(f"llmbus: {c.spec.name} did not drain in time; killing it")
            codes.append(c.proc.returncode)
        self._teardown(graceful=True)
        return 0 if all(code in (0, None) for code in codes) else 1

    def _teardown(self, graceful: bool) -> None:
        names = {c.proc.pid: c.spec.name for c in self.children}
        terminate_all([c.proc for c in self.children],
                      self.graceful_timeout_s if graceful else self.kill_grace_s,
                      on_kill=lambda p: self.echo(f"llmbus: {names[p.pid]} ignored SIGTERM; sending SIGKILL"))
        for c in self.children:
            c.kill_group()  # what a child left behind: a rank its group could not stop (SIGSTOPped, say)
            c._pump.join(timeout=2.0)
        self.children = [c for c in self.children if c.alive()]


def _exit_text(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
