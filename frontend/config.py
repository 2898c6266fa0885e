"""The frontend's settings: one dataclass; each setting's bounds are on its declaration, the rules across
settings in ``validate``, and both hold from construction on.

Token limits may be left unset: they are resolved after the scheduler handshake (see ``resolve_limits``)
from the model's maximum length and the KV capacity the scheduler reports, as TGI does after warmup.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmbus.bus.settings import ServiceSettings, a_folder, setting
from llmbus.bus.shared_settings import QUANTIZE_CHOICES
from llmbus.frontend.tool_formats import TOOL_CALL_PARSERS

# --generation-config's words: the model's file, or none (vLLM's word for that, "vllm", means the same)
GENERATION_CONFIG_MODES = ("auto", "none", "vllm")


def _default_frontend_id() -> str:
    return f"fe{os.getpid()}"


def _default_compute_type() -> str:
    return os.environ.get("COMPUTE_TYPE", "gpu+optimized")


def _frontend_id_problem(value: str) -> str | None:
    # rids are f"{frontend_id}-{n}": a dash in the id would make the prefix ambiguous
    return None if value and "-" not in value else f"must be non-empty and contain no '-'. Given: {value!r}"


def _route_problem(value: str | None) -> str | None:
    return None if value is None or value.startswith("/") else f"must be a path starting with /. Given: {value}"


def _generation_config_problem(value: str) -> str | None:
    if value in GENERATION_CONFIG_MODES or (Path(value).expanduser() / "generation_config.json").is_file():
        return None
    return f"must be auto, none or a folder holding a generation_config.json. Given: {value}"


def _tokenizer_config_problem(value: str) -> str | None:
    try:
        data = json.loads(Path(value).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"must name a readable tokenizer_config.json: {e}"
    return None if isinstance(data, dict) else f"must hold a JSON object. Given: {value}"


def input_total_problem(max_input_tokens: int, max_total_tokens: int) -> str | None:
    """TGI's launcher rule on the two token limits (the frontend's, and `llmbus up`'s once resolved)."""
    if max_input_tokens >= max_total_tokens:
        return f"`max_input_tokens`({max_input_tokens}) must be < `max_total_tokens`({max_total_tokens})"
    return None


