"""What LoRA adds to one CPU decode step, in process: steps of ``--batch`` rows all on a rank-``--rank`` adapter
(every projection) against the same rows on the base model, on one ``ModelRunner``, interleaved round by round
(which goes first alternates); prints the median of the rounds' differences of median step times.

    python benchmarks/lora_step.py [--model-id DIR] [--dtype bfloat16] [--batch 8] [--rank 16] [--rounds 12]

A served run (``lora_cost.py``) sees this difference inside tokens/s and the machine's noise; this isolates
the fused layer's ``lora_add`` (decode_layer.c). Default model: SmolLM2-135M's dense bfloat16 folder
(``_smollm2.dense_folder``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.lora import save_lora_adapter
from llmbus.workers.model_runner import ModelRunner, SeqInput

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONTEXT = 100
STEPS = 15  # a round's steps of each kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    a = parser.parse_args()
    if a.model_id is None:
        from _smollm2 import dense_folder

        a.model_id = str(dense_folder(a.dtype))
    blocks_per_row = -(-(CONTEXT + 1) // 64)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = save_lora_adapter(a.model_id, f"{tmp}/adapter", MODULES, r=a.rank, alpha=2 * a.rank, b_std=0.01)
        runner = ModelRunner(a.model_id, dtype=getattr(torch, a.dtype), block_size=64,
                             num_blocks=a.batch * blocks_per_row, lora_adapters=(("lora", adapter),))

    def rows(adapter_name: str) -> list[SeqInput]:
        return [SeqInput(f"s{i}", [5], CONTEXT, list(range(i * blocks_per_row, (i + 1) * blocks_per_row)), True,
                         SamplingParams(), CONTEXT, adapter=adapter_name) for i in range(a.batch)]

    def median_step(seqs: list[SeqInput]) -> float:
        times = []
        for _ in range(STEPS):
            started = time.perf_counter()
            runner.step(seqs)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    for name in ("", "lora"):
        median_step(rows(name))  # warm
    differences, base = [], []
    for r in range(a.rounds):
        order = ("", "lora") if r % 2 else ("lora", "")
        step = {name: median_step(rows(name)) for name in order}
        differences.append(step["lora"] - step[""])
        base.append(step[""])
    print(f"{a.model_id} ({a.dtype}), batch {a.batch}, rank {a.rank} on {len(MODULES)} projections: LoRA adds "
          f"{statistics.median(differences) * 1e3:.2f} ms to a {statistics.median(base) * 1e3:.2f} ms step "
          f"(rounds: {', '.join(f'{d * 1e3:.2f}' for d in differences)})")


if __name__ == "__main__":
    main()
