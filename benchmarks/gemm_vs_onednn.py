"""Prompt and batch-64 decode steps of one float32 runner with its dense projections and LM head computed
through ``workers/gemm.c`` on the plain ``[out, in]`` weights and through oneDNN with a weight reordered
for it (what ``Linear`` used before gemm.c, and still uses where gemm.c does not run), alternating step by
step in one process, so both see the same machine.

    python benchmarks/gemm_vs_onednn.py [--model-id DIR] [--batch 64] [--context 128] [--steps 24]

The decode steps run the torch layers (the fused layer's own batch-64 path calls gemm.c directly, with
no oneDNN alternative), so the projections' GEMMs are the only difference. Prints the median step of
each and onednn/gemm (above 1: gemm.c is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _server import default_model_dir
from decode_step import LlmbusDecode
from llmbus.workers.linear import PACK_BATCH_HINT


def timed_alternately(use_gemm, make_step, steps: int) -> dict[bool, float]:
    times = {True: [], False: []}
    for k in range(steps):
        gemm = k % 2 == 0
        use_gemm(gemm)
        times[gemm].append(make_step(k))
    return {gemm: statistics.median(t) * 1e3 for gemm, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="local model folder (default: the demo small model)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompts", type=int, default=16, help="prompts of --context tokens in the prefill step")
    a = p.parse_args()
    a.model_id = a.model_id or default_model_dir()
    bench = LlmbusDecode(a.model_id, torch.float32, max(a.batch, a.prompts), a.context, a.steps)
    model = bench.runner.model
    if model.fused_decode is not None:
        model.fused_decode._large_batches = False  # batches past 8 rows take the torch layers and Linear
    projections = [p for layer in model.layers
                   for p in (layer.attention.qkv, layer.attention.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    projections.append(model.lm_head)
    if not all(getattr(p, "gemm", None) is not None for p in projections):
        raise SystemExit("gemm.c does not compute this runner's projections (not float32 on an AVX2 CPU)")
    gemm = projections[0].gemm
    onednn_copies = [torch.ops.mkldnn._reorder_linear_weight(p.weight, PACK_BATCH_HINT) for p in projections]

    def use_gemm(on: bool) -> None:
        for projection, copy in zip(projections, onednn_copies):
            projection.gemm, projection.packed = (gemm, None) if on else (None, copy)

    last = bench.prefill(a.batch)

    def decode(k: int) -> float:
        nonlocal last
        seconds, last = bench.decode(a.batch, last, a.context + k)
        return seconds

    decode_ms = timed_alternately(use_gemm, decode, a.steps)
    bench.runner.drop([f"b{a.batch}-{i}" for i in range(a.batch)])
    prompts = torch.randint(3, bench.vocab, (a.prompts, a.context), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill(k: int) -> float:
        seqs = bench._seqs(a.prompts, prompts, 0)
        t0 = time.perf_counter()
        bench.runner.step(seqs)
        elapsed = time.perf_counter() - t0
        bench.runner.drop([s.rid for s in seqs])
        return elapsed

    prefill_ms = timed_alternately(use_gemm, prefill, 6)
    for name, ms in ((f"decode step, batch {a.batch}", decode_ms), (f"prefill {a.prompts}x{a.context}", prefill_ms)):
        print(f"{name}: oneDNN {ms[False]:.1f} ms, gemm.c {ms[True]:.1f} ms, onednn/gemm {ms[False] / ms[True]:.2f}x")


if __name__ == "__main__":
    main()
