"""``python -m llmbus.frontend``: run one frontend process.

Endpoints come from ``--requests-endpoint`` / ``--events-endpoint``, or from a launch's run dir
(``--run-dir`` or ``LLMBUS_RUN_DIR``) like every other llmbus service.
"""

from __future__ import annotations

import argparse
import os
import sys

from llmbus.bus.rundir import ENV_RUN_DIR, Endpoints, ensure_run_dir_or_exit
from llmbus.bus.settings import declared, parsed_values
from llmbus.frontend.app import run_frontend
from llmbus.frontend.config import FrontendConfig


def build_parser() -> argparse.ArgumentParser:
    p = FrontendConfig.parser("python -m llmbus.frontend", "llmbus HTTP frontend (TGI-compatible routes)")
    p.add_argument("--run-dir", default=os.environ.get(ENV_RUN_DIR),
                   help="the launch's run dir, to derive endpoints from (env LLMBUS_RUN_DIR)")
    p.add_argument("--service-name", default="frontend",
                   help="this process's name in logs and readiness (several frontends: frontend0, frontend1...)")
    return p


def from_args(argv: list[str] | None = None) -> tuple[FrontendConfig, str]:
    """The config and the service name."""
    parser = build_parser()
    values = parsed_values(parser, argv)
    run_dir, service_name = values.pop("run_dir"), values.pop("service_name")
    for d in declared(FrontendConfig):
        if d.kind is list and values[d.name] is None:  # an append flag never given
            values[d.name] = []
    if values["frontend_id"] is None:
        del values["frontend_id"]
    if run_dir:
        ensure_run_dir_or_exit(run_dir, "llmbus frontend")
        endpoints = Endpoints.in_dir(run_dir)
        values["requests_endpoint"] = values["requests_endpoint"] or endpoints.requests
        if values["events_endpoint"] is None:
            fid = values.setdefault("frontend_id", FrontendConfig.__dataclass_fields__["frontend_id"].default_factory())
            values["events_endpoint"] = endpoints.frontend_events(run_dir, fid)
    try:
        return FrontendConfig(**values), service_name
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    config, service_name = from_args(argv)
    return run_frontend(config, service_name)


if __name__ == "__main__":
    sys.exit(main())
