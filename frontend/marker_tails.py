"""How much of a streamed text's end to hold back: a tail that could still grow into a marker (a tool-call tag,
a reasoning section's end, a harmony token) is not shown until the next fragment says what it is."""

from __future__ import annotations


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that begins one of ``markers`` without being all of it."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(marker.startswith(tail) for marker in markers):
            return n
    return 0
