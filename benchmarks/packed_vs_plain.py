"""Prompt and batch-64 decode steps of one runner with its dense projections computed through the plain
``[out, in]`` weights (``F.linear``: MKL packs the weight on every call) and through oneDNN's packed copy,
alternating step by step in one process, so both see the same machine.

    python benchmarks/packed_vs_plain.py [--model-id DIR] [--batch 64] [--context 128] [--steps 24]

Where the fused decode layer applies (float32, one rank, CPU) the projections keep both forms
(``weight_builder.SECOND_COPY_SHARE``); this measures what the second copy buys. Prints the median step
of each and plain/packed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_step import LlmbusDecode


def timed_alternately(use_packed, make_step, steps: int) -> dict[bool, float]:
    times = {True: [], False: []}
    for k in range(steps):
        packed = k % 2 == 0
        use_packed(packed)
        times[packed].append(make_step(k))
    return {packed: statistics.median(t) * 1e3 for packed, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="local model folder (default: the demo small model)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompts", type=int, default=16, help="prompts of --context tokens in the prefill step")
    a = p.parse_args()
    if a.model_id is None:
        from llmbus.supervisor.demo_model import demo_model_dir
        a.model_id = str(demo_model_dir("small"))
    bench = LlmbusDecode(a.model_id, torch.float32, max(a.batch, a.prompts), a.context, a.steps)
    projections = [p for layer in bench.runner.model.layers
                   for p in (layer.attention.qkv, layer.attention.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    if not all(getattr(p, "plain", False) and p.packed is not None for p in projections):
        raise SystemExit("this runner's projections do not keep both forms (not the fused decode path here)")
    packed_copies = [p.packed for p in projections]

    def use_packed(packed: bool) -> None:
        for projection, copy in zip(projections, packed_copies):
            projection.packed = copy if packed else None

    last = bench.prefill(a.batch)

    def decode(k: int) -> float:
        nonlocal last
        seconds, last = bench.decode(a.batch, last, a.context + k)
        return seconds

    decode_ms = timed_alternately(use_packed, decode, a.steps)
    bench.runner.drop([f"b{a.batch}-{i}" for i in range(a.batch)])
    prompts = torch.randint(3, bench.vocab, (a.prompts, a.context), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill(k: int) -> float:
        seqs = bench._seqs(a.prompts, prompts, 0)
        t0 = time.perf_counter()
        bench.runner.step(seqs)
        elapsed = time.perf_counter() - t0
        bench.runner.drop([s.rid for s in seqs])
        return elapsed

    prefill_ms = timed_alternately(use_packed, prefill, 6)
    for name, ms in ((f"decode step, batch {a.batch}", decode_ms), (f"prefill {a.prompts}x{a.context}", prefill_ms)):
        print(f"{name}: plain {ms[False]:.1f} ms, packed {ms[True]:.1f} ms, plain/packed {ms[False] / ms[True]:.2f}x")


if __name__ == "__main__":
    main()
