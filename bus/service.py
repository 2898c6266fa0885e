"""The one entry shape every llmbus process uses.

``run_service(name, body)``: set up logging, die with the parent, run ``body`` (which builds, calls
``ctx.ready()`` and loops), and on a fatal error log the traceback and send a typed ``ServiceFatal`` to
the supervisor before exiting non-zero, so the other side reports a clear error instead of hanging.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog
import zmq

from llmbus.bus import messages as m
from llmbus.bus.settings import SettingsError
from llmbus.bus.sockets import open_socket, send

ENV_SUPERVISOR = "LLMBUS_SUPERVISOR_ENDPOINT"
ENV_JSON_LOGS = "LLMBUS_JSON_OUTPUT"

_PR_SET_PDEATHSIG = 1


def setup_logging(service: str, *, rank: int | None = None, json_output: bool | None = None) -> None:
    """structlog to stderr: readable lines, or JSON lines; every line carries the service (and rank)."""
    if json_output is None:
        json_output = os.environ.get(ENV_JSON_LOGS, "").lower() in ("1", "true", "yes")
    level = logging.getLevelNamesMapping().get(os.environ.get("LOG_LEVEL", "INFO").upper(), logging.INFO)
    renderer = (structlog.processors.JSONRenderer() if json_output
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # one write per line, its newline included: a group's ranks share one stderr pipe, and print()
        # writes the newline apart, so another rank's line could land between a line and its newline
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # libraries' stdlib logging (aiohttp's request errors, transformers' warnings) goes through the same
    # renderer, so a JSON log is JSON throughout and carries the service too
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=[
        structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    structlog.contextvars.clear_contextvars()
    bound = {"service": service}
    if rank is not None:
        bound["rank"] = rank
    structlog.contextvars.bind_contextvars(**bound)


# The signal this process gets when its parent dies: SIGTERM (a clean stop) until it starts exiting, then
# SIGKILL, since from then on it ignores SIGTERM (ignore_stop_signals). None: die_with_parent not called.
_parent_death_signal: signal.Signals | None = None
_parent_pid: int | None = None


def _ask_kernel_for(sig: signal.Signals) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    except OSError:
        pass


def die_with_parent() -> None:
    """Make the kernel signal us when the parent dies (Linux), with a polling thread as fallback."""
    global _parent_death_signal, _parent_pid
    parent = _parent_pid = os.getppid()
    _parent_death_signal = signal.SIGTERM
    _ask_kernel_for(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), _parent_death_signal)
                return
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@dataclass
class ServiceContext:
    """What a service body gets: its name, a zmq context, and how to tell the supervisor about itself."""

    name: str
    zmq_ctx: zmq.Context
    supervisor_endpoint: str | None = None
    log: structlog.stdlib.BoundLogger = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.log = structlog.get_logger(f"llmbus.{self.name}")

    def _tell_supervisor(self, msg: m.Message) -> None:
        if not self.supervisor_endpoint:
            return
        sock = open_socket(self.zmq_ctx, zmq.PUSH, self.supervisor_endpoint, linger_ms=2000)
        try:
            send(sock, msg)
        finally:
            sock.close()

    def ready(self, detail: str = "") -> None:
        self.log.info("ready", detail=detail)
        self._tell_supervisor(m.ServiceReady(service=self.name, pid=os.getpid(), detail=detail))

    def fatal(self, error: str) -> None:
        self._tell_supervisor(m.ServiceFatal(service=self.name, pid=os.getpid(), error=error))

    @property
    def can_restart_services(self) -> bool:
        """Launched by `llmbus up`, whose supervisor restarts a service on request (honcho cannot)."""
        return bool(self.supervisor_endpoint)

    def request_restart(self, service: str, reason: str) -> None:
        self._tell_supervisor(m.RestartService(service=service, pid=os.getpid(), reason=reason))


def terminate_all(procs: list[subprocess.Popen], grace_s: float,
                  on_kill: Callable[[subprocess.Popen], None] | None = None) -> None:
    """SIGTERM every live process, wait up to ``grace_s`` for all of them together, SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_kill is not None:
                on_kill(p)
            p.kill()
            p.wait()


class ServiceError(RuntimeError):
    """A fatal error whose message says everything (bad settings, a dead peer): logged without a
    traceback, which would only bury the message."""


class Terminate(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT when a service asks for it (see install_stop_signals).

    A BaseException, as KeyboardInterrupt is: a signal lands anywhere, and an ``except Exception`` it lands in
    must not take it for an error (one in the bus's decoding turned it into a "malformed message", and a rank
    told to stop by the scheduler and by the launcher at once dropped both and ran on until SIGKILL)."""


def install_stop_signals(on_stop: Callable[[int], None]) -> None:
    """Route SIGTERM and SIGINT to ``on_stop(signum)`` (services decide between drain and abort)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: on_stop(signum))


def ignore_stop_signals() -> None:
    """From here on SIGTERM/SIGINT do nothing: the process is already on its way out. A Terminate raised
    while a socket is being garbage-collected interrupts its close, and zmq's context teardown then waits for
    that socket forever (seen: a rank told to shut down by the scheduler got the launcher's SIGTERM as its
    body's frame ended, and hung until SIGKILL). Whoever signalled follows up with SIGKILL if exit hangs;
    a parent that dies cannot, so from here on its death kills this process outright: an exit that hangs
    would otherwise leave an orphan holding its memory (and a rank's cores) for good."""
    global _parent_death_signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if _parent_death_signal is not None:
        _parent_death_signal = signal.SIGKILL
        _ask_kernel_for(signal.SIGKILL)
        if os.getppid() != _parent_pid:  # it died already, and its SIGTERM was ignored or is being handled
            os.kill(os.getpid(), signal.SIGKILL)


def run_service(name: str, body: Callable[[ServiceContext], None], *, rank: int | None = None,
                json_output: bool | None = None) -> int:
    """Run one llmbus process: the shared skeleton. Returns the exit code."""
    setup_logging(name, rank=rank, json_output=json_output)
    die_with_parent()
    zmq_ctx = zmq.Context()
    ctx = ServiceContext(name=name, zmq_ctx=zmq_ctx, supervisor_endpoint=os.environ.get(ENV_SUPERVISOR))
    code = 0
    try:
        body(ctx)
    except (KeyboardInterrupt, Terminate):
        ctx.log.info("stopped by signal")
    except Exception as e:  # the last line of defence: report, then exit non-zero
        error = f"{type(e).__name__}: {e}"
        ctx.log.error("fatal error", error=error, exc_info=not isinstance(e, (ServiceError, SettingsError)))
        ctx.fatal(error)
        code = 1
    finally:
        ignore_stop_signals()
        zmq_ctx.destroy()  # each socket's own LINGER: long only where a last message must get out
    return code
