"""OpenTelemetry tracing, on only with ``--otlp-endpoint`` (the ``tracing`` extra).

Spans of one request, all in the client's trace when it sent a W3C ``traceparent`` header:
- the frontend's route span (``generate``, ``generate_stream``, ``chat_completions``, ...), with a
  ``validation`` child;
- per generation, the scheduler's ``queue`` (arrival to admission) and ``inference`` (admission to the
  last token) spans, children of the route span through ``AddRequest.traceparent``.
Spans that describe what already happened are written once it is known, with their real start and end
times, so tracing adds nothing per token. Export is batched on a background thread (OpenTelemetry's
BatchSpanProcessor; ``OTEL_BSP_*`` variables tune it) over OTLP gRPC, as TGI's, or OTLP/HTTP with
``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``. With tracing off nothing here imports OpenTelemetry.
"""

from __future__ import annotations

import os
import time
from typing import Any

EXTRA_HINT = "tracing needs OpenTelemetry: pip install 'llmbus[tracing]'"

_tracer: Any = None  # the process's tracer, once setup() ran with an endpoint
_provider: Any = None


class TracingUnavailable(RuntimeError):
    pass


def available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def setup(endpoint: str | None, service_name: str) -> None:
    """Export this process's spans to ``endpoint`` as ``service_name``; no-op without an endpoint."""
    global _tracer, _provider
    if not endpoint:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingUnavailable(EXTRA_HINT) from None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("llmbus")


def shutdown() -> None:
    """Flush what is buffered (called on the way out)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def tracer():
    return _tracer


def parent_context(traceparent: str | None):
    """The OpenTelemetry context a W3C ``traceparent`` names (None when absent or malformed)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def current_traceparent() -> str:
    """The W3C ``traceparent`` of the current span, for the next process; "" when not tracing."""
    if _tracer is None:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def record_span(name: str, start_wall_s: float, end_wall_s: float, *, parent=None, traceparent: str = "",
                attributes: dict | None = None) -> None:
    """A span for something that already happened, with its real times (``time.time()`` seconds)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    context = parent_context(traceparent) if parent is None else trace.set_span_in_context(parent)
    span = _tracer.start_span(name, context=context, start_time=int(start_wall_s * 1e9),
                              attributes=attributes or {})
    span.end(end_time=int(max(end_wall_s, start_wall_s) * 1e9))


def annotate_current(**attributes) -> None:
    """Attributes on the current span (TGI's timing fields on the route span)."""
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)


def wall_time(monotonic_s: float) -> float:
    """``time.time()`` of a ``time.monotonic()`` reading taken in this process."""
    return time.time() - (time.monotonic() - monotonic_s)
