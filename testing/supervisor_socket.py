"""A stand-in for `llmbus up`'s supervisor, for tests that start services on their own."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from llmbus.bus import messages as m
from llmbus.bus.service import ENV_SUPERVISOR
from llmbus.bus.sockets import open_socket, recv

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
