"""The process plan: one description of a launch that both `llmbus up` and the Procfile render.

`llmbus up`'s flags are resolved once (``ResolvedLaunch``: the model's folder, the ranks, the token limits),
then composed into each service's settings (``LaunchPlan``), then into the processes to start
(``build_plan``). Each step is a frozen value: nothing downstream edits what an earlier step decided.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass

from llmbus.bus.rundir import Endpoints
from llmbus.bus.service import ENV_JSON_LOGS
from llmbus.frontend.config import FrontendConfig
from llmbus.scheduler.config import SchedulerProcessConfig
from llmbus.supervisor.launcher import STARTUP_TIMEOUT_S, ProcessSpec
from llmbus.workers.process import WorkerConfig


@dataclass(frozen=True)
class ResolvedLaunch:
    """What `llmbus up`'s flags come to once the model is found: TGI's launcher's resolution."""

    model_dir: str
    num_shard: int  # tensor-parallel ranks
    max_input_tokens: int
    max_input_derived: bool  # not given: max_total_tokens - 1, as the services derive it again if they fit it
    max_total_tokens: int
    max_batch_prefill_tokens: int
    prefill_explicit: bool  # given by the user: checked against the KV capacity, never lowered to it
    draft_dir: str | None = None
    lora_adapters: str | None = None  # the workers' --lora-adapters: name=folder, comma-separated


@dataclass(frozen=True)
class LaunchPlan:
    """Every service's settings for one launch, already validated and with defaults resolved."""

    scheduler: SchedulerProcessConfig
    workers: WorkerConfig
    frontend: FrontendConfig  # frontend i gets frontend_id f<i> and, with several, --reuse-port
    num_frontends: int = 1


def build_plan(launch: LaunchPlan, python: str = sys.executable) -> list[ProcessSpec]:
    plan = [
        ProcessSpec("scheduler", (python, "-m", "llmbus.scheduler", *launch.scheduler.to_argv())),
        # The scheduler is ready only once every rank is: the group itself has nothing more to say.
        ProcessSpec("workers", (python, "-m", "llmbus.workers", *launch.workers.to_argv()), reports_ready=False,
                    restart="on_request"),
    ]
    for i in range(launch.num_frontends):
        plan.append(frontend_spec(launch, i, python))
    return plan


def frontend_spec(launch: LaunchPlan, index: int, python: str = sys.executable) -> ProcessSpec:
    run_dir = launch.scheduler.run_dir
    name = "frontend" if launch.num_frontends == 1 else f"frontend{index}"
    frontend_id = f"f{index}"
    # started with the workers: its handshake waits as long as their weights may take to load
    frontend = dataclasses.replace(
        launch.frontend, frontend_id=frontend_id, reuse_port=launch.num_frontends > 1,
        frontends_sharing=launch.num_frontends,
        scheduler_timeout_s=STARTUP_TIMEOUT_S,
        requests_endpoint=Endpoints.in_dir(run_dir).requests,
        events_endpoint=Endpoints.in_dir(run_dir).frontend_events(run_dir, frontend_id))
    # the key travels in the environment: a command line is readable by every user of the machine
    return ProcessSpec(name, (python, "-m", "llmbus.frontend", "--run-dir", run_dir, *frontend.to_argv(),
                              "--service-name", name), env=frontend.secret_env(),
                       # one of several restarts while the others serve; a lone one ends the launch as before
                       restart="on_exit" if launch.num_frontends > 1 else "never",
                       max_restarts=launch.scheduler.max_restarts)


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
