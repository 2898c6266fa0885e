"""Prometheus exposition for ``/metrics`` (prometheus_client's registry and text format).

The scheduler's gauges arrive as ``SchedulerStats`` messages; a collector turns the latest one into
metric families at scrape time, so nothing is updated per token. Names follow TGI's where TGI has the
metric (``tgi_*``); llmbus-only ones are ``llmbus_*``.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        yield GaugeMetricFamily("llmbus_onednn_cache_capacity",
                                "Entries each of oneDNN's shape-keyed kernel caches may hold on rank 0 "
                                "(--onednn-cache-capacity; 0 off CPU)", value=stats.onednn_cache_capacity)
        yield GaugeMetricFamily("llmbus_worker_request_state",
                                "Per-request objects rank 0 holds after the last step (request states, histories, "
                                "grammar matchers, prompt-logprob rows, draft guesses), its finished requests' "
                                "included", value=stats.worker_request_state)
        yield GaugeMetricFamily("llmbus_prefix_cache_heap_entries",
                                "Entries of the prefix cache's LRU heap, stale ones included (bounded)",
                                value=stats.prefix_cache_heap_entries)
        yield counter("llmbus_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache",
                      {(): stats.prefix_cache_queried_tokens})
        yield counter("llmbus_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache",
                      {(): stats.prefix_cache_hit_tokens})
        yield counter("llmbus_preemptions_total", "Running requests sent back to the queue for lack of KV blocks",
                      {(): stats.preemptions})
        yield counter("llmbus_speculative_proposed_tokens_total", "Guessed tokens fed to the ranks, by method",
                      {(stats.spec_method,): stats.spec_proposed}, ("method",))
        yield counter("llmbus_speculative_accepted_tokens_total", "Of the guessed tokens, those kept, by method",
                      {(stats.spec_method,): stats.spec_accepted}, ("method",))
        yield counter("llmbus_worker_restarts_total",
                      "Times the worker ranks died or hung and were restarted, their requests resumed",
                      {(): stats.worker_restarts})
        yield counter("tgi_batch_inference_count", "Steps run",
                      {("prefill",): stats.prefill_steps, ("decode",): stats.decode_steps}, ("method",))
        yield counter("tgi_batch_inference_success", "Steps whose result came back whole",
                      {("prefill",): stats.prefill_success, ("decode",): stats.decode_success}, ("method",))
        yield counter("tgi_batch_inference_failure", "Steps that failed in the engine or were lost with its ranks",
                      {("prefill",): stats.prefill_failure, ("decode",): stats.decode_failure}, ("method",))
        yield counter("tgi_batch_concat", "New requests joining a running batch",
                      {(reason,): getattr(stats, f"concat_{reason}")
                       for reason in ("chunking", "backpressure", "wait_exceeded")}, ("reason",))
        for name, doc, pair in (
                ("tgi_batch_forward_duration", "Forward pass time (rank 0)",
                 (stats.prefill_forward, stats.decode_forward)),
                ("tgi_batch_inference_duration", "Step time, command to result",
                 (stats.prefill_duration, stats.decode_duration)),
                ("tgi_batch_decode_duration", "Choosing the step's tokens after the forward pass (rank 0)",
                 (stats.prefill_sample, stats.decode_sample)),
                ("tgi_batch_filter_duration", "The scheduler applying a step's result",
                 (stats.prefill_filter, stats.decode_filter)),
                # TGI times its concatenations under method="decode" only
                ("tgi_batch_concat_duration", "Forming a step that joined new requests to a running batch",
                 (None, stats.concat_duration))):
            family = HistogramMetricFamily(name, doc, labels=["method"])
            for method, counts in zip(("prefill", "decode"), pair):
                if counts is not None:
                    family.add_metric([method], *_buckets(counts))
            yield family
        if stats.next_batch_size is not None:
            yield histogram("tgi_batch_next_size", "Requests admitted by a step", stats.next_batch_size)
        if stats.skipped_tokens is not None:
            yield histogram("tgi_request_skipped_tokens", "Tokens a request got beyond one in a step (speculation)",
                            stats.skipped_tokens)


def _buckets(counts: m.Histogram) -> tuple[list[tuple[str, float]], float]:
    """prometheus_client's cumulative (upper bound, count) pairs, ending with +Inf, and the sum."""
    pairs, total = [], 0
    for bound, count in zip([*map(float, counts.buckets), float("inf")], counts.counts):
        total += count
        pairs.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return pairs, counts.sum


def histogram(name: str, documentation: str, counts: m.Histogram) -> HistogramMetricFamily:
    """An unlabelled histogram family from counts per bucket."""
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], *_buckets(counts))
    return family


def counter(name: str, documentation: str, values: dict[tuple, float], label_names: tuple[str, ...] = ()
            ) -> Metric:
    """A counter whose samples are named exactly ``name``: TGI's counters have no ``_total`` suffix
    (its Rust exporter writes names as given), and dashboards built for TGI query them so."""
    metric = Metric(name, documentation, "counter")
    for label_values, value in values.items():
        metric.add_sample(name, dict(zip(label_names, label_values)), value)
    return metric


def make_registry(latest_stats: Callable[[], m.SchedulerStats | None], *others: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SchedulerStatsCollector(latest_stats))
    for collector in others:
        registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition (format 0.0.4) and its Content-Type.

    prometheus_client's own writer would name every counter's HELP and TYPE lines ``<name>_total``, which
    does not match samples named as TGI names them; here the lines take the samples' name."""
    lines = []
    for family in registry.collect():
        name = family.name
        if family.type == "counter" and family.samples and family.samples[0].name != name:
            name = family.samples[0].name  # a counter declared with its _total (llmbus_* ones)
        documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {name} {documentation}\n# TYPE {name} {family.type}\n")
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n" if labels
                         else f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(lines).encode("utf-8"), CONTENT_TYPE_LATEST


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
