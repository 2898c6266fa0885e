"""The fastest of several runs of a function, the figure the small host-work benchmarks print
(image_preprocessing.py, mrope_positions.py). Not a benchmark itself (the leading underscore)."""

from __future__ import annotations

import time


def fastest_s(fn, repeats: int) -> float:
    """Seconds of ``fn()``'s fastest run of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
