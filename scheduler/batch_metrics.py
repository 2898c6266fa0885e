"""Step metrics the scheduler accumulates and ships in ``SchedulerStats`` (pure: no clocks, no I/O), as
counts per bucket since start (bus/histograms.py)."""

from __future__ import annotations

from llmbus.bus import messages as m
from llmbus.bus.histograms import BATCH_SIZE_BUCKETS, DURATION_BUCKETS, SKIPPED_TOKEN_BUCKETS, HistogramCounts

METHODS = ("prefill", "decode")  # TGI's method label: a step that computed prompt tokens, or decodes only


def _method(has_prefill: bool) -> str:
    return "prefill" if has_prefill else "decode"


def _per_method() -> dict[str, HistogramCounts]:
    return {method: HistogramCounts(DURATION_BUCKETS) for method in METHODS}


class BatchMetrics:
    """Per-method step counts, outcomes and durations, the size of every group of newly admitted requests,
    and the tokens each request got beyond one a step."""

    def __init__(self) -> None:
        self.steps = dict.fromkeys(METHODS, 0)
        self.success = dict.fromkeys(METHODS, 0)
        self.failure = dict.fromkeys(METHODS, 0)
        self.forward, self.duration = _per_method(), _per_method()
        self.sample, self.filter = _per_method(), _per_method()
        self.concat = HistogramCounts(DURATION_BUCKETS)
        self.next_batch_size = HistogramCounts(BATCH_SIZE_BUCKETS)
        self.skipped_tokens = HistogramCounts(SKIPPED_TOKEN_BUCKETS)

    def record_step(self, has_prefill: bool, admitted: int, forward_s: float, sample_s: float,
                    duration_s: float) -> None:
        """A step's result came back (whole, or failed: then ``record_failure`` too)."""
        method = _method(has_prefill)
        self.steps[method] += 1
        self.forward[method].observe(forward_s)
        self.sample[method].observe(sample_s)
        self.duration[method].observe(duration_s)
        if admitted:
            self.next_batch_size.observe(admitted)

    def record_applied(self, has_prefill: bool, filter_s: float, delivered: int,
                       per_request: list[int] | None) -> None:
        """A whole result applied, and the time that took: it gave clients ``delivered`` tokens, one per
        request, or ``per_request`` of them (a step that speculated)."""
        method = _method(has_prefill)
        self.success[method] += 1
        self.filter[method].observe(filter_s)
        if per_request is None:
            self.skipped_tokens.observe(0, times=delivered)  # in bulk: the scheduler's hot path at c=64
            return
        for count in per_request:
            self.skipped_tokens.observe(count - 1)

    def record_failure(self, has_prefill: bool) -> None:
        """A step that failed in the engine, or was lost with its ranks."""
        self.failure[_method(has_prefill)] += 1

    def record_concat(self, seconds: float) -> None:
        self.concat.observe(seconds)

    def fill(self, stats: m.SchedulerStats) -> m.SchedulerStats:
        stats.prefill_steps, stats.decode_steps = self.steps["prefill"], self.steps["decode"]
        stats.prefill_success, stats.decode_success = self.success["prefill"], self.success["decode"]
        stats.prefill_failure, stats.decode_failure = self.failure["prefill"], self.failure["decode"]
        for method in METHODS:
            setattr(stats, f"{method}_forward", self.forward[method].snapshot())
            setattr(stats, f"{method}_duration", self.duration[method].snapshot())
            setattr(stats, f"{method}_sample", self.sample[method].snapshot())
            setattr(stats, f"{method}_filter", self.filter[method].snapshot())
        stats.concat_duration = self.concat.snapshot()
        stats.next_batch_size = self.next_batch_size.snapshot()
        stats.skipped_tokens = self.skipped_tokens.snapshot()
        return stats
