"""The C decode-attention kernel of two source versions, timed alternately in one process: a batch of
sequences over a float32 (or bf16) paged pool with SmolLM2's heads.

    python benchmarks/decode_attention_ab.py OLD_CSRC [NEW_CSRC] [--batch 64] [--context 256] [--rounds 20]
                                             [--layers 30] [--tables random|ordered|served] [--block-size 64]

NEW_CSRC defaults to this checkout's workers/kernels/csrc, the kernel library's sources; OLD_CSRC is any
other version of that folder (say ``mkdir /tmp/old && git archive HEAD~1 workers/kernels/csrc | tar -x -C
/tmp/old``, then /tmp/old/workers/kernels/csrc). Each round times one call of each, in turn,
so both see the same machine; prints the median per call and OLD/NEW. ``--layers``: a pool of that many
layers, called one after the other like a step's layers (30, SmolLM2's, reads K/V from memory as a served
step does; 1 keeps one layer's pool in cache). ``--tables``: each sequence's blocks drawn at random from the
pool, consecutive, or as a served c=64 run places them (each sequence's 128-token prompt in consecutive blocks,
then the blocks its decode steps take, one sequence after another, so that one sequence's decode blocks lie a
batch apart). ``--block-size``: positions per block (64, the CPU default). The pools are on 2 MB pages, as a
rank's are (workers/group.py sets THP_MEM_ALLOC_ENABLE).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

from llmbus.workers.group import THP_MEM_ALLOC_ENABLE

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", THP_MEM_ALLOC_ENABLE)  # before torch's first allocation, as a rank

import torch

from llmbus.workers.attention.decode_kernel import DecodeAttentionKernel
from llmbus.workers.kernels import bindings, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new", nargs="?", default=str(build.SOURCE_DIR))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (SmolLM2's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tables", default="random", choices=["random", "ordered", "served"])
    p.add_argument("--block-size", type=int, default=64)
    a = p.parse_args()
    kernels = {}
    for name, source in (("old", a.old), ("new", a.new)):
        library = bindings.bind(ctypes.CDLL(str(build.build(build.find_compiler(), Path(source).resolve()))))
        kernels[name] = DecodeAttentionKernel(library)
    num_heads, num_kv_heads, head_dim = (int(v) for v in a.heads.split(","))
    dtype, block_size = getattr(torch, a.dtype), a.block_size
    blocks_per_seq = -(-a.context // block_size)
    torch.manual_seed(0)
    pools = [[torch.randn(num_kv_heads, a.batch * blocks_per_seq + 1, block_size, head_dim).to(dtype)
              for _ in range(2)] for _ in range(a.layers)]
    if a.tables == "served":
        prompt_blocks = min(-(-128 // block_size), blocks_per_seq)
        prompts = torch.arange(a.batch * prompt_blocks).view(a.batch, prompt_blocks)
        decodes = torch.arange(a.batch * prompt_blocks, a.batch * blocks_per_seq)
        tables = torch.cat([prompts, decodes.view(blocks_per_seq - prompt_blocks, a.batch).T], dim=1)
    else:
        order = torch.randperm if a.tables == "random" else torch.arange
        tables = order(a.batch * blocks_per_seq).view(a.batch, blocks_per_seq)
    lens = torch.full((a.batch,), a.context, dtype=torch.long)
    starts = torch.zeros(a.batch, dtype=torch.long)
    query = torch.randn(a.batch, num_heads, head_dim).to(dtype)
    times = {name: [] for name in kernels}
    outs = {}
    for _ in range(a.rounds):
        for name, kernel in kernels.items():
            t0 = time.perf_counter()
            outs[name] = [kernel(query, *pool, tables, lens, starts, a.context, head_dim ** -0.5) for pool in pools]
            times[name].append(time.perf_counter() - t0)
    for old_out, new_out in zip(outs["old"], outs["new"]):
        torch.testing.assert_close(new_out.float(), old_out.float(), rtol=1e-4, atol=1e-5)
    same = all(torch.equal(o, n) for o, n in zip(outs["old"], outs["new"]))
    old, new = (statistics.median(times[n]) * 1e3 for n in ("old", "new"))
    print(f"batch {a.batch}, context {a.context}, {a.dtype}, heads {a.heads}, {a.layers} layers, {a.tables} tables: "
          f"old {old:.3f} ms, new {new:.3f} ms per step; old/new {old / new:.2f}x "
          f"(outputs {'bitwise equal' if same else 'agree within 1e-4'})")


if __name__ == "__main__":
    main()
