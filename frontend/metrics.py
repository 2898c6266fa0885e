"""Prometheus exposition for ``/metrics`` (prometheus_client's registry and text format).

The scheduler's gauges arrive as ``SchedulerStats`` messages; a collector turns the latest one into
metric families at scrape time, so nothing is updated per token. Names follow TGI's where TGI has the
metric (``tgi_*``); llmbus-only ones are ``llmbus_*``.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmbus.bus import messages as m


class SchedulerStatsCollector(Collector):
    """Gauges from the scheduler's latest ``SchedulerStats`` (none until the first one arrives)."""

    def __init__(self, latest: Callable[[], m.SchedulerStats | None]):
        self._latest = latest

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        yield GaugeMetricFamily("llmbus_kv_blocks_free", "KV cache blocks owned by no request",
                                value=stats.kv_blocks_free)


def make_registry(latest_stats: Callable[[], m.SchedulerStats | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SchedulerStatsCollector(latest_stats))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition body and its Content-Type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
