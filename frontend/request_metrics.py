"""TGI's per-request metrics (``tgi_request_*``) and per-request log line, kept by the frontend that
answers the requests.

Each HTTP generation request counts once in ``tgi_request_count`` and ends as a success or as a failure
labelled ``err`` (``validation``, ``overloaded``, ``generation``, ``incomplete``, ``template``,
``dropped`` for a client that left); llmbus adds ``llmbus_request_route_count{route}``, the same requests by
HTTP route. Each generation that finishes (one per request; ``best_of`` and
``n`` make several) adds one observation to the histograms, with TGI's buckets: 35 geometric ones from
0.15 ms for durations, 100 linear ones up to the token limits for lengths.

Plain counters and bucket arrays, updated with a few additions per finished generation; the collector
turns them into metric families only when ``/metrics`` is scraped. When several frontends serve one
engine, each sends its counts to the others through the scheduler (``FrontendStats``, a few times a second
while they change): a scrape reports this frontend's live counts plus the others' latest, so it does not
matter which frontend a load balancer sends the scraper to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import structlog
from prometheus_client.registry import Collector

from llmbus.bus import messages as m
from llmbus.bus import tracing
# the same counts-per-bucket histograms (and TGI's duration buckets) as the scheduler's step metrics
from llmbus.bus.histograms import DURATION_BUCKETS, HistogramCounts
from llmbus.frontend.errors import ErrorKind
from llmbus.frontend.metrics import counter, histogram

if TYPE_CHECKING:
    from llmbus.frontend.generation import Generation

log = structlog.get_logger("llmbus.frontend")

# TGI's err label for each error kind a request can end with
FAILURE_LABELS = {
    ErrorKind.VALIDATION: "validation", ErrorKind.BODY: "validation", ErrorKind.PAYLOAD_TOO_LARGE: "validation",
    ErrorKind.BATCH_SIZE: "validation", ErrorKind.SUFFIX: "validation", ErrorKind.TOOL: "validation",
    ErrorKind.OVERLOADED: "overloaded", ErrorKind.GENERATION: "generation", ErrorKind.INCOMPLETE: "incomplete",
    ErrorKind.INCOMPLETE_STREAM: "incomplete", ErrorKind.TEMPLATE: "template",
    ErrorKind.SHUTTING_DOWN: "shutdown", ErrorKind.NOT_FOUND: "validation", ErrorKind.UNSUPPORTED: "validation",
    ErrorKind.INTERNAL: "internal",
}
DROPPED = "dropped"


def failure_label(kind: ErrorKind) -> str:
    return FAILURE_LABELS.get(kind, "generation")


def linear_buckets(limit: int, count: int = 100) -> list[float]:
    step = max(limit / count, 1.0)
    return [step * (i + 1) for i in range(count)]


class RequestMetrics(Collector):
    def __init__(self, peers: Callable[[], Iterable[m.FrontendStats]] = tuple) -> None:
        self._peers = peers
        self.version = 0  # bumped by every change: what the stats sender watches
        self.count = 0
        self.success = 0
        self.failures: dict[str, int] = {}
        self.routes: dict[str, int] = {}  # requests by HTTP route (TGI has no such counter; llmbus's)
        self.adapters: dict[str, int] = {}  # finished generations by LoRA adapter ("": the base model)
        self._durations = {name: HistogramCounts(DURATION_BUCKETS) for name in (
            "duration", "validation_duration", "queue_duration", "inference_duration",
            "mean_time_per_token_duration")}
        self._lengths: dict[str, HistogramCounts] = {}

    def set_limits(self, max_input_tokens: int, max_total_tokens: int) -> None:
        """The length histograms' buckets follow the token limits, known once the scheduler answered."""
        self._lengths = {"input_length": HistogramCounts(linear_buckets(max_input_tokens)),
                         "generated_tokens": HistogramCounts(linear_buckets(max_total_tokens)),
                         "max_new_tokens": HistogramCounts(linear_buckets(max_total_tokens))}

    # --- recording ---------------------------------------------------------------------------------

    def started(self, route: str) -> None:
        self.count += 1
        self.routes[route] = self.routes.get(route, 0) + 1
        self.version += 1

    def succeeded(self) -> None:
        self.success += 1
        self.version += 1

    def failed(self, label: str) -> None:
        self.failures[label] = self.failures.get(label, 0) + 1
        self.version += 1

    def generation_finished(self, gen: "Generation") -> None:
        """Observe a finished generation, and log it as TGI logs each request it answered."""
        generated = len(gen.tokens)
        total, validation, queue, inference = gen.timings.split(gen.prepared.start_time)
        speculation = {}
        if gen.speculation is not None:
            guessed, kept = gen.speculation
            speculation = {"speculated_tokens": guessed, "acceptance_rate": round(kept / max(guessed, 1), 3)}
        log.info("request", rid=gen.rid, total_time=round(total, 6), validation_time=round(validation, 6),
                 queue_time=round(queue, 6), inference_time=round(inference, 6),
                 time_per_token=round(inference / max(generated, 1), 6), input_length=gen.input_length,
                 generated_tokens=generated, finish_reason=gen.finish_reason, seed=gen.seed, **speculation)
        if tracing.enabled():
            tracing.record_span("validation", tracing.wall_time(gen.prepared.start_time),
                                tracing.wall_time(gen.timings.queued), attributes={"input_length": gen.input_length})
            tracing.annotate_current(total_time=total, validation_time=validation, queue_time=queue,
                                     inference_time=inference, time_per_token=inference / max(generated, 1),
                                     seed=gen.seed if gen.seed is not None else -1)
        self.version += 1
        adapter = gen.prepared.params.adapter
        self.adapters[adapter] = self.adapters.get(adapter, 0) + 1
        d = self._durations
        d["duration"].observe(total)
        d["validation_duration"].observe(validation)
        d["queue_duration"].observe(queue)
        d["inference_duration"].observe(inference)
        d["mean_time_per_token_duration"].observe(inference / max(generated, 1))
        if self._lengths:
            self._lengths["input_length"].observe(gen.input_length)
            self._lengths["generated_tokens"].observe(generated)
            self._lengths["max_new_tokens"].observe(gen.prepared.max_new_tokens)

    # --- exposition --------------------------------------------------------------------------------

    def snapshot(self, frontend_id: str) -> m.FrontendStats:
        """This frontend's own counts, for the other frontends."""
        histograms = {**self._durations, **self._lengths}
        return m.FrontendStats(frontend_id, self.count, self.success, list(self.failures),
                               list(self.failures.values()), list(histograms),
                               [h.snapshot() for h in histograms.values()], list(self.routes),
                               list(self.routes.values()), list(self.adapters), list(self.adapters.values()))

    def collect(self) -> Iterator:
        total = self.snapshot("")
        for peer in self._peers():
            total = _add(total, peer)
        yield counter("tgi_request_count", "Generation requests received", {(): total.request_count})
        yield counter("tgi_request_success", "Generation requests answered in full", {(): total.request_success})
        yield counter("tgi_request_failure", "Generation requests that failed, by cause",
                      {(label,): n for label, n in sorted(zip(total.failure_labels, total.failure_counts))},
                      ("err",))
        yield counter("llmbus_request_route_count", "Generation requests received, by HTTP route",
                      {(route,): n for route, n in sorted(zip(total.route_names, total.route_counts))}, ("route",))
        yield counter("llmbus_generation_adapter_count",
                      "Generations finished, by the LoRA adapter that computed them (\"\": the base model)",
                      {(name,): n for name, n in sorted(zip(total.adapter_names, total.adapter_counts))}, ("adapter",))
        for name, counts in zip(total.histogram_names, total.histograms):
            unit = " (seconds)" if name.endswith("duration") else ""
            yield histogram(f"tgi_request_{name}", name.replace("_", " ").capitalize() + unit, counts)


