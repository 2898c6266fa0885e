"""TGI's per-request metrics (``tgi_request_*``) and per-request log line, kept by the frontend that
answers the requests.

Each HTTP generation request counts once in ``tgi_request_count`` and ends as a success or as a failure
labelled ``err`` (``validation``, ``overloaded``, ``generation``, ``incomplete``, ``template``,
``dropped`` for a client that left). Each generation that finishes (one per request; ``best_of`` and
``n`` make several) adds one observation to the histograms, with TGI's buckets: 35 geometric ones from
0.15 ms for durations, 100 linear ones up to the token limits for lengths.

Plain counters and bucket arrays, updated with a few additions per finished generation; the collector
turns them into metric families only when ``/metrics`` is scraped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import structlog
from prometheus_client.registry import Collector

from llmbus.frontend.errors import ErrorKind
from llmbus.frontend.metrics import counter, histogram
# the same counts-per-bucket histograms (and TGI's duration buckets) as the scheduler's step metrics
from llmbus.scheduler.batch_metrics import DURATION_BUCKETS, HistogramCounts

if TYPE_CHECKING:
    from llmbus.frontend.generation import Generation

log = structlog.get_logger("llmbus.frontend")

# TGI's err label for each error kind a request can end with
FAILURE_LABELS = {
    ErrorKind.VALIDATION: "validation", ErrorKind.BODY: "validation", ErrorKind.PAYLOAD_TOO_LARGE: "validation",
    ErrorKind.BATCH_SIZE: "validation", ErrorKind.SUFFIX: "validation", ErrorKind.TOOL: "validation",
    ErrorKind.OVERLOADED: "overloaded", ErrorKind.GENERATION: "generation", ErrorKind.INCOMPLETE: "incomplete",
    ErrorKind.INCOMPLETE_STREAM: "incomplete", ErrorKind.TEMPLATE: "template",
    ErrorKind.SHUTTING_DOWN: "shutdown",
}
DROPPED = "dropped"


def failure_label(kind: ErrorKind) -> str:
    return FAILURE_LABELS.get(kind, "generation")


def linear_buckets(limit: int, count: int = 100) -> list[float]:
    step = max(limit / count, 1.0)
    return [step * (i + 1) for i in range(count)]


class RequestMetrics(Collector):
    def __init__(self) -> None:
        self.count = 0
        self.success = 0
        self.failures: dict[str, int] = {}
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

    def started(self) -> None:
        self.count += 1

    def succeeded(self) -> None:
        self.success += 1

    def failed(self, label: str) -> None:
        self.failures[label] = self.failures.get(label, 0) + 1

    def generation_finished(self, gen: "Generation") -> None:
        """Observe a finished generation, and log it as TGI logs each request it answered."""
        generated = len(gen.tokens)
        total, validation, queue, inference = gen.timings.split(gen.prepared.start_time)
        log.info("request", rid=gen.rid, total_time=round(total, 6), validation_time=round(validation, 6),
                 queue_time=round(queue, 6), inference_time=round(inference, 6),
                 time_per_token=round(inference / max(generated, 1), 6), input_length=gen.input_length,
                 generated_tokens=generated, finish_reason=gen.finish_reason, seed=gen.seed)
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

    def collect(self) -> Iterator:
        yield counter("tgi_request_count", "Generation requests received", {(): self.count})
        yield counter("tgi_request_success", "Generation requests answered in full", {(): self.success})
        yield counter("tgi_request_failure", "Generation requests that failed, by cause",
                      {(label,): n for label, n in sorted(self.failures.items())}, ("err",))
        for name, buckets in {**self._durations, **self._lengths}.items():
            unit = " (seconds)" if name.endswith("duration") else ""
            yield histogram(f"tgi_request_{name}", name.replace("_", " ").capitalize() + unit,
                            buckets.snapshot())
