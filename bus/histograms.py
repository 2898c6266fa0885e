"""Prometheus-style histograms kept as counts per bucket since start (pure: no clocks, no I/O), with TGI's
buckets (router/src/server.rs): 35 geometric duration buckets from 0.15 ms, powers of two up to 1024 for
batch sizes; and 0 to 8 for the tokens a speculating request gets beyond one a step (TGI leaves that one
unbucketed). The scheduler keeps its step metrics and each frontend its request metrics in them, and they
travel as ``messages.Histogram``, so any number of frontends expose the same counts.
"""

from __future__ import annotations

import bisect

from llmbus.bus import messages as m

DURATION_BUCKETS = [0.0001 * 1.5 ** k for k in range(1, 36)]
BATCH_SIZE_BUCKETS = [float(2 ** k) for k in range(11)]
SKIPPED_TOKEN_BUCKETS = [float(k) for k in range(9)]  # tokens a request got beyond one in a step (speculation)


class HistogramCounts:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: list[float]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def snapshot(self) -> m.Histogram:
        return m.Histogram(self.buckets, list(self.counts), self.sum)
