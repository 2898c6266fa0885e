"""Step metrics the scheduler accumulates and ships in ``SchedulerStats`` (pure: no clocks, no I/O), as
counts per bucket since start (bus/histograms.py)."""

from __future__ import annotations

from llmbus.bus import messages as m
from llmbus.bus.histograms import BATCH_SIZE_BUCKETS, DURATION_BUCKETS, HistogramCounts


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
