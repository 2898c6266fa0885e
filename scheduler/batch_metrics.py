"""Step metrics the scheduler accumulates and ships in ``SchedulerStats`` (pure: no clocks, no I/O).

Histograms are kept as counts per bucket since start, the way Prometheus histograms are, so a frontend
can expose them as they arrive and any number of frontends agree. Buckets are TGI's (router/src/server.rs):
35 geometric duration buckets from 0.15 ms, powers of two up to 1024 for batch sizes.
"""

from __future__ import annotations

import bisect

from llmbus.bus import messages as m

DURATION_BUCKETS = [0.0001 * 1.5 ** k for k in range(1, 36)]
BATCH_SIZE_BUCKETS = [float(2 ** k) for k in range(11)]


class HistogramCounts:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: list[float]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> m.Histogram:
        return m.Histogram(self.buckets, list(self.counts), self.sum)


class BatchMetrics:
    """Per-method step counts and durations, and the size of every group of newly admitted requests."""

    def __init__(self) -> None:
        self.steps = {"prefill": 0, "decode": 0}
        self.forward = {"prefill": HistogramCounts(DURATION_BUCKETS), "decode": HistogramCounts(DURATION_BUCKETS)}
        self.duration = {"prefill": HistogramCounts(DURATION_BUCKETS), "decode": HistogramCounts(DURATION_BUCKETS)}
        self.next_batch_size = HistogramCounts(BATCH_SIZE_BUCKETS)

    def record_step(self, has_prefill: bool, admitted: int, forward_s: float, duration_s: float) -> None:
        method = "prefill" if has_prefill else "decode"
        self.steps[method] += 1
        self.forward[method].observe(forward_s)
        self.duration[method].observe(duration_s)
        if admitted:
            self.next_batch_size.observe(admitted)

    def fill(self, stats: m.SchedulerStats) -> m.SchedulerStats:
        stats.prefill_steps, stats.decode_steps = self.steps["prefill"], self.steps["decode"]
        stats.prefill_forward = self.forward["prefill"].snapshot()
        stats.decode_forward = self.forward["decode"].snapshot()
        stats.prefill_duration = self.duration["prefill"].snapshot()
        stats.decode_duration = self.duration["decode"].snapshot()
        stats.next_batch_size = self.next_batch_size.snapshot()
        return stats
