"""Where a ModelRunner step's time goes: torch.profiler's per-op table for decode steps at several batch
sizes and for a prefill step, plus the wall time of each.

    python benchmarks/model_profile.py [--model-id DIR] [--batches 1,16,64] [--prefill 32x128]
                                       [--rows 20] [--context 128] [--quantize int8]

Decode: every sequence has ``--context`` tokens cached, then 5 steps are profiled after 3 unprofiled
ones. Prefill: ``--prefill NxL`` is N prompts of L tokens computed in one step (the scheduler's default
budget of 4096 tokens holds 32 prompts of 128). The table is sorted by self CPU time; the profiler adds
a few microseconds per op, so the wall times printed beside it (median of unprofiled steps) are the
ones to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from _server import default_model_dir
from decode_step import LlmbusDecode


def decode_steps(bench: LlmbusDecode, batch: int, steps: int, start: int) -> tuple[list[float], int]:
    last = bench.prefill(batch)
    times = []
    for k in range(steps):
        seconds, last = bench.decode(batch, last, start + k)
        times.append(seconds)
    return times, last


def profile_decode(bench: LlmbusDecode, batch: int, context: int, rows: int) -> None:
    times, _ = decode_steps(bench, batch, 8, context)
    bench.runner.drop([f"b{batch}-{i}" for i in range(batch)])
    last = bench.prefill(batch)
    for k in range(3):
        last = bench.runner.step(bench._seqs(batch, [[t] for t in last], context + k)).token_ids
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(3, 8):
            last = bench.runner.step(bench._seqs(batch, [[t] for t in last], context + k)).token_ids
    bench.runner.drop([f"b{batch}-{i}" for i in range(batch)])
    print(f"\n=== decode, batch {batch}: median step {statistics.median(times[3:]) * 1e3:.2f} ms "
          f"({batch / statistics.median(times[3:]):.0f} tok/s); profile of 5 steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def profile_prefill(bench: LlmbusDecode, num: int, length: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, bench.vocab, (num, length), generator=gen).tolist()

    def step():
        seqs = bench._seqs(num, prompts, 0)
        t0 = time.perf_counter()
        bench.runner.step(seqs)
        return time.perf_counter() - t0

    times = [step() for _ in range(3)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    bench.runner.drop([f"b{num}-{i}" for i in range(num)])
    wall = statistics.median(times)
    print(f"\n=== prefill, {num} prompts x {length} tokens in one step: median {wall * 1e3:.1f} ms "
          f"({num * length / wall:.0f} prompt tok/s); profile of 1 step:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="local model folder (default: the demo small model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prefill", default="32x128", help="NxL: N prompts of L tokens in one step ('' to skip)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--quantize", default=None, choices=["int8", "int4"])
    a = p.parse_args()
    a.model_id = a.model_id or default_model_dir()
    batches = [int(b) for b in a.batches.split(",") if b]
    num, length = (int(v) for v in a.prefill.split("x")) if a.prefill else (0, 0)
    bench = LlmbusDecode(a.model_id, getattr(torch, a.dtype), max([*batches, num]),
                         max(a.context, length), 16, quantize=a.quantize)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}, quantize={a.quantize}, "
          f"{bench.runner.compute_paths}")
    for batch in batches:
        profile_decode(bench, batch, a.context, a.rows)
    if num:
        profile_prefill(bench, num, length, a.rows)


if __name__ == "__main__":
    main()
