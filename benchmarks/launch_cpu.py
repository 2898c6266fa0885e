"""What one `llmbus up` start and stop costs in CPU, process by process, for this tree and another revision.

    python benchmarks/launch_cpu.py [--against HEAD] [--rounds 5]

The test suite is CPU-bound on its 2 cores and starts some 70 launches, so a launch's CPU is most of what a change
to start-up buys or costs it. Each round launches the tiny demo model (float32, a 128 MiB KV pool, as the suite's
servers run) once from ``--against`` (``_revision.revision_package``) and once from this checkout, taking turns.
Every process records its own CPU seconds as it exits (an ``atexit`` hook installed through a ``sitecustomize``
on PYTHONPATH); the table gives each service's median over the rounds, and the launch's sum.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _revision import revision_package  # this folder: run as a script, it is on the path

SERVICES = ("frontend", "scheduler", "workers", "supervisor")
# written into the sitecustomize: each Python process appends "pid<TAB>cpu seconds<TAB>argv" as it exits
RECORDER = """\
import atexit, os, sys

def _record():
    times = os.times()
    with open(os.environ["LAUNCH_CPU_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\t{times.user + times.system}\\t{' '.join(sys.argv)}\\n")

atexit.register(_record)
"""
LAUNCH = """\
import sys
from llmbus.testing import Server
server = Server(["--model-id", sys.argv[1], "--dtype", "float32", "--max-total-tokens", "256",
                 "--kv-cache-memory", str(128 * 1024 * 1024)])
assert server.stop() == 0, server.stderr.text[-2000:]
"""


def launch_cpu(python_path: str, model_dir: str, log: Path) -> dict[str, float]:
    """CPU seconds of each service of one launch made with ``python_path`` first on the import path."""
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=python_path, LAUNCH_CPU_LOG=str(log))
    subprocess.run([sys.executable, "-c", LAUNCH, model_dir], env=env, check=True, capture_output=True)
    cpu: dict[str, float] = collections.defaultdict(float)
    for line in log.read_text().splitlines():
        _, seconds, argv = line.split("\t", 2)
        service = re.search(r"/(frontend|scheduler|workers|supervisor)/__main__\.py", argv)
        if service:
            cpu[service.group(1)] += float(seconds)
    return cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", help="the git revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from llmbus.supervisor.demo_model import build_demo_model

    with tempfile.TemporaryDirectory() as work, revision_package(args.against, "launch_cpu.py") as package:
        work = Path(work)
        (work / "hook").mkdir()
        (work / "hook" / "sitecustomize.py").write_text(RECORDER)
        build_demo_model(work / "tiny", "tiny")
        trees = {args.against: f"{work / 'hook'}:{package}", "this checkout": str(work / "hook")}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, python_path in trees.items():
                runs[name].append(launch_cpu(python_path, str(work / "tiny"), work / "cpu.log"))
    print(f"median CPU s of {args.rounds} launches each (tiny model, float32)")
    print(f"{'service':12}" + "".join(f"{name:>15}" for name in trees))
    for service in (*SERVICES, "launch"):
        medians = [statistics.median(sum(run.values()) if service == "launch" else run.get(service, 0.0)
                                     for run in runs[name]) for name in trees]
        print(f"{service:12}" + "".join(f"{m:15.2f}" for m in medians))
    before, after = (statistics.median(sum(run.values()) for run in runs[name]) for name in trees)
    print(f"this checkout's launch: {after / before:.3f}x the CPU of {args.against}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
