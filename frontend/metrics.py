"""Prometheus exposition for ``/metrics`` (prometheus_client's registry and text format).

The scheduler's gauges arrive as ``SchedulerStats`` messages; a collector turns the latest one into
metric families at scrape time, so nothing is updated per token. Names follow TGI's where TGI has the
metric (``tgi_*``); llmbus-only ones are ``llmbus_*``.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from llmbus.bus import messages as m


class SchedulerStatsCollector(Collector):
    """Gauges from the scheduler's latest ``SchedulerStats`` (none until the first one arrives)."""

    def __init__(self, latest: Callable[[], m.SchedulerStats | None]):
        self._latest = latest

    def collect(self) -> Iterator:
        stats = self._latest()
        if stats is None:
            return
        yield GaugeMetricFamily("tgi_queue_size", "Requests waiting for admission", value=stats.queue_size)
        yield GaugeMetricFamily("tgi_batch_current_size", "Requests in the running batch", value=stats.batch_size)
        yield GaugeMetricFamily("tgi_batch_current_max_tokens",
                                "Tokens the running batch can grow to (prompt + max_new_tokens)",
                                value=stats.batch_max_tokens)
        yield GaugeMetricFamily("tgi_batch_max_total_tokens", "KV cache capacity in tokens (from warmup)",
                                value=stats.kv_blocks_total * stats.block_size)
        yield GaugeMetricFamily("llmbus_kv_blocks_total", "KV cache blocks in the pool",
                                value=stats.kv_blocks_total)
        yield GaugeMetricFamily("llmbus_kv_blocks_free", "KV cache blocks owned by no request (cached ones included)",
                                value=stats.kv_blocks_free)
        yield GaugeMetricFamily("llmbus_kv_blocks_cached", "Free KV blocks the prefix cache keeps for reuse",
                                value=stats.kv_blocks_cached)
        yield CounterMetricFamily("llmbus_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_cache_queried_tokens)
        yield CounterMetricFamily("llmbus_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=stats.prefix_cache_hit_tokens)
        yield CounterMetricFamily("llmbus_preemptions", "Running requests sent back to the queue for lack of KV blocks",
                                  value=stats.preemptions)
        steps = CounterMetricFamily("tgi_batch_inference_count", "Steps run", labels=["method"])
        steps.add_metric(["prefill"], stats.prefill_steps)
        steps.add_metric(["decode"], stats.decode_steps)
        yield steps
        concat = CounterMetricFamily("tgi_batch_concat", "New requests joining a running batch", labels=["reason"])
        for reason in ("chunking", "backpressure", "wait_exceeded"):
            concat.add_metric([reason], getattr(stats, f"concat_{reason}"))
        yield concat
        for name, doc, pair in (
                ("tgi_batch_forward_duration", "Forward pass time (rank 0)", (stats.prefill_forward, stats.decode_forward)),
                ("tgi_batch_inference_duration", "Step time, command to result",
                 (stats.prefill_duration, stats.decode_duration))):
            family = HistogramMetricFamily(name, doc, labels=["method"])
            for method, histogram in zip(("prefill", "decode"), pair):
                if histogram is not None:
                    family.add_metric([method], *_buckets(histogram))
            yield family
        if stats.next_batch_size is not None:
            family = HistogramMetricFamily("tgi_batch_next_size", "Requests admitted by a step")
            family.add_metric([], *_buckets(stats.next_batch_size))
            yield family


def _buckets(histogram: m.Histogram) -> tuple[list[tuple[str, float]], float]:
    """prometheus_client's cumulative (upper bound, count) pairs, ending with +Inf, and the sum."""
    pairs, total = [], 0
    for bound, count in zip([*map(float, histogram.buckets), float("inf")], histogram.counts):
        total += count
        pairs.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return pairs, histogram.sum


def make_registry(latest_stats: Callable[[], m.SchedulerStats | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SchedulerStatsCollector(latest_stats))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition body and its Content-Type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
