"""The process plan: one description of a launch that both `llmbus up` and the Procfile render."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from llmbus.bus.service import ENV_JSON_LOGS
from llmbus.supervisor.launcher import ProcessSpec

FRONTEND_ID = "f0"  # frontend i is f<i>


@dataclass
class LaunchConfig:
    """Every setting of a launch, already validated and with defaults resolved."""

    model_dir: str
    model_id: str
    run_dir: str
    world_size: int = 1
    hostname: str = "0.0.0.0"
    port: int = 3000
    dtype: str = "auto"
    device: str = "auto"
    max_input_tokens: int = 2047
    max_total_tokens: int = 2048
    max_batch_prefill_tokens: int = 4096
    prefill_tokens_explicit: bool = False  # False: the scheduler may lower it to the KV capacity
    prefill_chunking: bool = True
    prefix_caching: bool = True
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    cuda_memory_fraction: float = 1.0
    enable_prefill_logprobs: bool = False
    api_key: str | None = None
    cors_allow_origin: tuple[str, ...] = ()
    payload_limit: int = 2_000_000
    graceful_termination_timeout: float = 90.0
    validation_workers: int = 2
    worker_env: dict[str, str] = field(default_factory=dict)  # TRUST_REMOTE_CODE, WATERMARK_GAMMA/DELTA
    scheduler_timeout_s: float = 60.0  # how long the frontend waits for the scheduler's handshake
    runner: str = "model"  # "fake": the workers compute nothing (benchmarks of the stack's own overhead)
    num_frontends: int = 1  # HTTP frontends sharing the port (SO_REUSEPORT) when more than one
    health_check_timeout: float = 10.0
    otlp_endpoint: str | None = None
    otlp_service_name: str = "llmbus"


def build_plan(cfg: LaunchConfig, python: str = sys.executable) -> list[ProcessSpec]:
    common = ["--run-dir", cfg.run_dir]
    scheduler = [python, "-m", "llmbus.scheduler", *common, "--world-size", str(cfg.world_size),
                 "--max-batch-prefill-tokens", str(cfg.max_batch_prefill_tokens),
                 "--max-total-tokens", str(cfg.max_total_tokens),
                 "--prefill-chunking", str(cfg.prefill_chunking).lower(),
                 "--prefix-caching", str(cfg.prefix_caching).lower(),
                 "--waiting-served-ratio", str(cfg.waiting_served_ratio),
                 "--max-waiting-tokens", str(cfg.max_waiting_tokens)]
    if not cfg.prefill_tokens_explicit:
        scheduler.append("--fit-prefill-tokens-to-kv")
    if cfg.max_batch_size is not None:
        scheduler += ["--max-batch-size", str(cfg.max_batch_size)]
    tracing = ["--otlp-endpoint", cfg.otlp_endpoint, "--otlp-service-name", cfg.otlp_service_name] \
        if cfg.otlp_endpoint else []
    scheduler += tracing
    workers = [python, "-m", "llmbus.workers", *common, "--model-dir", cfg.model_dir,
               "--gpus", str(cfg.world_size), "--dtype", cfg.dtype, "--device", cfg.device,
               "--block-size", str(cfg.block_size),
               "--max-batch-prefill-tokens", str(cfg.max_batch_prefill_tokens)]
    if cfg.kv_cache_memory is not None:
        workers += ["--kv-cache-memory", str(cfg.kv_cache_memory)]
    if cfg.runner != "model":
        workers += ["--runner", cfg.runner]
    if cfg.num_blocks is not None:
        workers += ["--num-blocks", str(cfg.num_blocks)]
    if cfg.cuda_memory_fraction != 1.0:
        workers += ["--cuda-memory-fraction", str(cfg.cuda_memory_fraction)]
    frontend = [python, "-m", "llmbus.frontend", *common, "--model-dir", cfg.model_dir,
                "--model-id", cfg.model_id, "--hostname", cfg.hostname, "--port", str(cfg.port),
                "--max-input-tokens", str(cfg.max_input_tokens), "--max-total-tokens", str(cfg.max_total_tokens),
                "--max-concurrent-requests", str(cfg.max_concurrent_requests),
                "--max-best-of", str(cfg.max_best_of), "--max-stop-sequences", str(cfg.max_stop_sequences),
                "--max-top-n-tokens", str(cfg.max_top_n_tokens),
                "--max-client-batch-size", str(cfg.max_client_batch_size)]
    if cfg.enable_prefill_logprobs:
        frontend.append("--enable-prefill-logprobs")
    frontend += ["--payload-limit", str(cfg.payload_limit),
                 "--graceful-termination-timeout", str(cfg.graceful_termination_timeout),
                 "--validation-workers", str(cfg.validation_workers),
                 "--scheduler-timeout", str(cfg.scheduler_timeout_s),
                 "--health-check-timeout", str(cfg.health_check_timeout)]
    for origin in cfg.cors_allow_origin:
        frontend += ["--cors-allow-origin", origin]
    if cfg.num_frontends > 1:
        frontend.append("--reuse-port")
    frontend += tracing
    # the key travels in the environment: a command line is readable by every user of the machine
    frontend_env = {"API_KEY": cfg.api_key} if cfg.api_key else {}
    plan = [
        ProcessSpec("scheduler", scheduler),
        # The scheduler is ready only once every rank is: the group itself has nothing more to say.
        ProcessSpec("workers", workers, reports_ready=False, env=dict(cfg.worker_env)),
    ]
    for i in range(cfg.num_frontends):
        name = "frontend" if cfg.num_frontends == 1 else f"frontend{i}"
        plan.append(ProcessSpec(name, [*frontend, "--frontend-id", f"f{i}", "--service-name", name],
                                ready_after="scheduler", env=frontend_env))
    return plan


def render_procfile(plan: list[ProcessSpec], run_dir: str, *, json_output: bool = False) -> tuple[str, str]:
    """(Procfile, .env) for honcho or foreman: one entry per service of ``plan``, every service's extra
    environment in .env (honcho gives it to all of them; the names do not collide)."""
    lines = ["# Written by `llmbus procfile`; `honcho start` runs it. Each service reaches the others through",
             f"# the run dir {run_dir}; the frontend waits for the scheduler's handshake.",
             *(f"{spec.name}: exec {shlex.join(spec.argv)}" for spec in plan)]
    env = {k: v for spec in plan for k, v in spec.env.items()}
    env["PYTHONUNBUFFERED"] = "1"
    if json_output:
        env[ENV_JSON_LOGS] = "1"
    return "\n".join(lines) + "\n", "".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
