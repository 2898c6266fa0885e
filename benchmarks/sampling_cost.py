"""What each sampling feature costs per step, as a ratio to greedy argmax on the same logits.

One decode step's sampling for 64 rows over a 32,000-token vocabulary (the demo model's size class),
on this machine: greedy; seeded sampling with temperature, top-k, top-p and typical-p; the same with
top_n_tokens=5; with the watermark (green lists cached, as in a steady stream); and with the three
penalties over a 600-token history. Medians of 30 runs, in one process, so the ratios are comparable.

    python benchmarks/sampling_cost.py [--rows 64] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmbus.bus.messages import SamplingParams
from llmbus.workers.sampling import sample


def _median_ms(fn, runs: int = 30) -> float:
    fn()  # warm: caches, allocator
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3
    positions = list(range(100, 100 + args.rows))
    last = [int(i) for i in torch.randint(0, args.vocab, (args.rows,))]
    histories = [torch.randint(0, args.vocab, (600,)) for _ in range(args.rows)]
    prompt_lens = [500] * args.rows
    warped = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, typical_p=0.95)
    cases = {
        "greedy": [SamplingParams() for _ in range(args.rows)],
        "sampled (temperature, top-k, top-p, typical-p)": [
            SamplingParams(seed=i, **warped) for i in range(args.rows)],
        "sampled + top_n_tokens=5": [
            SamplingParams(seed=i, top_n_tokens=5, **warped) for i in range(args.rows)],
        "sampled + watermark": [SamplingParams(seed=i, watermark=True, **warped) for i in range(args.rows)],
        "sampled + repetition, frequency, presence penalties": [
            SamplingParams(seed=i, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                           **warped) for i in range(args.rows)],
    }
    base = None
    print(f"{args.rows} rows x {args.vocab} vocab, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name, params in cases.items():
        ms = _median_ms(lambda params=params: sample(logits, params, positions, histories, last, prompt_lens))
        base = base or ms
        print(f"  {name:55s} {ms:8.2f} ms  {ms / base:6.2f}x greedy")


if __name__ == "__main__":
    main()
