"""Host time a replayed decode step spends staging its rows (``DecodeGraphs._stage``), per step.

    python benchmarks/graph_staging.py [--rows 64] [--device cpu|cuda]

What is timed: the rows' slots and the blocks appended to their tables packed into the pinned buffer and
the one copy, as ``DecodeGraphs.forward`` runs it before a replay (the device work after it, the tables
grown and gathered and each row's KV slot, is the graph's first kernel since run 8, not host time). On the
CPU the buffers are host tensors: the figure is Python and torch dispatch; on a GPU it adds the copy's
launch, which is what a served step at c=64 waits for on the host (design notes, "What a served GPU step is
made of"). Rows decode one token a step
from staggered positions, so some cross a block boundary every step and append a block, as in serving. The
last step's staged ids, positions and KV slots are checked against the block tables (that step staged again
with every table uploaded whole, then unpacked).

Compare two revisions by running this in each checkout, interleaved (../.library's farm-bench).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the Triton backend's graph metadata, off a GPU
    from _random_llama import write_random_llama  # (imports the runner: after TRITON_INTERPRET is set)

    from llmbus.bus.messages import SamplingParams
    from llmbus.testing.runner_driver import BLOCK_SIZE, TINY_LLAMA
    from llmbus.workers.cuda_graphs import DecodeGraphs
    from llmbus.workers.model_runner import ModelRunner, SeqInput

    # runner_driver's tiny Llama, written without importing transformers (most of a short run's time); its
    # weights' values do not matter to the staging. 256 positions: 200 steps from 16 to 31 fit.
    folder = write_random_llama(tempfile.mkdtemp(prefix="graph-staging-"),
                                {**TINY_LLAMA, "vocab_size": 256, "tie_word_embeddings": False})
    context, steps = 256, 200
    runner = ModelRunner(folder, block_size=BLOCK_SIZE, num_blocks=args.rows * (context // BLOCK_SIZE + 1),
                         attention_backend="triton", device=torch.device(args.device))
    graphs = DecodeGraphs(runner.model, runner.kv_cache, (args.rows,), context // BLOCK_SIZE, capture=False)
    torch.set_num_threads(1)
    per_row = context // BLOCK_SIZE
    tables = [[i * per_row, i * per_row + 1] for i in range(args.rows)]
    times = []
    for step in range(steps):
        seqs = []
        for i, table in enumerate(tables):
            position = BLOCK_SIZE + i % BLOCK_SIZE + step
            while len(table) <= position // BLOCK_SIZE:
                table.append(table[-1] + 1)
            seqs.append(SeqInput(rid=f"r{i}", token_ids=[5], num_computed=position, block_table=table, sample=True,
                                 sampling=SamplingParams()))
        started = time.perf_counter()
        graphs._stage(seqs, args.rows)
        times.append(time.perf_counter() - started)
        if args.device == "cuda":
            graphs._unpack(args.rows)  # what a replay runs first (interpreted on the CPU: too slow to interleave)
    graphs.forget([s.rid for s in seqs])  # the last step again, every table uploaded whole, then checked
    graphs._stage(seqs, args.rows)
    graphs._unpack(args.rows)
    small = graphs.small.cpu()
    for i, seq in enumerate(seqs):
        p = seq.num_computed
        assert small[0, i] == 5 and small[1, i] == p, f"row {i}: ids or positions staged wrongly"
        assert small[2, i] == seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE, f"row {i}: KV slot"
    print(f"staging {args.rows} rows on {args.device}: median {statistics.median(times[20:]) * 1e6:.1f} us a step "
          f"(of {steps - 20} steps)")


if __name__ == "__main__":
    main()
