"""What M-RoPE adds to a step's host work (Qwen2-VL, Qwen2.5-VL: ``workers/mrope.py``): the rows' [3]
positions computed from their sequences' images, against the step's attention metadata built in the same run
(``build_metadata``: block tables, positions and slots, the host work every step does anyway).

    python benchmarks/mrope_positions.py [--batches 1,16,64,256] [--images 2] [--context 1024]

Decode steps (one row a sequence, each sequence ``--context`` tokens in with ``--images`` images in its
prompt) and one prompt step of a 1,024-token prompt with ``--images`` images, on one thread; each figure
the fastest of ``--repeats``. The ratio is M-RoPE's time over the metadata's.
"""

from __future__ import annotations

import argparse
import functools
import os

from _timing import fastest_s

os.environ.setdefault("OMP_NUM_THREADS", "1")


BLOCK_SIZE = 16


def sequence(rid: str, computed: int, new: int, images: int):
    from llmbus.bus.messages import ImageInput, SamplingParams
    from llmbus.workers.seq_input import SeqInput

    rows, cols = 18, 24  # a 672x504 photo at Qwen2-VL's 28-pixel merged patches: 432 placeholders
    placed = [ImageInput(offset=32 + i * (rows * cols + 64), num_tokens=rows * cols, data=b"", digest=bytes(16),
                         grid=[rows, cols]) for i in range(images)]
    blocks = list(range(-(-(computed + new) // BLOCK_SIZE)))
    return SeqInput(rid=rid, token_ids=[1] * new, num_computed=computed, block_table=blocks, sample=True,
                    sampling=SamplingParams(), prompt_len=computed + new, images=placed)


def main() -> None:
    import torch

    from llmbus.workers.attention import make_attention_backend
    from llmbus.workers.kv_cache import PagedKVCache
    from llmbus.workers.mrope import mrope_positions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    backend = make_attention_backend(device, (None,))
    # the pool's shape matters to the metadata only through the kernel it picks: Qwen2-VL-7B's heads
    kv_cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=4, head_dim=128,
                            dtype=torch.bfloat16, device=device)
    steps = [(f"decode b{b}", [sequence(f"r{i}", args.context, 1, args.images) for i in range(b)])
             for b in map(int, args.batches.split(","))]
    steps.append(("prompt 1024", [sequence("p", 0, 1024, args.images)]))
    print(f"{'step':<14} {'metadata us':>12} {'mrope us':>10} {'ratio':>7}")
    for name, seqs in steps:
        lens = [len(s.token_ids) for s in seqs]
        metadata = functools.partial(backend.build_metadata, query_lens=lens,
                                     num_computed=[s.num_computed for s in seqs],
                                     block_tables=[s.block_table for s in seqs], kv_cache=kv_cache, device=device)
        meta_us = fastest_s(metadata, args.repeats) * 1e6
        mrope_us = fastest_s(functools.partial(mrope_positions, seqs, lens, device), args.repeats) * 1e6
        print(f"{name:<14} {meta_us:>12.1f} {mrope_us:>10.1f} {mrope_us / meta_us:>7.2f}")

if __name__ == "__main__":
    main()
