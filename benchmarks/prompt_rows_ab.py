"""Prompt steps through the fused C layer (every prompt token a kernel row: ``CPUKernelBackend.prompt_rows``)
against the torch layers with SDPA, alternating step by step in one runner, so both see the same machine.

    python benchmarks/prompt_rows_ab.py [--model-id DIR] [--shapes 1x128,32x128,1x1024] [--rounds 5]

Float32 (where the fused layer takes steps of any size: gemm.c built, AVX2 without AVX-512). Each shape
``NxL`` is N fresh prompts of L tokens in one step; both ways compute the same step into their own blocks
and their last rows' greedy tokens must agree. Prints each way's median step and torch/rows (above 1: the
rows are faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _server import default_model_dir
from llmbus.bus.messages import SamplingParams
from llmbus.workers.host_memory import keep_freed_memory
from llmbus.workers.model_runner import ModelRunner, SeqInput

BLOCK_SIZE = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="local model folder (default: the demo small model)")
    p.add_argument("--shapes", default="1x128,32x128,1x1024")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    keep_freed_memory()  # as the worker process does on CPU
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    blocks = max(2 * n * -(-length // BLOCK_SIZE) for n, length in shapes) + 1
    runner = ModelRunner(a.model_id or default_model_dir(), dtype=torch.float32, block_size=BLOCK_SIZE,
                         num_blocks=blocks, max_batch_prefill_tokens=max(n * length for n, length in shapes))
    runner.warmup()
    backend = runner.model.attention_backend
    if not getattr(backend, "prompt_rows", False):
        raise SystemExit("prompt rows are off here (no fused layer taking large batches): nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, block size {BLOCK_SIZE}")
    vocab = runner.model.config.vocab_size
    for n, length in shapes:
        per_seq = -(-length // BLOCK_SIZE)
        prompts = torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(length)).tolist()
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {}
        for k in range(2 * a.rounds):
            rows = k % 2 == 0
            backend.prompt_rows = rows
            offset = 0 if rows else n * per_seq
            seqs = [SeqInput(rid=f"{rows}-{i}", token_ids=prompts[i], num_computed=0,
                             block_table=list(range(offset + i * per_seq, offset + (i + 1) * per_seq)), sample=True,
                             sampling=SamplingParams()) for i in range(n)]
            t0 = time.perf_counter()
            tokens[rows] = runner.step(seqs).token_ids
            times[rows].append(time.perf_counter() - t0)
            runner.drop([s.rid for s in seqs])
        backend.prompt_rows = True
        if tokens[True] != tokens[False]:
            raise SystemExit(f"{n}x{length}: the two ways sampled different tokens")
        rows_s, torch_s = statistics.median(times[True]), statistics.median(times[False])
        print(f"{n}x{length}: rows {rows_s * 1e3:.0f} ms, torch {torch_s * 1e3:.0f} ms, torch/rows {torch_s / rows_s:.3f} "
              f"({n * length / rows_s:.0f} vs {n * length / torch_s:.0f} prompt tok/s)", flush=True)


if __name__ == "__main__":
    main()
