"""--otlp-endpoint: a request's spans reach an OTLP collector from the frontend and the scheduler, in the
client's trace (W3C traceparent), nested route span -> validation / queue / inference."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest

from llmbus.testing import Server, free_port
from llmbus.testing.http import post

grpc = pytest.importorskip("grpc")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector(trace_service_grpc.TraceServiceServicer):
    """An OTLP gRPC trace receiver: every exported span, with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.cond = threading.Condition()

    def Export(self, request, context):  # the gRPC method's name
        with self.cond:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)
            self.cond.notify_all()
        return trace_service.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 30):
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.spans), timeout), \
                [(s, span.name) for s, span in self.spans]


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = Collector()
    trace_service_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_spans_of_a_request_across_frontend_and_scheduler(tiny_model_dir, collector):
    receiver, endpoint = collector
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "256",
                  "--num-blocks", "64", "--otlp-endpoint", endpoint, "--otlp-service-name", "svc"],
                 env={"OTEL_BSP_SCHEDULE_DELAY": "50"})  # export within 50 ms, not OpenTelemetry's 5 s
    try:
        status, _, body = post(f"{srv.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                               headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert status == 200, body
        untraced_at = time.time()
        assert post(f"{srv.url}/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})[0] == 200
        ours = lambda spans: [(s, span) for s, span in spans if span.trace_id.hex() == TRACE_ID]  # noqa: E731
        receiver.wait_for(lambda spans: {span.name for _, span in ours(spans)} >=
                          {"generate", "validation", "queue", "inference"})
        # the untraced request starts a trace of its own
        receiver.wait_for(lambda spans: any(span.name == "generate" and span.trace_id.hex() != TRACE_ID and
                                            span.start_time_unix_nano >= untraced_at * 1e9 - 1e9
                                            for _, span in spans))
    finally:
        srv.stop()
    spans = {span.name: (service, span) for service, span in ours(receiver.spans)}
    service, route = spans["generate"]
    assert service == "svc.frontend" and route.parent_span_id.hex() == CLIENT_SPAN
    attributes = {a.key: a.value for a in route.attributes}
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["inference_time"].double_value > 0 and "queue_time" in attributes
    assert spans["validation"][0] == "svc.frontend" and spans["validation"][1].parent_span_id == route.span_id
    for name in ("queue", "inference"):
        service, span = spans[name]
        assert service == "svc.scheduler" and span.parent_span_id == route.span_id, name
        assert route.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
    assert spans["queue"][1].end_time_unix_nano <= spans["inference"][1].start_time_unix_nano
    inference = {a.key: a.value for a in spans["inference"][1].attributes}
    assert inference["generated_tokens"].int_value == 4 and inference["finish_reason"].string_value == "length"