def _add(a: m.FrontendStats, b: m.FrontendStats) -> m.FrontendStats:
    failures = _add_counts(a.failure_labels, a.failure_counts, b.failure_labels, b.failure_counts)
    routes = _add_counts(a.route_names, a.route_counts, b.route_names, b.route_counts)
    adapters = _add_counts(a.adapter_names, a.adapter_counts, b.adapter_names, b.adapter_counts)
    histograms = dict(zip(a.histogram_names, a.histograms))
    for name, h in zip(b.histogram_names, b.histograms):
        mine = histograms.get(name)
        if mine is None:
            histograms[name] = h
        elif mine.buckets == h.buckets:  # frontends of one launch share their limits, hence their buckets
            histograms[name] = m.Histogram(mine.buckets, [x + y for x, y in zip(mine.counts, h.counts)],
                                           mine.sum + h.sum)
    return m.FrontendStats(a.frontend_id, a.request_count + b.request_count,
                           a.request_success + b.request_success, list(failures), list(failures.values()),
                           list(histograms), list(histograms.values()), list(routes), list(routes.values()),
                           list(adapters), list(adapters.values()))


def _add_counts(names: list[str], counts: list[int], more_names: list[str], more: list[int]) -> dict[str, int]:
    out = dict(zip(names, counts))
    for name, n in zip(more_names, more):
        out[name] = out.get(name, 0) + n
    return out
