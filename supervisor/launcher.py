"""`llmbus up`: run a process plan the way TGI's launcher and honcho do — boring and strict.

- Readiness comes from explicit ServiceReady messages on the supervisor's PULL socket, never from
  sleeps or files: the scheduler says ready once every rank is warmed up, the frontend once it listens.
- Any child that exits unexpectedly tears everything down (SIGTERM, SIGKILL after a grace period), and
  its last stderr lines are printed so the root cause is never lost. The exit code is non-zero.
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
from llmbus.bus.rundir import ENV_RUN_DIR, RunDir
from llmbus.bus.service import ENV_JSON_LOGS, ENV_SUPERVISOR, terminate_all
from llmbus.bus.sockets import open_socket, poll, recv

STDERR_TAIL_LINES = 40
FRONTEND_EXIT_GRACE_S = 10.0  # beyond the graceful timeout: a frontend's own cut-short drain and exit


@dataclass
class ProcessSpec:
    """One service of a launch: the same specs render the Procfile."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_after: str | None = None  # start only once this service said ready
    reports_ready: bool = True  # False: its readiness is implied by another's (the scheduler's for workers)


def json_line(service: str, event: str, level: str = "info") -> str:
    """A log line in the services' JSON shape, for text that did not come from structlog."""
    return json.dumps({"event": event, "level": level, "service": service,
                       "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}, ensure_ascii=False)


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
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def stderr_tail(self) -> list[str]:
        self._pump.join(timeout=2.0)  # let the last lines of a dead child arrive
        return list(self.tail)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class Launcher:
    def __init__(self, plan: list[ProcessSpec], run_dir: RunDir, *, graceful_timeout_s: float = 90.0,
                 kill_grace_s: float = 5.0, ready_timeout_s: float = 900.0, json_output: bool = False,
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
        print(json_line("launcher", text) if self.json_output else text, file=sys.stderr, flush=True)

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
        pending = list(self.plan)
        expected = {s.name for s in self.plan if s.reports_ready}
        while pending or not expected <= set(self.ready):
            for spec in [s for s in pending if s.ready_after is None or s.ready_after in self.ready]:
                pending.remove(spec)
                self.children.append(Child(spec, self._env(spec), json_output=self.json_output))
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
            failed = self._watch_once()
            if failed is not None:
                return self._report_failure(failed)

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
        for child in self.children:
            if not child.alive():
                return child
        return None

    def _report_failure(self, child: Child) -> int:
        code = child.proc.returncode
        what = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        lines = [f"llmbus: {child.spec.name} {what}; stopping the other services."]
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
            c._pump.join(timeout=2.0)
        self.children = [c for c in self.children if c.alive()]
