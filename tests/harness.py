"""Test helpers that start real llmbus processes and wait for explicit readiness (never sleeps)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from llmbus.bus import messages as m
from llmbus.bus.service import ENV_SUPERVISOR
from llmbus.bus.sockets import open_socket, recv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LineReader:
    """Collects a process's stderr lines on a thread so tests can wait for a specific line."""

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
    """`llmbus up ...` as a child process; ready once the launcher prints its ready line."""

    def __init__(self, args: list[str], *, env: dict | None = None, ready_timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "llmbus.supervisor", "up", "--hostname", "127.0.0.1",
                                      "--port", str(self.port), *args],
                                     stderr=subprocess.PIPE, env=full_env)
        self.stderr = LineReader(self.proc.stderr)
        try:
            self.stderr.wait_for("llmbus: ready", ready_timeout)
        except Exception:
            self.stop()
            raise

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.join()
        return self.proc.returncode


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rank_pids(server: Server) -> list[int]:
    """A launch's live ranks by rank number: the group's children (their command lines end with --rank N),
    or the group's own process where it has one rank, which it runs itself."""
    ranks, groups = {}, []
    for pid in descendants(server.proc.pid):
        line = cmdline(pid).split()
        if "--rank" in line:
            ranks[int(line[line.index("--rank") + 1])] = pid
        elif "llmbus.workers" in line:
            groups.append(pid)
    return [ranks[r] for r in sorted(ranks)] or groups


class SupervisorSocket:
    """Stands in for `llmbus up`'s supervisor: collects ServiceReady / ServiceFatal messages."""

    def __init__(self, run_dir: Path):
        self.ctx = zmq.Context()
        self.endpoint = f"ipc://{run_dir}/test-supervisor.sock"
        self.sock = open_socket(self.ctx, zmq.PULL, self.endpoint)

    @property
    def env(self) -> dict[str, str]:
        return {ENV_SUPERVISOR: self.endpoint}

    def wait_ready(self, service: str, timeout: float = 120.0) -> m.ServiceReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                msg = recv(self.sock)
                if isinstance(msg, m.ServiceFatal):
                    raise RuntimeError(f"{msg.service} failed: {msg.error}")
                if isinstance(msg, m.ServiceReady) and msg.service == service:
                    return msg
        raise TimeoutError(f"{service} not ready within {timeout}s")

    def wait_for(self, kind: type[m.Message], timeout: float = 60.0) -> m.Message:
        """The next message of ``kind`` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while self.sock.poll(int(max(deadline - time.monotonic(), 0.0) * 1000) + 1):
            msg = recv(self.sock)
            if isinstance(msg, kind):
                return msg
            if time.monotonic() >= deadline:
                break
        raise TimeoutError(f"no {kind.__name__} within {timeout}s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
