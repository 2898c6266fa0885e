"""One definition per setting: every `llmbus up` flag reaches the services that declare it, and only them;
a rendered Procfile gives each service the same settings as `llmbus up`; each service's settings survive
their own command line."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmbus.bus.service import ENV_JSON_LOGS
from llmbus.bus.settings import SettingsError, declared
from llmbus.frontend.__main__ import from_args as frontend_from_args
from llmbus.frontend.config import FrontendConfig
from llmbus.scheduler.config import SchedulerProcessConfig
from llmbus.supervisor import cli, weights
from llmbus.supervisor.plan import build_plan
from llmbus.supervisor.settings import SERVICES
from llmbus.workers.placement import default_block_size
from llmbus.workers.process import WorkerConfig

RUN_DIR = "/tmp/llmbus-settings-test"
TOKENIZER_CONFIG = str(Path(__file__).parents[1] / "fixtures" / "tokenizer_config.json")
# Values that pass every cross-flag rule (the model's 256 positions, input < total, ...).
SPECIAL = {"max_total_tokens": 200, "max_input_tokens": 100, "max_batch_prefill_tokens": 300,
           "port": 3456, "hostname": "127.0.0.2", "otlp_endpoint": "http://127.0.0.1:4317", "cors_allow_origin": ["http://a.example"],
           "dtype": "bfloat16", "quantize": "int8", "device": "cpu", "runner": "fake", "api_key": "sekret",
           "generation_config": "none", "cuda_graphs": "1,2,4", "steps_ahead": 2,
           "piecewise_graphs": "16,32", "launch_depth": 2, "tokenizer_config_path": TOKENIZER_CONFIG,
           "aip_predict_route": "/predict", "aip_health_route": "/healthz"}


def user_settings() -> list:
    seen, out = set(), []
    for service in SERVICES:
        for d in service.user_settings():
            if d.name not in seen:
                seen.add(d.name)
                out.append(d)
    return out


def other_value(d):
    if d.name in SPECIAL:
        return SPECIAL[d.name]
    if d.kind is bool:
        return not d.default
    if d.spec.choices:
        return next(c for c in d.spec.choices if c != d.default)
    if d.kind is int:
        return (d.default or 0) + 3
    if d.kind is float:
        return round((d.default or 0.5) * 0.5, 3)
    if d.kind is list:
        return ["x.example", "y.example"]
    return "x"


def as_flags(d, value) -> list[str]:
    if d.switch:
        return [d.flag]
    if d.kind is list:
        return [a for v in value for a in (d.flag, v)]
    return [d.flag, str(value).lower() if d.kind is bool else str(value)]


def plan_for(args: list[str]):
    """The LaunchPlan `llmbus up args` would start (its run dir: --run-dir, else RUN_DIR)."""
    kw = dict(cli.up.make_context("up", list(args)).params)
    resolved = cli._resolve(kw)
    return cli._launch_plan(kw, resolved, kw["run_dir"] or RUN_DIR)


def services_of(launch) -> dict:
    """Each service's settings, parsed back from the argv (and environment) the plan starts it with."""
    return {name: settings for name, (settings, _) in started(launch).items()}


def started(launch) -> dict:
    """{service name: (its settings parsed back from its argv and environment, that environment)}."""
    out = {}
    for spec in build_plan(launch):
        argv = spec.argv[3:]
        if spec.name == "scheduler":
            settings = SchedulerProcessConfig.parse(argv, prog="scheduler")[0]
        elif spec.name == "workers":
            settings = WorkerConfig.parse(argv, prog="workers")[0]
        else:
            with pytest.MonkeyPatch.context() as env:
                for k, v in spec.env.items():
                    env.setenv(k, v)
                settings = frontend_from_args(argv)[0]
        out[spec.name] = (settings, dict(spec.env))
    return out