@dataclass
class FrontendConfig(ServiceSettings):
    # local Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json
    model_dir: str = setting(help="local model folder (tokenizer.json, ...)", user=False, check=a_folder)
    # the scheduler's PULL (AddRequest / AbortRequest / FrontendHello); default: from --run-dir
    requests_endpoint: str | None = setting(None, help="the scheduler's requests PULL endpoint", user=False)
    # this frontend binds a PULL here; the scheduler PUSHes TokenBatch & co.; default: from --run-dir
    events_endpoint: str | None = setting(None, help="where this frontend binds its events PULL", user=False)
    model_id: str | None = setting(None, help="name shown in /info (default: the model dir)", user=False)
    hostname: str = setting("0.0.0.0", env="HOSTNAME", help="Address to listen on.")
    # 0: any free port (the ready message says which); `llmbus up` wants one its frontends can share
    port: int = setting(3000, env="PORT", aliases=("-p",), ge=0, le=65535, help="Port to listen on.")
    # Google Vertex AI's container contract (TGI reads these in its `google` build): the port, and the paths
    # of the prediction (frontend/vertex.py) and health routes, set by Vertex in the container's environment
    aip_http_port: int | None = setting(None, env="AIP_HTTP_PORT", ge=1, le=65535, hidden=True,
                                        help="Vertex AI's port: listen here instead of --port.")
    aip_predict_route: str | None = setting(None, env="AIP_PREDICT_ROUTE", hidden=True, check=_route_problem,
                                            help="Vertex AI's prediction path: serves /vertex there too.")
    aip_health_route: str | None = setting(None, env="AIP_HEALTH_ROUTE", hidden=True, check=_route_problem,
                                           help="Vertex AI's health path: serves /health there too.")
    # rid prefix; unique per frontend
    frontend_id: str = setting(help="unique id of this frontend (no '-')", user=False,
                               check=_frontend_id_problem, default_factory=_default_frontend_id)
    max_input_tokens: int | None = setting(None, env="MAX_INPUT_TOKENS", ge=1, help="Default: max_total_tokens - 1.")
    max_total_tokens: int | None = setting(  # None: min(model max length, scheduler's max_batch_total_tokens)
        None, env="MAX_TOTAL_TOKENS", ge=1,
        help="Prompt + generated tokens per request. Default: the model's max_position_embeddings, or what the "
             "KV cache holds if that is less (as TGI).")
    fit_total_tokens_to_kv: bool = setting(
        False, user=False, help="lower --max-total-tokens to the scheduler's KV capacity instead of failing (the "
                                "launch's default, not the user's)")
    max_concurrent_requests: int = setting(128, env="MAX_CONCURRENT_REQUESTS", ge=1,
                                           help="Requests in flight before new ones get 429 (with several "
                                                "frontends, each admits its share).")
    frontends_sharing: int = setting(1, user=False, ge=1,
                                     help="frontends of the launch, which share --max-concurrent-requests")
    max_best_of: int = setting(2, env="MAX_BEST_OF", ge=1,
                               help="Largest best_of a request may ask for (OpenAI's n: --max-client-batch-size).")
    max_stop_sequences: int = setting(4, env="MAX_STOP_SEQUENCES", ge=0, help="Most stop sequences per request.")
    max_top_n_tokens: int = setting(5, env="MAX_TOP_N_TOKENS", ge=0, help="Largest top_n_tokens per request.")
    max_client_batch_size: int = setting(4, env="MAX_CLIENT_BATCH_SIZE", ge=1,
                                         help="Prompts per /v1/completions request, and n.")
    # decoder_input_details returns prompt logprobs (TGI >= 3: opt-in)
    enable_prefill_logprobs: bool = setting(False, env="REQUEST_LOGPROBS",
                                            help="Return prompt-token logprobs for decoder_input_details (off by "
                                                 "default, as in TGI 3).")
    scheduler_timeout_s: float = setting(60.0, flag="--scheduler-timeout", user=False, gt=0,
                                         help="seconds to wait for the scheduler's handshake")
    payload_limit: int = setting(2_000_000, env="PAYLOAD_LIMIT", ge=1,
                                 help="Largest request body in bytes; larger ones get 413.")
    # TGI's router flag: an http(s) image is read up to this size and refused past it (frontend/images.py)
    max_image_fetch_size: int = setting(1 << 30, env="MAX_IMAGE_FETCH_SIZE", ge=0,
                                        help="Largest image in bytes a vision model's prompt may fetch from an "
                                             "http(s) URL; a larger one gets 422.")
    # vLLM's flag: a server open to the internet fetches only from these hosts, not from its own network
    allowed_media_domains: list[str] = setting(env="ALLOWED_MEDIA_DOMAINS", default_factory=list,
                                               help="A host a vision model's prompt may fetch images from (repeat "
                                                    "for several; redirects are checked too). Default: any.")
    validation_workers: int = setting(2, env="VALIDATION_WORKERS", ge=1,
                                      help="Threads that tokenize long prompts and decode images.")
    api_key: str | None = setting(None, env="API_KEY", secret=True,
                                  help="Require `Authorization: Bearer <key>` on the generation routes.")
    cors_allow_origin: list[str] = setting(env="CORS_ALLOW_ORIGIN", default_factory=list,
                                           help="An origin browsers may call from (repeat for several). "
                                                "Default: any.")
    model_pipeline_tag: str | None = setting(None, user=False,
                                             help="/info's pipeline tag; decides POST / return_full_text as TGI")
    # how long in-flight requests may finish after SIGTERM (TGI's default)
    shutdown_timeout_s: float = setting(90.0, flag="--graceful-termination-timeout",
                                        env="GRACEFUL_TERMINATION_TIMEOUT", ge=0,
                                        help="Seconds in-flight requests get to finish on SIGTERM.")
    # /health waits this long for every rank to answer a probe (a rank answers after the step it computes)
    scheduler_hang_timeout_s: float = setting(
        10.0, flag="--scheduler-hang-timeout", env="LLMBUS_SCHEDULER_HANG_TIMEOUT", gt=0, hidden=True,
        help="Seconds a scheduler whose process still runs may send nothing before the frontend fails the "
             "requests in flight as hung (one whose process is gone: after 1 s).")
    health_check_timeout_s: float = setting(10.0, flag="--health-check-timeout", env="HEALTH_CHECK_TIMEOUT", gt=0,
                                            help="Seconds /health waits for every worker rank to answer a probe "
                                                 "before answering 503.")
    # several frontends share one port (SO_REUSEPORT; the kernel spreads connections)
    reuse_port: bool = setting(False, user=False,
                               help="share --port with other frontends of the same engine (SO_REUSEPORT)")
    otlp_endpoint: str | None = setting(None, env="OTLP_ENDPOINT",
                                        help="export OpenTelemetry spans to this OTLP endpoint (the tracing extra)")
    otlp_service_name: str = setting("llmbus", env="OTLP_SERVICE_NAME", help="OpenTelemetry service name prefix")
    # declared as the workers declare it: `llmbus up --quantize` (or QUANTIZE) reaches both
    quantize: str | None = setting(None, env="QUANTIZE", choices=QUANTIZE_CHOICES,
                                   help="The workers' --quantize, reported in /info.")
    disable_grammar_support: bool = setting(False, env="DISABLE_GRAMMAR_SUPPORT",
                                            help="Refuse `grammar`, `response_format` and `tools` (422 `grammar is "
                                                 "not supported`), as TGI does with this flag.")
    # tool arguments and json_schema outputs hold to what their schema declares (frontend/strict_schema.py),
    # as vLLM's default grammar backend does: small models otherwise invent keys
    disable_strict_schemas: bool = setting(False, env="DISABLE_STRICT_SCHEMAS",
                                           help="Compile tool parameters and `json_schema` outputs as JSON "
                                                "Schema does: objects allow undeclared properties and tuples "
                                                "extra items unless the schema says otherwise (default: only "
                                                "what the schema declares, unless it opts in to more).")
    # the syntax tool calls are parsed and constrained in (frontend/tool_formats.py); vLLM's flag name
    tool_call_parser: str = setting("auto", env="TOOL_CALL_PARSER", choices=TOOL_CALL_PARSERS,
                                    help="The tool-call syntax: `auto` reads it from the chat template's "
                                         "markers (Hermes when it shows none); or name one.")
    # /v1/responses with `store` (OpenAI's default) keeps this many responses for previous_response_id and
    # GET/DELETE /v1/responses/{id}; in this process's memory only (frontend/responses_store.py)
    responses_store_size: int = setting(1000, env="RESPONSES_STORE_SIZE", ge=0,
                                        help="Responses /v1/responses keeps in memory for previous_response_id "
                                             "(least recently used dropped first; 0: none). Per frontend "
                                             "process, lost on restart.")
    # What a request that leaves a sampling parameter unset gets (frontend/sampling_defaults.py): a flag,
    # else the model's generation_config.json, else the API's own default. Only requests that sample.
    generation_config: str = setting(
        "auto", check=_generation_config_problem,
        help="Sampling defaults for requests that leave temperature, top_k, top_p, min_p or repetition_penalty "
             "unset: `auto` reads the model's generation_config.json (as vLLM does), `none` ignores it, or a "
             "folder holding one. The --default-* flags override it; a request's own value always wins.")
    tokenizer_config_path: str | None = setting(
        None, env="TOKENIZER_CONFIG_PATH", check=_tokenizer_config_problem,
        help="A tokenizer_config.json whose chat_template (and the special tokens it names) the chat routes use "
             "in place of the model's, as TGI's flag does; the model's own template where it has none.")
    default_temperature: float | None = setting(
        None, ge=0, help="Temperature of requests that sample and set none (over generation_config.json). "
                         "It also sets the OpenAI routes' default decoding: 0 is greedy unless a request "
                         "sets a temperature or a warper, above 0 samples.")
    default_top_k: int | None = setting(None, ge=0, help="top_k of requests that sample and set none "
                                                         "(0: off).")
    default_top_p: float | None = setting(None, gt=0, le=1, help="top_p of requests that sample and set none "
                                                                 "(1: off).")
    default_min_p: float | None = setting(None, ge=0, le=1, help="min_p of requests that sample and set none "
                                                                 "(0: off).")
    default_repetition_penalty: float | None = setting(None, gt=0, help="repetition_penalty of requests that "
                                                                        "sample and set none (1: off).")
    keepalive_s: float = 15.0  # SSE comment `:` after this long without an event
    compute_type: str = field(default_factory=_default_compute_type)  # x-compute-type header

    def __post_init__(self) -> None:
        if self.model_id is None:
            self.model_id = self.model_dir
        if self.aip_http_port is not None:  # Vertex's port wins over --port, as in TGI's google build
            self.port = self.aip_http_port
        if self.generation_config == "vllm":
            self.generation_config = "none"
        elif self.generation_config not in GENERATION_CONFIG_MODES:  # a folder: the same for every process
            self.generation_config = str(Path(self.generation_config).expanduser().resolve())
        if self.tokenizer_config_path:  # a Procfile's services may start elsewhere than where it was given
            self.tokenizer_config_path = str(Path(self.tokenizer_config_path).expanduser().resolve())
        super().__post_init__()

    def validate(self) -> list[str]:
        problems = []
        if not self.requests_endpoint or not self.events_endpoint:
            problems.append("give --requests-endpoint and --events-endpoint, or --run-dir")
        if self.max_input_tokens is not None and self.max_total_tokens is not None:
            problems.append(input_total_problem(self.max_input_tokens, self.max_total_tokens))
        if not self.keepalive_s > 0:
            problems.append(f"`keepalive_s` must be > 0. Given: {self.keepalive_s}")
        return [p for p in problems if p is not None]

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
    grammar_support: bool = True  # False: --disable-grammar-support
    strict_schemas: bool = True  # False: --disable-strict-schemas


