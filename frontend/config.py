"""The frontend's settings: one dataclass, validated on construction.

Token limits may be left unset: they are resolved after the scheduler handshake (see ``resolve_limits``)
from the model's maximum length and the KV capacity the scheduler reports, as TGI does after warmup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _default_frontend_id() -> str:
    return f"fe{os.getpid()}"


def _default_compute_type() -> str:
    return os.environ.get("COMPUTE_TYPE", "gpu+optimized")


@dataclass
class FrontendConfig:
    model_dir: str  # local Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json
    requests_endpoint: str  # the scheduler's PULL (AddRequest / AbortRequest / FrontendHello)
    events_endpoint: str  # this frontend binds a PULL here; the scheduler PUSHes TokenBatch & co.
    model_id: str | None = None  # shown in /info; defaults to model_dir
    hostname: str = "0.0.0.0"
    port: int = 3000
    frontend_id: str = field(default_factory=_default_frontend_id)  # rid prefix; unique per frontend
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: min(model max length, scheduler's max_batch_total_tokens)
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    enable_prefill_logprobs: bool = False  # decoder_input_details returns prompt logprobs (TGI >= 3: opt-in)
    scheduler_timeout_s: float = 60.0  # FrontendHello -> SchedulerHello handshake
    keepalive_s: float = 15.0  # SSE comment `:` after this long without an event
    payload_limit: int = 2_000_000  # bytes of request body (TGI --payload-limit)
    validation_workers: int = 2  # threads that tokenize long prompts off the event loop
    api_key: str | None = None  # Bearer token required on the generation routes (TGI --api-key)
    cors_allow_origin: list[str] = field(default_factory=list)  # empty: any origin (as TGI)
    model_pipeline_tag: str | None = None  # /info; decides POST / return_full_text default like TGI
    compute_type: str = field(default_factory=_default_compute_type)  # x-compute-type header
    shutdown_timeout_s: float = 90.0  # how long in-flight requests may finish after SIGTERM (TGI's default)
    # /health waits this long for every rank to answer a probe (a rank answers after the step it computes)
    health_check_timeout_s: float = 10.0
    reuse_port: bool = False  # several frontends share one port (SO_REUSEPORT; the kernel spreads connections)
    otlp_endpoint: str | None = None  # export OpenTelemetry spans there (bus/tracing.py)
    otlp_service_name: str = "llmbus"

    def __post_init__(self) -> None:
        if self.model_id is None:
            self.model_id = self.model_dir
        problems = []
        if not (0 <= self.port <= 65535):
            problems.append(f"`port` must be in 0..65535. Given: {self.port}")
        for name in ("max_concurrent_requests", "max_best_of", "max_client_batch_size", "validation_workers"):
            if getattr(self, name) < 1:
                problems.append(f"`{name}` must be > 0")
        if not self.health_check_timeout_s > 0:
            problems.append(f"`health_check_timeout_s` must be > 0. Given: {self.health_check_timeout_s}")
        for name in ("max_stop_sequences", "max_top_n_tokens"):
            if getattr(self, name) < 0:
                problems.append(f"`{name}` must be >= 0")
        for name in ("max_input_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"`{name}` must be > 0")
        if (self.max_input_tokens is not None and self.max_total_tokens is not None
                and self.max_input_tokens >= self.max_total_tokens):
            problems.append(f"`max_input_tokens`({self.max_input_tokens}) must be < "
                            f"`max_total_tokens`({self.max_total_tokens})")
        if self.scheduler_timeout_s <= 0 or self.keepalive_s <= 0:
            problems.append("`scheduler_timeout_s` and `keepalive_s` must be > 0")
        if not self.frontend_id or "-" in self.frontend_id:
            # rids are f"{frontend_id}-{n}": a dash in the id would make the prefix ambiguous
            problems.append(f"`frontend_id` must be non-empty and contain no '-'. Given: {self.frontend_id!r}")
        if problems:
            raise ValueError("Invalid argument: " + "; ".join(problems))

    @property
    def url(self) -> str:
        return f"http://{self.hostname}:{self.port}"


@dataclass(frozen=True)
class Limits:
    """The limits validation works with, fixed once the scheduler has answered."""

    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int


DEFAULT_MAX_TOTAL_TOKENS = 4096  # when neither the config nor the model says


def resolve_limits(config: FrontendConfig, model_max_length: int | None,
                   max_batch_total_tokens: int) -> Limits:
    """Fill unset token limits like TGI after warmup; reject settings the engine cannot serve."""
    total = config.max_total_tokens
    if total is None:
        total = model_max_length or DEFAULT_MAX_TOTAL_TOKENS
        if max_batch_total_tokens > 0:
            total = min(total, max_batch_total_tokens)
    elif max_batch_total_tokens > 0 and total > max_batch_total_tokens:
        raise ValueError(f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
                         f"Given: {total} and {max_batch_total_tokens}")
    max_input = config.max_input_tokens if config.max_input_tokens is not None else max(total - 1, 1)
    if max_input >= total:
        raise ValueError(f"`max_input_tokens` must be < `max_total_tokens`. Given: {max_input} and {total}")
    return Limits(max_input_tokens=max_input, max_total_tokens=total, max_best_of=config.max_best_of,
                  max_stop_sequences=config.max_stop_sequences, max_top_n_tokens=config.max_top_n_tokens)