SERVICE_CLASSES = {"scheduler": SchedulerProcessConfig, "workers": WorkerConfig, "frontend": FrontendConfig}
BASE_ID = "org/base-model"
ANY = object()  # changed, to a value the launch derives
# What the launcher derives from a flag (TGI's rules): these change along with it.
# Without --max-total-tokens the longest request is fitted to the KV cache (TGI's default), the prompt's limit
# with it, both derived again where the services fit them.
UNFITTED = {"scheduler.fit_total_tokens_to_kv": False, "frontend.fit_total_tokens_to_kv": False}
DERIVED = {"max_batch_prefill_tokens": {"scheduler.fit_prefill_tokens_to_kv": False},
           "max_total_tokens": {"frontend.max_input_tokens": 199, **UNFITTED},
           "aip_http_port": {"frontend.port": ANY},  # Vertex's port wins over --port, as in TGI
           # the model embeds its positions times the factor: the default longest request with them
           "rope_factor": {"scheduler.max_total_tokens": ANY, "frontend.max_total_tokens": ANY}}
# What each launch-only flag of `llmbus up` changes, as observe() names things; a new launch flag fails
# test_every_up_flag_reaches_only_what_it_should until it is described here: (flags, environment, changes).
LAUNCH_FLAGS = {
    "model_id": (["--model-id", "org/other"], {},
                 {"resolve_model.model_id": "org/other", "frontend.model_id": "org/other"}),
    "revision": (["--revision", "v2"], {}, {"resolve_model.revision": "v2"}),
    "huggingface_hub_cache": (["--huggingface-hub-cache", "/hub"], {}, {"resolve_model.cache_dir": "/hub"}),
    "gguf_file": (["--gguf-file", "m.Q4_0.gguf"], {}, {"resolve_model.gguf_file": "m.Q4_0.gguf"}),
    "num_shard": (["--num-shard", "2"], {}, {"scheduler.world_size": 2, "workers.world_size": 2}),
    "sharded": (["--sharded", "false"], {"CUDA_VISIBLE_DEVICES": "0,1"},
                {"scheduler.world_size": 1, "workers.world_size": 1}),
    "trust_remote_code": (["--trust-remote-code"], {}, {"workers.trust_remote_code": True}),
    "max_input_length": (["--max-input-length", "100"], {}, {"frontend.max_input_tokens": 100}),
    "max_batch_total_tokens": (["--max-batch-total-tokens", "160"], {},
                               {"workers.num_blocks": -(-160 // default_block_size("auto")),  # 64 on CPU
                                "scheduler.max_total_tokens": 160,
                                "frontend.max_total_tokens": 160, "frontend.max_input_tokens": 159, **UNFITTED}),
    "watermark_gamma": (["--watermark-gamma", "0.25"], {}, {"workers.watermark_gamma": 0.25}),
    "watermark_delta": (["--watermark-delta", "1.5"], {}, {"workers.watermark_delta": 1.5}),
    "print_env": (["--env"], {}, {}),  # printed by `up` itself before anything starts
    "json_output": (["--json-output"], {}, {}),  # the launcher's environment for all (test_logs), or .env
    "run_dir": (["--run-dir", RUN_DIR + "-other"], {},
                {"scheduler.run_dir": RUN_DIR + "-other", "workers.run_dir": RUN_DIR + "-other",
                 "frontend.requests_endpoint": ANY, "frontend.events_endpoint": ANY}),
    "num_frontends": (["--num-frontends", "2"], {}, {"services": ["frontend0", "frontend1", "scheduler", "workers"]}),
    # resolved like the model (the hub is not asked: the last resolve_model call is the draft's)
    "draft_model_id": (["--draft-model-id", "org/draft"], {},
                       {"resolve_model.model_id": "org/draft", "workers.draft_model_dir": ANY,
                        "scheduler.speculate": 4, "scheduler.speculate_method": "draft"}),
    # resolved to folders (the fixture's resolver marks what it resolved), which only the workers load
    "lora_adapters": (["--lora-adapters", "sql=/adapters/sql"], {},
                      {"workers.lora_adapters": "resolved:sql=/adapters/sql"}),
    # TGI's flags with nothing to do here: accepted, and the launch says so (tests/supervisor/test_cli.py)
    "disable_custom_kernels": (["--disable-custom-kernels"], {}, {}),
    "master_addr": (["--master-addr", "10.0.0.1"], {}, {}),
    "master_port": (["--master-port", "29501"], {}, {}),
    "shard_uds_path": (["--shard-uds-path", "/tmp/tgi"], {}, {}),
    "prometheus_port": (["--prometheus-port", "9001"], {}, {}),
    "usage_stats": (["--usage-stats", "off"], {}, {}),
    "ngrok_authtoken": (["--ngrok-authtoken", "t0ken"], {}, {}),
    "ngrok_edge": (["--ngrok-edge", "edge"], {}, {}),
    # refused before anything is planned (tests/supervisor/test_cli.py): nothing to observe here
    "ngrok": ([], {}, {}),
    "weights_cache_override": ([], {}, {}),
}


@pytest.fixture
def observe(tiny_model_dir, monkeypatch):
    """observe(args) -> everything a launch with `llmbus up args` hands its services, flattened: "services",
    "<service>.<setting>", "<service>.env.<NAME>" and "resolve_model.<argument>" (the hub is not asked)."""
    monkeypatch.delenv("API_KEY", raising=False)
    calls = {}

    def resolve_model(model_id, **kwargs):
        calls.update(model_id=model_id, **kwargs)
        return tiny_model_dir

    monkeypatch.setattr(weights, "resolve_model", resolve_model)
    monkeypatch.setattr(weights, "resolve_lora_adapters", lambda text, cache_dir=None: text and f"resolved:{text}")

    def observe(args: list[str]) -> dict:
        services = started(plan_for(["--model-id", BASE_ID, *args]))
        flat = {"services": sorted(services), **{f"resolve_model.{k}": v for k, v in calls.items()}}
        for name, (settings, env) in services.items():
            flat.update({f"{name}.{f.name}": getattr(settings, f.name) for f in dataclasses.fields(settings)})
            flat.update({f"{name}.env.{k}": v for k, v in env.items()})
        return flat

    return observe


def expected_changes(option) -> tuple[list[str], dict, dict]:
    """(flags, environment, changes) for one `llmbus up` option: a service setting reaches every service
    that declares it (secrets through the environment), a launch flag does what LAUNCH_FLAGS says."""
    by_name = {d.name: d for d in user_settings()}
    if option.name not in by_name:
        assert option.name in LAUNCH_FLAGS, f"{option.opts[0]}: say in LAUNCH_FLAGS what it changes"
        return LAUNCH_FLAGS[option.name]
    d = by_name[option.name]
    value = other_value(d)
    changes = dict(DERIVED.get(d.name, {}))
    for service, cls in SERVICE_CLASSES.items():
        if d.name in {x.name for x in declared(cls)}:
            changes[f"{service}.{d.name}"] = value
            if d.spec.secret:
                changes[f"{service}.env.{d.spec.env}"] = value
    return as_flags(d, value), {}, changes


@pytest.mark.parametrize("option", [p for p in cli.up.params if isinstance(p, click.Option)],
                         ids=lambda p: p.opts[0])
def test_every_up_flag_reaches_only_what_it_should(option, observe, monkeypatch):
    flags, env, changes = expected_changes(option)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    baseline, got = observe([]), observe(flags)
    comparable = (set(baseline["services"]) & set(got["services"])) | {"services", "resolve_model"}
    changed = {k: got.get(k) for k in got.keys() | baseline.keys()
               if got.get(k) != baseline.get(k) and k.split(".")[0] in comparable}
    assert changed.keys() == changes.keys(), f"{option.opts[0]} changed {sorted(changed)}"
    for key, value in changes.items():
        assert value is ANY or changed[key] == value, key


def test_a_setting_several_services_read_is_declared_alike():
    """`llmbus up` has one option for such a setting (built from its first declaration): every service
    must read the same flag, variable, type and default from it."""
    def as_read(d):
        s = d.spec
        return d.flag, s.aliases, s.env, d.kind, d.default, s.choices, s.secret, s.ge, s.gt, s.le, s.lt, s.check

    first = {}
    for service in SERVICES:
        for d in service.user_settings():
            assert as_read(d) == as_read(first.setdefault(d.name, d)), f"{d.name} of {service.__name__}"


def test_env_vars_work_like_flags(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("QUANTIZE", "int4")
    monkeypatch.setenv("MAX_BATCH_PREFILL_TOKENS", "333")
    got = services_of(plan_for(["--model-id", str(tiny_model_dir)]))
    assert got["workers"].quantize == "int4" and got["frontend"].quantize == "int4"
    assert got["workers"].max_batch_prefill_tokens == got["scheduler"].max_batch_prefill_tokens == 333


def test_procfile_and_up_give_identical_settings(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("API_KEY", raising=False)
    flags = ["--model-id", str(tiny_model_dir), "--quantize", "int8", "--max-total-tokens", "200",
             "--prefix-caching", "false", "--api-key", "k", "--num-frontends", "2", "--run-dir", RUN_DIR,
             "--json-output"]
    result = CliRunner().invoke(cli.main, ["procfile", "-o", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines())
    assert env[ENV_JSON_LOGS] == "1"
    from_procfile = {}
    for line in (tmp_path / "Procfile").read_text().splitlines():
        if line.startswith("#"):
            continue
        name, command = line.split(": exec ", 1)
        argv = shlex.split(command)[3:]
        if name == "scheduler":
            from_procfile[name] = SchedulerProcessConfig.parse(argv, prog="scheduler")[0]
        elif name == "workers":
            from_procfile[name] = WorkerConfig.parse(argv, prog="workers")[0]
        else:
            monkeypatch.setenv("API_KEY", shlex.split(env["API_KEY"])[0])
            from_procfile[name] = frontend_from_args(argv)[0]
    from_up = services_of(plan_for(flags))
    assert from_procfile.keys() == from_up.keys() == {"scheduler", "workers", "frontend0", "frontend1"}
    for name, cfg in from_up.items():
        if name.startswith("frontend"):  # the Procfile's frontends wait longer for the workers to load
            assert from_procfile[name].scheduler_timeout_s == 900.0
            cfg = dataclasses.replace(cfg, scheduler_timeout_s=900.0)
        assert from_procfile[name] == cfg, name
    assert from_up["frontend1"].api_key == "k" and from_up["frontend1"].reuse_port


@pytest.mark.parametrize("service", [SchedulerProcessConfig, WorkerConfig])
def test_settings_round_trip_through_their_command_line(service):
    values = {d.name: other_value(d) for d in declared(service) if d.name not in ("otlp_endpoint", "api_key")}
    values.update(run_dir=RUN_DIR, rank=1) if service is WorkerConfig else values.update(run_dir=RUN_DIR)
    if service is WorkerConfig:
        values["model_dir"] = "/m"
    settings = service(**values)
    assert service.parse(settings.to_argv(), prog="x")[0] == settings


def test_frontend_settings_round_trip(monkeypatch):
    monkeypatch.delenv("API_KEY", raising=False)
    settings = FrontendConfig(model_dir="/m", requests_endpoint="ipc:///r", events_endpoint="ipc:///e",
                              frontend_id="f3", api_key="k", cors_allow_origin=["http://a", "http://b"],
                              enable_prefill_logprobs=True, quantize="int4", max_total_tokens=99)
    monkeypatch.setenv("API_KEY", settings.secret_env()["API_KEY"])
    assert "k" not in settings.to_argv()
    assert frontend_from_args(settings.to_argv())[0] == settings


@pytest.mark.parametrize("env,cores,world_size,threads", [
    (None, 4, 1, 4), (None, 4, 2, 2), (None, 3, 2, 1), (None, 1, 4, 1),  # an equal share, at least one
    (None, 16, 1, 14), (None, 16, 2, 7), (None, 8, 1, 6),  # from 8 cores two are left to serving
    ("3", 16, 2, 3),  # the operator's OMP_NUM_THREADS wins
    ("0", 4, 2, 2), ("many", 4, 2, 2),  # values OpenMP itself would not take are ignored
])
def test_cpu_rank_threads(env, cores, world_size, threads, monkeypatch):
    from llmbus.workers.placement import CpuBudget, cpu_threads

    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert cpu_threads(world_size, CpuBudget(cpus=2 * cores, cores=cores)) == threads


# ------------------------------------------------------------------ settings that check themselves

SERVICE_ENTRIES = {  # each service's own command line: (module, the flags it needs to start)
    "scheduler": ("llmbus.scheduler", ["--run-dir", RUN_DIR]),
    "workers": ("llmbus.workers", ["--run-dir", RUN_DIR, "--model-dir", "/m"]),
    "frontend": ("llmbus.frontend", ["--run-dir", RUN_DIR, "--model-dir", "/m"]),
}
SERVICE_NEEDS = {SchedulerProcessConfig: dict(run_dir=RUN_DIR), WorkerConfig: dict(run_dir=RUN_DIR, model_dir="/m"),
                 FrontendConfig: dict(model_dir="/m", requests_endpoint="ipc:///r", events_endpoint="ipc:///e")}


def refusal(service: str, flags: list[str], capsys) -> str:
    """The last line a service's own command line answers ``flags`` with; it must refuse them (exit 2)."""
    _, needed = SERVICE_ENTRIES[service]
    with pytest.raises(SystemExit) as exited:
        if service == "frontend":
            frontend_from_args([*needed, *flags])
        else:
            SERVICE_CLASSES[service].parse([*needed, *flags], prog=f"llmbus {service}")
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


EMPTY_FOLDER = ("Invalid argument: `model_dir` must name a folder, not an empty string (a `llmbus model-dir` before it "
                "failed?)")


@pytest.mark.parametrize("service, flags, message", [
    ("scheduler", ["--max-batch-prefill-tokens", "0"], "Invalid argument: `max_batch_prefill_tokens` must be > 0"),
    ("scheduler", ["--max-batch-size", "0"], "Invalid argument: `max_batch_size` must be > 0"),
    ("scheduler", ["--waiting-served-ratio", "-1"],
     "Invalid argument: `waiting_served_ratio` must be >= 0. Given: -1.0"),
    ("scheduler", ["--max-waiting-tokens", "-2"], "Invalid argument: `max_waiting_tokens` must be >= 0. Given: -2"),
    ("scheduler", ["--speculate", "-1"], "Invalid argument: `speculate` must be >= 0. Given: -1"),
    ("workers", ["--cuda-memory-fraction", "0"],
     "Invalid argument: `cuda_memory_fraction` must be in (0, 1]. Given: 0.0"),
    ("workers", ["--kv-cache-memory", "0"], "Invalid argument: `kv_cache_memory` must be > 0"),
    ("workers", ["--block-size", "0"], "Invalid argument: `block_size` must be > 0"),
    ("workers", ["--watermark-gamma", "1.5"], "Invalid argument: `watermark_gamma` must be > 0 and < 1. Given: 1.5"),
    ("frontend", ["--port", "70000"], "Invalid argument: `port` must be between 0 and 65535. Given: 70000"),
    ("frontend", ["--max-best-of", "0"], "Invalid argument: `max_best_of` must be > 0"),
    ("frontend", ["--health-check-timeout", "0"], "Invalid argument: `health_check_timeout` must be > 0. Given: 0.0"),
    ("frontend", ["--max-stop-sequences", "-1"], "Invalid argument: `max_stop_sequences` must be >= 0. Given: -1"),
    ("frontend", ["--max-input-tokens", "9000", "--max-total-tokens", "8192"],
     "Invalid argument: `max_input_tokens`(9000) must be < `max_total_tokens`(8192)"),  # validate()
    ("frontend", ["--frontend-id", "a-b"], "Invalid argument: `frontend_id` must be non-empty and contain no '-'. "
                                           "Given: 'a-b'"),
    # the Procfile's $(llmbus model-dir ...) that failed (a bad MODEL_ID): one line, not a traceback
    ("frontend", ["--model-dir", ""], EMPTY_FOLDER),
    ("workers", ["--model-dir", ""], EMPTY_FOLDER),
])
def test_a_service_refuses_a_value_out_of_its_declared_bounds(service, flags, message, capsys):
    prog = "python -m llmbus.frontend" if service == "frontend" else f"llmbus {service}"
    assert refusal(service, flags, capsys) == f"{prog}: error: {message}"


def test_a_service_refuses_a_bad_value_from_its_environment(capsys, monkeypatch):
    monkeypatch.setenv("WATERMARK_GAMMA", "2")
    assert refusal("workers", [], capsys).endswith(
        "Invalid argument: `watermark_gamma` must be > 0 and < 1. Given: 2.0")
    monkeypatch.delenv("WATERMARK_GAMMA")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "maybe")
    assert refusal("workers", [], capsys).endswith(
        "TRUST_REMOTE_CODE='maybe' is not a valid value for --trust-remote-code")
    # a flag given wins over its variable, as click's do for `llmbus up` (whose services inherit its environment)
    _, needed = SERVICE_ENTRIES["workers"]
    assert WorkerConfig.parse([*needed, "--trust-remote-code"], prog="llmbus workers")[0].trust_remote_code
    monkeypatch.setenv("PORT", "abc")
    assert frontend_from_args([*SERVICE_ENTRIES["frontend"][1], "--port", "3150"])[0].port == 3150
    assert refusal("frontend", [], capsys).endswith("PORT='abc' is not a valid value for --port")


@pytest.mark.parametrize("service", sorted(SERVICE_ENTRIES))
def test_each_service_command_line_refuses_with_one_line_and_no_traceback(service):
    import subprocess
    import sys

    bad = {"scheduler": ["--max-batch-size", "0"], "workers": ["--cuda-memory-fraction", "1.5"],
           "frontend": ["--max-concurrent-requests", "0"]}[service]
    module, needed = SERVICE_ENTRIES[service]
    done = subprocess.run([sys.executable, "-m", module, *needed, *bad], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "Invalid argument: `" in done.stderr.splitlines()[-1], done.stderr


def test_up_and_each_service_word_a_broken_bound_alike(tiny_model_dir):
    """One declaration, one message: `llmbus up` refuses a value out of a setting's bounds with the very
    line the services that declare it refuse it with."""
    from llmbus.supervisor.settings import up_settings

    checked = 0
    for d in up_settings():
        if d.name == "port":
            continue  # `up` wants 1..65535 (its frontends share the port); a frontend alone may take 0
        low = d.spec.ge if d.spec.ge is not None else d.spec.gt
        if low is None:
            continue
        value = (low - 1) if d.spec.ge is not None else low
        result = CliRunner().invoke(cli.main, ["up", "--model-id", str(tiny_model_dir), d.flag, str(value)])
        assert result.exit_code == 2, (d.name, result.output)
        line = result.output.strip().splitlines()[-1]
        assert line.startswith("Error: Invalid argument: `"), line
        expected = d.problem(d.convert(str(value)))
        assert line == f"Error: Invalid argument: {expected}"
        for service in SERVICES:
            if d.name in {x.name for x in declared(service)}:
                with pytest.raises(SettingsError) as refused:
                    service(**SERVICE_NEEDS[service], **{d.name: d.convert(str(value))})
                assert str(refused.value) == f"Invalid argument: {expected}", service.__name__
        checked += 1
    assert checked >= 15


def test_declared_bounds_are_worded_as_tgi_words_them():
    from llmbus.bus.settings import Declared, Spec

    def problem(kind, value, **bounds):
        spec = Spec("h", None, (), None, None, True, False, False, **bounds)
        return Declared("some_thing", kind, False, 0, spec).problem(value)

    assert problem(int, 0, ge=1) == "`some_thing` must be > 0"  # a count
    assert problem(int, 1, ge=1) is None and problem(int, None, ge=1) is None  # unset: nothing to check
    assert problem(int, -2, ge=0) == "`some_thing` must be >= 0. Given: -2"
    assert problem(float, 0.0, gt=0) == "`some_thing` must be > 0. Given: 0.0"
    assert problem(int, 0, ge=1, le=65535) == "`some_thing` must be between 1 and 65535. Given: 0"
    assert problem(float, 1.5, gt=0, le=1) == "`some_thing` must be in (0, 1]. Given: 1.5"
    assert problem(float, 1.0, gt=0, lt=1) == "`some_thing` must be > 0 and < 1. Given: 1.0"
    assert problem(float, 3.0, le=2) == "`some_thing` must be <= 2. Given: 3.0"
    assert problem(str, "x", check=lambda v: "must not be x" if v == "x" else None) == "`some_thing` must not be x"


def test_validate_holds_the_rules_across_fields():
    with pytest.raises(SettingsError) as refused:
        FrontendConfig(model_dir="/m", requests_endpoint="ipc:///r", events_endpoint="ipc:///e",
                       max_input_tokens=10, max_total_tokens=10)
    assert str(refused.value) == "Invalid argument: `max_input_tokens`(10) must be < `max_total_tokens`(10)"
    with pytest.raises(SettingsError, match="give --requests-endpoint and --events-endpoint, or --run-dir"):
        FrontendConfig(model_dir="/m")
    # a bound is checked before the rules across fields, and every broken bound is named
    with pytest.raises(SettingsError) as refused:
        FrontendConfig(model_dir="/m", max_best_of=0, max_client_batch_size=0)
    assert refused.value.problems == ["`max_best_of` must be > 0", "`max_client_batch_size` must be > 0"]
    ok = FrontendConfig(model_dir="/m", requests_endpoint="ipc:///r", events_endpoint="ipc:///e", port=0)
    assert ok.port == 0, "a frontend alone may listen on any free port"
    with pytest.raises(SettingsError, match="`max_batch_prefill_tokens` must be > 0"):
        dataclasses.replace(SchedulerProcessConfig(run_dir=RUN_DIR), max_batch_prefill_tokens=0)


def test_watermark_and_remote_code_are_the_workers_settings(monkeypatch):
    """Read from TGI's variables by the workers' own command line (no module reads them at import), and
    given to the ranks as flags by a launch."""
    monkeypatch.setenv("WATERMARK_GAMMA", "0.3")
    monkeypatch.setenv("WATERMARK_DELTA", "4.5")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "1")
    cfg = WorkerConfig.parse(["--run-dir", RUN_DIR, "--model-dir", "/m"], prog="workers")[0]
    assert (cfg.watermark_gamma, cfg.watermark_delta, cfg.trust_remote_code) == (0.3, 4.5, True)
    monkeypatch.delenv("WATERMARK_GAMMA")
    monkeypatch.delenv("WATERMARK_DELTA")
    monkeypatch.delenv("TRUST_REMOTE_CODE")
    argv = dataclasses.replace(cfg, watermark_gamma=0.25).to_argv()
    assert "--trust-remote-code" in argv and argv[argv.index("--watermark-gamma") + 1] == "0.25"
    assert WorkerConfig.parse(argv, prog="workers")[0] == dataclasses.replace(cfg, watermark_gamma=0.25)


def test_the_launch_plan_is_frozen(tiny_model_dir):
    launch = plan_for(["--model-id", str(tiny_model_dir)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.num_frontends = 2
    spec = build_plan(launch)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.argv = ()
