"""The scheduler's settings (``llmbus scheduler``'s command line, and what ``llmbus up`` passes it): one
definition per setting (``bus/settings.py``), kept apart from the process so the supervisor reads them
without loading the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.bus.restarts import RESTART_WINDOW_S
from llmbus.bus.rundir import ENV_RUN_DIR, Endpoints
from llmbus.bus.settings import ServiceSettings, setting
from llmbus.bus.shared_settings import PREFILL_TOKENS_HELP
from llmbus.scheduler.policy import SchedulerConfig

# The default step deadline: this floor (first steps after a start, an odd slow step) plus this many times
# what the warmup measured for the step's tokens.
STEP_TIMEOUT_FLOOR_S = 30.0
STEP_TIMEOUT_WARMUP_FACTOR = 10.0
_POLICY = SchedulerConfig()  # the policy owns its defaults; the command line offers the same ones


def default_steps_ahead(device: str) -> int:
    """--steps-ahead when not given, for ranks on ``device`` (their WorkerReady's, e.g. "cuda:0"). On a GPU a
    decode step can be shorter than the scheduler's turnaround plus the rank's launch, so the rank gets its
    next command before the last result is back (an H100 serving c=64, benchmarks/gpu_check.py part 3: the
    device idle 15.4% of the time with 1, 5.4% with 2, and 1.5x the tokens/s). On CPU the forward pass is the
    step and one ahead already hides the turnaround."""
    return 2 if device.startswith("cuda") else 1


@dataclass
class SchedulerProcessConfig(ServiceSettings):
    run_dir: str = setting(help="the launch's run dir (its ipc sockets)", env=ENV_RUN_DIR, user=False)
    world_size: int = setting(1, help="worker ranks to wait for", user=False)
    max_batch_prefill_tokens: int | None = setting(None, env="MAX_BATCH_PREFILL_TOKENS", ge=1,
                                                    help=PREFILL_TOKENS_HELP)
    fit_prefill_tokens_to_kv: bool = setting(
        False, user=False, help="lower --max-batch-prefill-tokens to the KV capacity instead of failing")
    fit_total_tokens_to_kv: bool = setting(
        False, user=False, help="lower --max-total-tokens to the KV capacity instead of failing (it was not given: "
                                "TGI's default is the smaller of the model's length and what the KV cache holds)")
    max_batch_size: int | None = setting(None, env="MAX_BATCH_SIZE", ge=1, help="Most requests in one batch.")
    # checked against the KV capacity the ranks report
    max_total_tokens: int | None = setting(
        None, env="MAX_TOTAL_TOKENS", ge=1,
        help="Prompt + generated tokens per request. Default: the model's max_position_embeddings, or what the "
             "KV cache holds if that is less (as TGI).")
    prefill_chunking: bool = setting(_POLICY.prefill_chunking, env="PREFILL_CHUNKING",
                                     help="Split long prompts over steps that also carry the running requests' "
                                          "decodes.")
    prefix_caching: bool = setting(True, env="PREFIX_CACHING", help="Reuse the KV blocks of prompt prefixes "
                                                                     "computed before.")
    waiting_served_ratio: float = setting(_POLICY.waiting_served_ratio, env="WAITING_SERVED_RATIO", ge=0,
                                          help="Without chunking: admit while a batch runs only when this many x "
                                               "its size wait.")
    max_waiting_tokens: int = setting(_POLICY.max_waiting_tokens, env="MAX_WAITING_TOKENS", ge=0,
                                      help="Without chunking: ... or once this many steps passed without admitting "
                                           "anyone.")
    worker_start_timeout_s: float = setting(600.0, flag="--worker-start-timeout", user=False,
                                            help="seconds the ranks may take to load and warm up")
    otlp_endpoint: str | None = setting(None, env="OTLP_ENDPOINT",
                                        help="Export OpenTelemetry spans of every request to this OTLP endpoint "
                                             "(gRPC, e.g. http://localhost:4317; OTEL_EXPORTER_OTLP_PROTOCOL="
                                             "http/protobuf for OTLP/HTTP). Needs the tracing extra.")
    otlp_service_name: str = setting("llmbus", env="OTLP_SERVICE_NAME",
                                     help="Spans come from <name>.frontend and <name>.scheduler.")
    speculate: int = setting(
        0, env="SPECULATE", ge=0,
        help="Guess this many tokens per decode step from the request's own prompt and output (n-gram prompt "
             "lookup) and verify them in the same forward pass: several tokens per step where the output "
             "repeats its input, the same output. 0: off.")
    speculate_max_batch: int = setting(
        _POLICY.speculate_max_batch, env="SPECULATE_MAX_BATCH", ge=0,
        help="Speculate only in steps with at most this many decoding requests (beyond that a step is "
             "compute-bound and guesses cost more than they save).")
    speculate_method: str = setting("ngram", choices=("ngram", "draft"), user=False,
                                    help="where guesses come from: n-gram lookup, or the ranks' draft model")
    step_timeout_s: float | None = setting(
        None, flag="--step-timeout", env="STEP_TIMEOUT", gt=0,
        help=f"Seconds one step may take before its ranks count as hung (and are restarted, see --max-restarts). "
             f"Default: {STEP_TIMEOUT_FLOOR_S:g} s plus {STEP_TIMEOUT_WARMUP_FACTOR:g}x the warmup's time per "
             f"token for the step's tokens.")
    disable_overlap: bool = setting(
        False, env="DISABLE_OVERLAP",
        help="Schedule each step only once the last one's tokens are back (lock-step), so the ranks wait for "
             "the scheduler between steps; by default the next step is sent while one computes. For debugging "
             "and measuring.")
    steps_ahead: int | None = setting(
        None, ge=1, le=2, hidden=True,
        help="With overlap, how many steps are sent past the one whose result is awaited: 2 hands the ranks their "
             "next command before the last result reaches the scheduler, so its turnaround leaves the device's "
             "path. Default: 2 where the ranks run on a GPU, 1 on CPU (where the forward pass, not the "
             "turnaround, is the step).")
    max_restarts: int = setting(
        3, env="MAX_RESTARTS", ge=0,
        help=f"Restart worker ranks that crashed or hung, resuming every request where it was, at most this many "
             f"times in {RESTART_WINDOW_S:g} s (also a dead frontend, with --num-frontends > 1). 0: a worker "
             f"failure stops the server, as TGI's does.")

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints.in_dir(self.run_dir)
