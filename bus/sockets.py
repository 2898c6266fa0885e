"""The only place that opens ZeroMQ sockets and moves messages through them.

Rules (see ARCHITECTURE.md): receivers and publishers bind, senders and subscribers connect; high-water
marks are finite; LINGER is 0 except where a last message must get out (``linger_ms``). A malformed frame
is logged and dropped: ``recv`` returns None, it never raises into the caller's loop.
"""

from __future__ import annotations

import os
import time

import structlog

import zmq
import zmq.asyncio

from llmbus.bus.messages import Message, ProtocolError, decode, encode

log = structlog.get_logger("llmbus.bus")

# Bounded queues: admission control in the frontend keeps them from filling; if they do, PUSH blocks
# (back-pressure) rather than growing memory without limit.
DEFAULT_HWM = 10_000

_BINDS = {zmq.PULL, zmq.PUB, zmq.XPUB}


def open_socket(ctx: zmq.Context, sock_type: int, endpoint: str, *, hwm: int = DEFAULT_HWM,
                linger_ms: int = 0, subscribe: bytes | None = None):
    """Create ``sock_type`` on ``endpoint``: bind for PULL/PUB/XPUB, connect for the rest."""
    sock = ctx.socket(sock_type)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if sock_type == zmq.XPUB:
        # Every SUBSCRIBE reaches us, duplicates too, so the publisher can count its subscribers.
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    if sock_type == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, subscribe or b"")
    try:
        if sock_type in _BINDS:
            sock.bind(endpoint)
            if endpoint.startswith("ipc://"):
                # Only this user may connect, even where the run dir's own mode were to be loosened.
                os.chmod(endpoint.removeprefix("ipc://"), 0o600)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


def send(sock: zmq.Socket, msg: Message, flags: int = 0) -> None:
    sock.send_multipart(encode(msg), flags=flags, copy=True)


def recv(sock: zmq.Socket, flags: int = 0) -> Message | None:
    """Next message, or None if the frames were malformed (logged). Raises zmq.Again with NOBLOCK."""
    frames = sock.recv_multipart(flags=flags)
    return _decode_or_log(frames)


async def asend(sock: zmq.asyncio.Socket, msg: Message) -> None:
    await sock.send_multipart(encode(msg), copy=True)


async def arecv(sock: zmq.asyncio.Socket) -> Message | None:
    frames = await sock.recv_multipart()
    return _decode_or_log(frames)


# A malformed message is logged at most once per this many seconds per kind, with a count of the ones
# dropped silently since: a peer sending garbage in a loop cannot flood the log (20,000 frames wrote 3.2 MB).
DROP_LOG_INTERVAL_S = 10.0


class _DropLog:
    """Rate-limited error lines for dropped messages, keyed by the message kind (its first frame)."""

    def __init__(self):
        self._last: dict[bytes, float] = {}
        self._suppressed: dict[bytes, int] = {}

    def __call__(self, frames: list[bytes], error: ProtocolError) -> None:
        kind = frames[0][:1] if frames and len(frames[0]) == 1 else b"?"
        now = time.monotonic()
        if now - self._last.get(kind, float("-inf")) < DROP_LOG_INTERVAL_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        log.error("dropped malformed message", error=str(error), kind=kind.hex() if kind != b"?" else "?",
                  frames=len(frames), sizes=[len(f) for f in frames][:4],
                  suppressed_since_last=self._suppressed.pop(kind, 0))


_log_drop = _DropLog()


def _decode_or_log(frames: list[bytes]) -> Message | None:
    try:
        return decode(frames)
    except ProtocolError as e:
        _log_drop(frames, e)
        return None


def poll(sockets: list[zmq.Socket], timeout_ms: int | None) -> set[zmq.Socket]:
    """The subset of ``sockets`` with a message ready within ``timeout_ms`` (None waits forever)."""
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    return {s for s, _ in poller.poll(timeout_ms)}
