"""One definition per setting: every `llmbus up` flag reaches the services that declare it, and only them;
a rendered Procfile gives each service the same settings as `llmbus up`; each service's settings survive
their own command line."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
from click.testing import CliRunner

from llmbus.bus.settings import declared
from llmbus.frontend.__main__ import from_args as frontend_from_args
from llmbus.frontend.config import FrontendConfig
from llmbus.scheduler.process import SchedulerProcessConfig
from llmbus.supervisor import cli
from llmbus.supervisor.plan import build_plan
from llmbus.supervisor.settings import SERVICES
from llmbus.workers.process import WorkerConfig

RUN_DIR = "/tmp/llmbus-settings-test"
# Values that pass every cross-flag rule (the model's 256 positions, input < total, ...).
SPECIAL = {"max_total_tokens": 200, "max_input_tokens": 100, "max_batch_prefill_tokens": 300,
           "port": 3456, "hostname": "127.0.0.2", "otlp_endpoint": "http://127.0.0.1:4317", "cors_allow_origin": ["http://a.example"],
           "dtype": "bfloat16", "quantize": "int8", "device": "cpu", "runner": "fake", "api_key": "sekret"}


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
    return "x"


def as_flags(d, value) -> list[str]:
    if d.switch:
        return [d.flag]
    if d.kind is list:
        return [a for v in value for a in (d.flag, v)]
    return [d.flag, str(value).lower() if d.kind is bool else str(value)]


def plan_for(args: list[str]):
    ctx = cli.up.make_context("up", list(args))
    kw = dict(ctx.params)
    resolved = cli._resolve(kw)
    return cli._launch_plan(kw, resolved, RUN_DIR)


def services_of(launch) -> dict:
    """Each service's settings, parsed back from the argv (and environment) the plan starts it with."""
    out = {}
    for spec in build_plan(launch):
        argv = spec.argv[3:]
        if spec.name == "scheduler":
            out["scheduler"] = SchedulerProcessConfig.parse(argv, prog="scheduler")[0]
        elif spec.name == "workers":
            out["workers"] = WorkerConfig.parse(argv, prog="workers")[0]
        else:
            with pytest.MonkeyPatch.context() as env:
                for k, v in spec.env.items():
                    env.setenv(k, v)
                out[spec.name] = frontend_from_args(argv)[0]
    return out


# What the launcher derives from a flag (TGI's rules): these may change along with it.
DERIVED = {"max_batch_prefill_tokens": {"fit_prefill_tokens_to_kv"}, "max_total_tokens": {"max_input_tokens"}}
SERVICE_CLASSES = {"scheduler": SchedulerProcessConfig, "workers": WorkerConfig, "frontend": FrontendConfig}


@pytest.mark.parametrize("setting", user_settings(), ids=lambda d: d.flag)
def test_every_up_flag_reaches_the_services_that_declare_it(setting, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("API_KEY", raising=False)
    value = other_value(setting)
    launch = plan_for(["--model-id", str(tiny_model_dir), *as_flags(setting, value)])
    baseline = services_of(plan_for(["--model-id", str(tiny_model_dir)]))
    got = services_of(launch)
    for service, cfg in got.items():
        declares = setting.name in {d.name for d in declared(SERVICE_CLASSES[service])}
        if declares:
            assert getattr(cfg, setting.name) == value, f"{setting.flag} did not reach {service}"
        # nothing else moved: a flag changes its own setting in every service, and nothing more
        changed = {f.name for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(baseline[service], f.name)}
        assert changed <= {setting.name} | DERIVED.get(setting.name, set()), f"{setting.flag} also changed {changed - {setting.name}} in {service}"


def test_env_vars_work_like_flags(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("QUANTIZE", "int4")
    monkeypatch.setenv("MAX_BATCH_PREFILL_TOKENS", "333")
    got = services_of(plan_for(["--model-id", str(tiny_model_dir)]))
    assert got["workers"].quantize == "int4" and got["frontend"].quantize == "int4"
    assert got["workers"].max_batch_prefill_tokens == got["scheduler"].max_batch_prefill_tokens == 333


def test_procfile_and_up_give_identical_settings(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("API_KEY", raising=False)
    flags = ["--model-id", str(tiny_model_dir), "--quantize", "int8", "--max-total-tokens", "200",
             "--prefix-caching", "false", "--api-key", "k", "--num-frontends", "2", "--run-dir", RUN_DIR]
    result = CliRunner().invoke(cli.main, ["procfile", "-o", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines())
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
