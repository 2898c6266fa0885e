"""Whole decode steps of two versions of the C kernels (workers/kernels/csrc), alternated step by step in one
process.

    python benchmarks/kernel_step_ab.py OLD_CSRC [NEW_CSRC] [--model-id DIR] [--dtype bfloat16|float32]
                                        [--quantize int8|int4] [--batch 64] [--context 192] [--steps 40]

NEW_CSRC defaults to this checkout's workers/kernels/csrc; OLD_CSRC is any other version of that folder (say
``mkdir /tmp/old && git archive HEAD~1 workers/kernels/csrc | tar -x -C /tmp/old``, then
/tmp/old/workers/kernels/csrc). Each version is built and loaded as its own library, and ModelRunners of the
same checkpoint are built on each (their fused decode layer, decode attention and sampling entries bound to
that library): four, built old, new, new, old, after a spare one that is not measured (the first runner of
a process took 4% longer a step at batch 1 than the others, from the same sources), each with its own KV
pool and the same prompts. They take decode steps in turn, in an order drawn anew every step (a fixed
rotation favoured some places in it by a few percent), so that both sides see the same minute of this noisy
machine: step_ab.py's process pairs drift 10-15% between processes, where a kernel change is a few
percent. Printed: each side's median step and the median (and quartiles) of the per-step ratios OLD/NEW
(each side's two runners' times added), above 1 meaning NEW is faster; and whether all four sampled the
same tokens at every step (greedy: a change of arithmetic shows there). Giving the same folder twice
measures the tool's own bias.

As a rank does, the process puts its large blocks on 2 MB pages and spins OpenMP threads briefly
(workers/group.py), and the pool has blocks of 64 positions (the CPU default). For a change on the serving
path, use served_ab.py; for the attention kernel alone, decode_attention_ab.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
from pathlib import Path

from llmbus.workers.group import GOMP_SPINCOUNT, THP_MEM_ALLOC_ENABLE

# read at torch's first allocation and libgomp's load: before torch is imported, as the group does for a rank
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", THP_MEM_ALLOC_ENABLE)
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)

import torch

import decode_step
from _smollm2 import dense_folder

from llmbus.workers import quant, sampling
from llmbus.workers.attention import decode_kernel
from llmbus.workers.kernels import bindings, build

CPU_BLOCK_SIZE = 64


def runner_on(source: Path, model_id: str, dtype: torch.dtype, batch: int, context: int, steps: int,
              quantize: str | None) -> decode_step.LlmbusDecode:
    """A ModelRunner whose kernels are built from ``source``: every cached handle to the library is dropped
    first, so the runner binds the new one (the other runner keeps its own)."""
    built = build.build
    build.build = functools.partial(built, source_dir=source)
    try:
        for cached in (bindings.library, decode_kernel.decode_attention_kernel, quant._library,
                       sampling.sampling_kernels):
            cached.cache_clear()
        return decode_step.LlmbusDecode(model_id, dtype, batch, context, steps + 1, quantize=quantize)
    finally:
        build.build = built


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new", nargs="?", default=str(build.SOURCE_DIR))
    p.add_argument("--model-id", default=None, help="model folder (default: SmolLM2's bf16 folder)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantize", default=None, choices=["int8", "int4"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    model_id = a.model_id or str(dense_folder("bfloat16"))
    decode_step.BLOCK_SIZE = CPU_BLOCK_SIZE
    dtype = getattr(torch, a.dtype)
    # the first runner a process builds takes 4% longer a step than any built after it, whatever its
    # sources: one is built first and not measured
    spare = runner_on(Path(a.new).resolve(), model_id, dtype, a.batch, a.context, a.steps, a.quantize)
    builds = (("old", a.old), ("new", a.new), ("new", a.new), ("old", a.old))
    runners = [(name, runner_on(Path(source).resolve(), model_id, dtype, a.batch, a.context, a.steps, a.quantize))
               for name, source in builds]
    last = [runner.prefill(a.batch) for _, runner in runners]
    same = all(tokens == last[0] for tokens in last)
    times: dict[str, list[float]] = {"old": [0.0] * a.steps, "new": [0.0] * a.steps}
    order = random.Random(0)
    for k in range(a.steps):
        for i in order.sample(range(len(runners)), len(runners)):
            name, runner = runners[i]
            seconds, last[i] = runner.decode(a.batch, last[i], a.context + k)
            times[name][k] += seconds / 2
        same = same and all(tokens == last[0] for tokens in last)
    del spare
    warm = 3  # first steps of each side: caches, the allocator, page faults
    ratios = [o / n for o, n in zip(times["old"][warm:], times["new"][warm:])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    old, new = (statistics.median(times[name][warm:]) * 1e3 for name in ("old", "new"))
    print(f"{a.dtype}{f' {a.quantize}' if a.quantize else ''}, batch {a.batch}, context {a.context}, "
          f"{len(ratios)} steps each: old {old:.2f} ms, new {new:.2f} ms a step; old/new per step median "
          f"{statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f}); "
          f"{'the same tokens at every step' if same else 'DIFFERENT tokens'}")


if __name__ == "__main__":
    main()
