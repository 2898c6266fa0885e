"""Decode-step time of this checkout against another git revision, process by process, in turn.

    python benchmarks/step_ab.py --against HEAD~1 [--model-id DIR] [--dtype float32] [--quantize int8]
                                 [--batch 1] [--context 192] [--pairs 6]

A change to the model path (a kernel, the fused layer) is judged by whole decode steps, not by a
microbenchmark: the revision given is checked out into a temporary git worktree and imported in place of
this one (``PYTHONPATH``), and each pair runs one process of each, alternating which goes first, so the
machine's drift (the same step takes 10-15 ms within minutes on a 2-core VM) hits both alike. Each process
loads the model, then times ``--rounds`` rounds of ``--steps`` decode steps after a fresh prefill of
``--context`` tokens (benchmarks/decode_step.py's LlmbusDecode: the whole ModelRunner.step) and reports
its fastest round's median. Printed: both figures of every pair, their ratio (other / this: above 1 means
this checkout is faster), and the median ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _revision import add_comparison_arguments, comparison_model, revision_package

RESULT = "STEP_MS"


def time_steps(a: argparse.Namespace) -> None:
    """In the child process: one model, ``rounds`` timed rounds; prints the best round's median step."""
    import torch

    from decode_step import LlmbusDecode  # this folder, run as a script

    decode = LlmbusDecode(str(comparison_model(a.model_id)), getattr(torch, a.dtype), a.batch, a.context, a.steps,
                          quantize=a.quantize)
    best = min(decode.time_steps(a.batch, a.steps) for _ in range(a.rounds))
    print(f"{RESULT} {best * 1e3:.3f}")


def run_child(argv: list[str], package_dir: Path | None) -> float:
    env = dict(os.environ)
    if package_dir is not None:
        env["PYTHONPATH"] = str(package_dir)  # ahead of the editable install of this checkout
    else:
        env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
    result = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not result:
        sys.exit(f"step_ab.py: the {'other revision' if package_dir else 'this checkout'}'s process failed "
                 f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
    return float(result[0].split()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_comparison_arguments(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        time_steps(a)
        return
    argv = [f"--dtype={a.dtype}", f"--batch={a.batch}", f"--context={a.context}", f"--steps={a.steps}",
            f"--rounds={a.rounds}", *([f"--model-id={a.model_id}"] if a.model_id else []),
            *([f"--quantize={a.quantize}"] if a.quantize else [])]
    with revision_package(a.against, "step_ab.py") as package:
        ratios = []
        for pair in range(a.pairs):
            order = [None, package] if pair % 2 else [package, None]
            ms = {str(d): run_child(argv, d) for d in order}
            this, other = ms[str(None)], ms[str(package)]
            ratios.append(other / this)
            print(f"pair {pair + 1}: {a.against} {other:.2f} ms, this checkout {this:.2f} ms, "
                  f"ratio {other / this:.3f}", flush=True)
        print(f"median ratio ({a.against} / this checkout): {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
