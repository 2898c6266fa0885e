"""The only place that opens ZeroMQ sockets and moves messages through them.

Rules (docs/architecture.md, "Sockets"): receivers and publishers bind, senders and subscribers connect;
high-water marks are finite; LINGER is 0 except where a last message must get out (``linger_ms``). A malformed
frame is logged and dropped: ``recv`` returns None, it never raises into the caller's loop.

Over ipc the kernel tells who sent a message (ZeroMQ's Peer-Address metadata carries the sender's pid):
``recv_from`` returns it, so a receiver can take a message only from the process that must have sent it,
and every dropped message's log line names its sender.
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
    return recv_from(sock, flags)[0]


def recv_from(sock: zmq.Socket, flags: int = 0) -> tuple[Message | None, int | None]:
    """``recv``, and the sender's pid (None where the transport cannot tell: tcp)."""
    frames = sock.recv_multipart(flags=flags, copy=False)
    return decode_frames(frames)


async def asend(sock: zmq.asyncio.Socket, msg: Message) -> None:
    await sock.send_multipart(encode(msg), copy=True)


async def arecv(sock: zmq.asyncio.Socket) -> Message | None:
    return (await arecv_from(sock))[0]


async def arecv_from(sock: zmq.asyncio.Socket) -> tuple[Message | None, int | None]:
    frames = await sock.recv_multipart(copy=False)
    return decode_frames(frames)


def peer_pid(frame: zmq.Frame) -> int | None:
    """The sending process of ``frame`` over ipc ("host:uid:gid:pid"); None otherwise."""
    try:
        parts = frame.get("Peer-Address").split(":")
    except (zmq.ZMQError, AttributeError):
        return None
    return int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else None


def decode_frames(frames: list[zmq.Frame]) -> tuple[Message | None, int | None]:
    """The message of frames received with ``copy=False`` (None if malformed, logged) and its sender's
    pid, for a receiver that reads its socket itself."""
    peer = peer_pid(frames[0]) if frames else None
    data = [f.bytes for f in frames]
    try:
        return decode(data), peer
    except ProtocolError as e:
        kind = data[0][:1].hex() if data and len(data[0]) == 1 else "?"
        log_dropped(kind, "dropped malformed message", error=str(e), peer_pid=peer, frames=len(data),
                    sizes=[len(f) for f in data][:4])
        return None, peer


# A malformed message is logged at most once per this many seconds per kind, with a count of the ones
# dropped silently since: a peer sending garbage in a loop cannot flood the log (design notes, "A malformed
# message is dropped, and logged once in a while").
DROP_LOG_INTERVAL_S = 10.0


class DropLog:
    """Rate-limited error lines for messages a receiver drops (malformed, or refused: a forged sender, an
    out-of-range field), keyed by message kind and event: at most one line per key per interval, which
    counts the ones dropped silently since."""

    def __init__(self):
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def __call__(self, kind: str, event: str, **fields) -> None:
        key = (kind, event)
        now = time.monotonic()
        if now - self._last.get(key, float("-inf")) < DROP_LOG_INTERVAL_S:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        log.error(event, kind=kind, **fields, suppressed_since_last=self._suppressed.pop(key, 0))


log_dropped = DropLog()


def poll(sockets: list[zmq.Socket], timeout_ms: int | None) -> set[zmq.Socket]:
    """The subset of ``sockets`` with a message ready within ``timeout_ms`` (None waits forever)."""
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    return {s for s, _ in poller.poll(timeout_ms)}
