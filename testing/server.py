"""``llmbus up`` as a child process, ready once it says so and stopped whatever happens, and its process
tree as /proc shows it (through ``llmbus.bus.procfs``, the one reader of /proc)."""

from __future__ import annotations

import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from llmbus.bus.procfs import command_words, descendants, process_alive

READY_LINE = "llmbus: ready"  # what the launcher prints once every service has reported ready
# Long enough for a test's tiny model on a loaded machine, short enough to fail with the server's last
# lines before pytest-timeout (300 s) kills the test without them.
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
# The launcher reaps its children before it exits; this is margin for the kernel to finish them off.
LEFTOVER_GRACE_S = 5.0


# Ports the kernel never hands out as a connection's own (below its ephemeral range): a port the kernel picked
# for us (bind to 0) comes from that range, so the tests' own requests could take it as their source port
# before the server binds it ("address already in use", seen with two frontends sharing a port).
LOWEST_PORT = 10000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's dynamic range
        return 49152


def free_port() -> int:
    """A local port nothing listens on, outside the ephemeral range where the system has one."""
    start = _ephemeral_start()
    candidates = range(LOWEST_PORT, start) if start > LOWEST_PORT + 1000 else range(0)
    for port in random.sample(candidates, min(50, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LineReader:
    """Collects a process's stderr lines on a thread so callers can wait for a specific line."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._t.start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line containing {needle!r} within {timeout}s; last lines:\n"
                                   + "\n".join(self.lines[-30:]))
            try:
                line = self._q.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"process ended before printing {needle!r}; last lines:\n"
                                   + "\n".join(self.lines[-30:]))
            if needle in line:
                return line

    def join(self, timeout: float = 10.0) -> None:
        self._t.join(timeout)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class Server:
    """``llmbus up ARGS`` on a free local port, started by the constructor, which returns once the launcher
    prints its ready line (or stops it and raises, the server's last lines in the message).

    ``stop()`` sends SIGTERM, waits ``stop_timeout``, then SIGKILLs, and returns the exit status; afterwards
    ``leftover`` lists the pids of the launcher's process tree still alive (it should be empty). As a
    context manager it stops on leaving the block, however the block ended, and prints the server's last
    lines when the block raised. ``env`` adds to the launcher's environment (PYTHONPATH: another llmbus
    revision)."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
                 ready_timeout: float = READY_TIMEOUT_S, stop_timeout: float = STOP_TIMEOUT_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "llmbus.supervisor", "up", "--hostname", "127.0.0.1",
                    "--port", str(self.port), *args]
        self.stop_timeout = stop_timeout
        self.pids: list[int] = []
        self.leftover: list[int] = []
        self.terminated = False
        print(f"server: {self.command_line}", flush=True)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.stderr = LineReader(self.proc.stderr)
        try:
            self.stderr.wait_for(READY_LINE, ready_timeout)
        except BaseException:  # Ctrl-C during a long start included: no server outlives its caller
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        self.pids = [self.proc.pid, *descendants(self.proc.pid)]

    @property
    def command_line(self) -> str:
        """The launch as a user would type it."""
        return shlex.join(["llmbus", *self.cmd[3:]])

    def __enter__(self) -> Server:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is not None:  # the server's side of the story
            print("last server log lines:\n" + "\n".join(self.stderr.lines[-25:]), file=sys.stderr)

    def terminate(self) -> None:
        """SIGTERM, without waiting (``stop`` waits): what ``stop_all`` sends every server first."""
        if self.proc.poll() is None and not self.terminated:
            self.pids = list(dict.fromkeys([*self.pids, self.proc.pid, *descendants(self.proc.pid)]))
            self.proc.send_signal(signal.SIGTERM)  # once: a second would be an impatient user's
            self.terminated = True

    def stop(self, timeout: float | None = None) -> int:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.join()
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while [p for p in self.pids if process_alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftover = [p for p in self.pids if process_alive(p)]
        return self.proc.returncode

    def log_lines(self, *needles: str) -> list[str]:
        """Server stderr lines containing any of ``needles`` (case-insensitive)."""
        return [line for line in self.stderr.lines if any(n.lower() in line.lower() for n in needles)]


def stop_all(servers) -> list[int]:
    """Each server's exit status, the servers stopping side by side rather than one after another."""
    servers = list(servers)
    for server in servers:
        server.terminate()
    return [server.stop() for server in servers]


def rank_pids(server: Server) -> list[int]:
    """A launch's live ranks by rank number: the group's children (their command lines end with --rank N),
    or the group's own process where it has one rank, which it runs itself."""
    ranks, groups = {}, []
    for pid in descendants(server.proc.pid):
        line = command_words(pid)
        if "--rank" in line:
            ranks[int(line[line.index("--rank") + 1])] = pid
        elif "llmbus.workers" in line:
            groups.append(pid)
    return [ranks[r] for r in sorted(ranks)] or groups