DEFAULT_MAX_TOTAL_TOKENS = 4096  # when neither the config nor the model says


def resolve_limits(config: FrontendConfig, model_max_length: int | None,
                   max_batch_total_tokens: int) -> Limits:
    """Fill unset token limits like TGI after warmup; reject settings the engine cannot serve."""
    total = config.max_total_tokens
    if total is None:
        total = model_max_length or DEFAULT_MAX_TOTAL_TOKENS
        if max_batch_total_tokens > 0:
            total = min(total, max_batch_total_tokens)
    elif max_batch_total_tokens > 0 and total > max_batch_total_tokens and config.fit_total_tokens_to_kv:
        total = max_batch_total_tokens  # the scheduler lowered its own the same way
    elif max_batch_total_tokens > 0 and total > max_batch_total_tokens:
        raise ValueError(f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
                         f"Given: {total} and {max_batch_total_tokens}")
    max_input = config.max_input_tokens if config.max_input_tokens is not None else max(total - 1, 1)
    if max_input >= total:
        raise ValueError(f"`max_input_tokens` must be < `max_total_tokens`. Given: {max_input} and {total}")
    return Limits(max_input_tokens=max_input, max_total_tokens=total, max_best_of=config.max_best_of,
                  max_stop_sequences=config.max_stop_sequences, max_top_n_tokens=config.max_top_n_tokens,
                  grammar_support=not config.disable_grammar_support,
                  strict_schemas=not config.disable_strict_schemas)
