"""LoRA adapters in benchmarks/gpu_check.py (``LoraPart``, a base of its ``Check``): in part 1, the tiny Llama
with half its sequences on two PEFT adapters against PEFT's float32 tokens, through the graphs and eagerly; in
part 4, the 8B shape's decode step with a rank-``LORA_RANK`` adapter on every projection, on every row and on
half of them, against the base model's graph step.

Not a benchmark itself: gpu_check.py runs it (parts 1 and 4).
"""

from __future__ import annotations

import copy
import random
import statistics
import time

import torch

from _runner_steps import count_replays, graph_modes, timed_steps

from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import drive
from llmbus.workers.model_runner import SeqInput

LORA_RANK = 16  # part 4's adapter, on every projection


class LoraPart:
    """Uses ``Check``'s ``row``, ``runner``, ``_reference`` (part 1's checkpoint, tokens and requests, whose
    blocks ``tiny_blocks`` pools), ``work``, ``device`` and ``sizes``."""

    def lora_greedy(self) -> None:
        """The Llama of part 1 with two PEFT adapters, r1 and r3 (r3 preempted) on one, r2 on the other, the
        rest (the prefix hit's donor and borrower among them) on the base model."""
        from llmbus.testing.lora import lora_reference, on_adapters, save_lora_adapter

        t0 = time.perf_counter()
        ref, template = self._reference("llama3_gqa")
        path, prompts = ref["path"], ref["prompts"]
        adapters = {"all": save_lora_adapter(path, str(self.work / "lora-all"), ["q_proj", "k_proj", "v_proj",
                                             "o_proj", "gate_proj", "up_proj", "down_proj"], seed=1),
                    "qv": save_lora_adapter(path, str(self.work / "lora-qv"), ["q_proj", "v_proj"], seed=2)}
        adapter_of = {"r1": "all", "r3": "all", "r2": "qv"}
        index = {r.rid: i for i, r in enumerate(template)}
        expected = {rid: ref["tokens"][i] for rid, i in index.items()}
        for name, folder in adapters.items():
            wanted = [rid for rid, a in adapter_of.items() if a == name]
            tokens = lora_reference(path, folder, [prompts[index[rid]] for rid in wanted]).tokens
            expected.update(zip(wanted, tokens))
        runner = self.runner(path, torch.float32, num_blocks=self.tiny_blocks, max_batch_prefill_tokens=256,
                             lora_adapters=tuple(adapters.items()))
        for suffix, graph_sizes in graph_modes(runner):
            requests = copy.deepcopy(template)
            replays = count_replays(runner)
            results = drive(runner, on_adapters(requests, adapter_of))
            mismatched = [r.rid for r in requests if results[r.rid].tokens != expected[r.rid]]
            replayed = replays[0] > 0 or not graph_sizes  # decode steps replay, the adapters' among them
            self.row("1 float32 greedy", "llama3_gqa lora" + suffix, not mismatched and replayed,
                     f"{len(requests) - len(mismatched)}/{len(requests)} sequences token-exact, 3 on two LoRA "
                     f"adapters against PEFT's ({replays[0]} steps replayed CUDA graphs)",
                     backend=runner.compute_paths["attention"], device=str(self.device), mismatched=mismatched,
                     adapters=adapter_of, cuda_graphs=graph_sizes, graph_replays=replays[0],
                     seconds=round(time.perf_counter() - t0, 1))
        del runner

    def lora_steps(self, runner, config: dict, per_seq: int, blocks: list[int],
                   graph_step: dict[tuple[int, int], float], rng: random.Random) -> None:
        """Part 4's runner (loaded with adapter "lora") at the shortest context, batch 1 and the largest: the
        step with the adapter on every row and on half of them, as a ratio to ``graph_step`` (the base model's
        step of that shape)."""
        sizes, context = self.sizes, min(self.sizes.contexts)
        for batch in (1, max(sizes.batches)):
            for share, on_adapter in (("every row", batch), ("half the rows", batch // 2)):
                if not on_adapter:
                    continue
                seqs = [SeqInput(f"l{i}", [rng.randrange(3, config["vocab_size"])], context,
                                 blocks[i * per_seq:(i + 1) * per_seq], True, SamplingParams(), context,
                                 adapter="lora" if i < on_adapter else "") for i in range(batch)]
                times = timed_steps(runner, seqs, 3, sizes.timed_steps)
                step, base = statistics.median(times), graph_step[batch, context]
                self.row("4 speed", f"decode b{batch} ctx{context} lora r{LORA_RANK} on {share}", True,
                         f"{step * 1e3:.2f} ms/step ({step / base:.2f}x the base model's step, {base * 1e3:.2f} ms)",
                         backend=runner.compute_paths["attention"], device=str(self.device), dtype="bfloat16",
                         batch=batch, context=context, lora_rows=on_adapter, step_ms=step * 1e3,
                         step_ms_all=[t * 1e3 for t in times], base_step_ms=base * 1e3)
