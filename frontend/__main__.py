"""``python -m llmbus.frontend``: run one frontend process.

Endpoints come from ``--requests-endpoint`` / ``--events-endpoint``, or from a launch's run dir
(``--run-dir`` or ``LLMBUS_RUN_DIR``) like every other llmbus service.
"""

from __future__ import annotations

import argparse
import os
import sys

from llmbus.bus.rundir import ENV_RUN_DIR, Endpoints, ensure_run_dir
from llmbus.frontend.app import run_frontend
from llmbus.frontend.config import FrontendConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llmbus.frontend",
                                description="llmbus HTTP frontend (TGI-compatible routes)")
    p.add_argument("--model-dir", required=True, help="local model folder (tokenizer.json, ...)")
    p.add_argument("--model-id", help="name shown in /info (default: the model dir)")
    p.add_argument("--hostname", default="0.0.0.0")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--run-dir", default=os.environ.get(ENV_RUN_DIR),
                   help="the launch's run dir, to derive endpoints from (env LLMBUS_RUN_DIR)")
    p.add_argument("--requests-endpoint", help="the scheduler's requests PULL endpoint")
    p.add_argument("--events-endpoint", help="where this frontend binds its events PULL")
    p.add_argument("--frontend-id", help="unique id of this frontend (no '-')")
    p.add_argument("--max-input-tokens", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-best-of", type=int, default=2)
    p.add_argument("--max-stop-sequences", type=int, default=4)
    p.add_argument("--max-top-n-tokens", type=int, default=5)
    p.add_argument("--enable-prefill-logprobs", action="store_true",
                   help="compute prompt logprobs for decoder_input_details (costs a logits row per prompt token)")
    p.add_argument("--max-client-batch-size", type=int, default=4)
    p.add_argument("--validation-workers", type=int, default=2)
    p.add_argument("--scheduler-timeout", type=float, default=60.0, dest="scheduler_timeout_s",
                   help="seconds to wait for the scheduler's handshake")
    p.add_argument("--payload-limit", type=int, default=2_000_000)
    p.add_argument("--graceful-termination-timeout", type=float, dest="shutdown_timeout_s",
                   default=float(os.environ.get("GRACEFUL_TERMINATION_TIMEOUT", 90.0)),
                   help="seconds in-flight requests get to finish after SIGTERM (new ones get 503)")
    p.add_argument("--api-key", default=os.environ.get("API_KEY"))
    p.add_argument("--cors-allow-origin", action="append", default=[],
                   help="an origin browsers may call from (repeat for several; default: any)")
    p.add_argument("--model-pipeline-tag")
    p.add_argument("--health-check-timeout", type=float, dest="health_check_timeout_s",
                   default=float(os.environ.get("HEALTH_CHECK_TIMEOUT", 10.0)),
                   help="seconds /health waits for every worker rank to answer a probe")
    p.add_argument("--service-name", default="frontend",
                   help="this process's name in logs and readiness (several frontends: frontend0, frontend1...)")
    p.add_argument("--otlp-endpoint", default=os.environ.get("OTLP_ENDPOINT"),
                   help="export OpenTelemetry spans to this OTLP endpoint (the tracing extra)")
    p.add_argument("--otlp-service-name", default=os.environ.get("OTLP_SERVICE_NAME", "llmbus"))
    p.add_argument("--reuse-port", action="store_true",
                   help="share --port with other frontends of the same engine (SO_REUSEPORT)")
    return p


def from_args(argv: list[str] | None = None) -> tuple[FrontendConfig, str]:
    """The config and the service name."""
    parser = build_parser()
    a = parser.parse_args(argv)
    extra = {}
    if a.frontend_id:
        extra["frontend_id"] = a.frontend_id
    requests, events = a.requests_endpoint, a.events_endpoint
    if a.run_dir:
        ensure_run_dir(a.run_dir)
        endpoints = Endpoints.in_dir(a.run_dir)
        requests = requests or endpoints.requests
        if events is None:
            fid = a.frontend_id or FrontendConfig.__dataclass_fields__["frontend_id"].default_factory()
            extra["frontend_id"] = fid
            events = endpoints.frontend_events(a.run_dir, fid)
    if not requests or not events:
        parser.error("give --requests-endpoint and --events-endpoint, or --run-dir")
    try:
        return FrontendConfig(
            model_dir=a.model_dir, model_id=a.model_id, hostname=a.hostname, port=a.port,
            requests_endpoint=requests, events_endpoint=events, max_input_tokens=a.max_input_tokens,
            max_total_tokens=a.max_total_tokens, max_concurrent_requests=a.max_concurrent_requests,
            max_best_of=a.max_best_of, max_stop_sequences=a.max_stop_sequences,
            max_top_n_tokens=a.max_top_n_tokens, max_client_batch_size=a.max_client_batch_size,
            enable_prefill_logprobs=a.enable_prefill_logprobs,
            validation_workers=a.validation_workers, scheduler_timeout_s=a.scheduler_timeout_s,
            payload_limit=a.payload_limit, api_key=a.api_key, model_pipeline_tag=a.model_pipeline_tag,
            cors_allow_origin=a.cors_allow_origin, shutdown_timeout_s=a.shutdown_timeout_s,
            health_check_timeout_s=a.health_check_timeout_s, reuse_port=a.reuse_port,
            otlp_endpoint=a.otlp_endpoint, otlp_service_name=a.otlp_service_name, **extra), a.service_name
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    config, service_name = from_args(argv)
    return run_frontend(config, service_name)


if __name__ == "__main__":
    sys.exit(main())
