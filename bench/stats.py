"""The numbers a load level is judged by, computed from its per-request samples.

Pure functions over plain data (no I/O, no clock), so they are tested with hand-made samples.

Definitions (the ones vLLM's and TGI's benchmarks use, so results read alike):

- TTFT: request sent -> first token event received.
- ITL (inter-token latency): the gap between consecutive token events of a stream, every gap of every
  successful request pooled, so a stall shows up in the tail percentiles.
- TPOT (time per output token): per request, (e2e - TTFT) / (tokens - 1): its mean decode pace.
- e2e: request sent -> last event received.
- Throughput: successful requests and their generated tokens divided by the level's wall time (first
  request sent -> last one finished).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class Sample:
    """One request as the load generator saw it. Times are seconds; ``start`` counts from the level's
    start, ``token_times`` from this request's send (one entry per token event of the stream)."""

    index: int
    start: float
    prompt_tokens: int | None
    max_new_tokens: int
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default method); None for no values. JSON has no NaN, hence None."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summarize(values: list[float]) -> dict:
    """Count, mean, min, max and the PERCENTILES of ``values``; all None but the count when empty."""
    out: dict = {"n": len(values), "mean": sum(values) / len(values) if values else None,
                 "min": min(values, default=None), "max": max(values, default=None)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def level_stats(samples: list[Sample], duration: float) -> dict:
    """Everything the table, the plot and the JSON show for one level, from its samples and its wall
    time in seconds."""
    ok = [s for s in samples if s.ok]
    tokens = sum(s.output_tokens for s in ok)
    prompt_tokens = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    errors = Counter(s.error for s in samples if not s.ok)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "error_kinds": dict(errors.most_common(5)),
        "duration_s": duration,
        "output_tokens": tokens,
        "prompt_tokens": sum(prompt_tokens),
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(tokens),
        "ttft_s": summarize([s.ttft for s in ok if s.ttft is not None]),
        "itl_s": summarize([gap for s in ok for gap in s.itls()]),
        "tpot_s": summarize([s.tpot for s in ok if s.tpot is not None]),
        "e2e_s": summarize([s.e2e for s in ok if s.e2e is not None]),
    }


def decode_rate(sample: Sample) -> float | None:
    """One stream's decode speed in tokens/s: the tokens after the first over the time after it."""
    tpot = sample.tpot
    return 1.0 / tpot if tpot else None
