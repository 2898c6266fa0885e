"""Decode-step time of llmbus's ModelRunner beside transformers' forward with a static KV cache.

    python benchmarks/decode_step.py [--model-id DIR] [--batches 1,8,32,64] [--context 128] [--steps 16]

Same checkpoint (default: the demo `small` model), same dtype (bfloat16 by default), same batch sizes,
measured in this run, interleaved (llmbus then transformers per batch size, best of ``--repeats``), so
machine noise hits both sides alike. Every sequence has ``--context`` tokens in its KV cache when the
timed steps start.

- llmbus: one ``ModelRunner.step`` per decode step: block-table metadata, forward over the paged KV
  cache, greedy sampling and the copy of the sampled ids to Python lists — the whole step.
- transformers: ``model(input_ids, past_key_values=StaticCache, cache_position=...)`` per step, the
  forward only (no sampling, no generate loop), the cheapest thing transformers can do per step.

Also measured here: memory read bandwidth (``x.sum()`` over 1 GiB, best of 11), from which the batch-1
bandwidth bound is weights_bytes / bandwidth; the script prints llmbus's batch-1 step against it.
Targets (issue #3): llmbus / transformers <= 1.0 at every batch size; batch-1 bound / llmbus >= 0.70.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _server import default_model_dir
from roofline import read_bandwidth, weight_bytes

from llmbus.bus.messages import SamplingParams
from llmbus.workers.host_memory import keep_freed_memory
from llmbus.workers.model_runner import ModelRunner, SeqInput

BLOCK_SIZE = 16


class LlmbusDecode:
    def __init__(self, model_dir: str, dtype: torch.dtype, max_batch: int, context: int, steps: int,
                 quantize: str | None = None, least_pool: bool = False):
        keep_freed_memory()  # as the worker process does on CPU
        tokens_per_seq = context + steps + 1
        blocks_per_seq = -(-tokens_per_seq // BLOCK_SIZE)
        # The server's default pool (DEFAULT_KV_CACHE_BYTES), or more if the batches need it: the pool's
        # size decides whether decode attention may keep its gathered K/V between steps (attention.py).
        # ``least_pool``: only the blocks the batches need (a dry run's: zeroing the default pool takes
        # seconds of a loaded CPU host's time).
        self.runner = ModelRunner(model_dir, dtype=dtype, block_size=BLOCK_SIZE, max_batch_prefill_tokens=2048,
                                  quantize=quantize,
                                  **({"num_blocks": max_batch * blocks_per_seq + 1} if least_pool else {}))
        if self.runner.num_blocks < max_batch * blocks_per_seq + 1:
            self.runner = ModelRunner(model_dir, dtype=dtype, block_size=BLOCK_SIZE,
                                      num_blocks=max_batch * blocks_per_seq + 1, max_batch_prefill_tokens=2048,
                                      quantize=quantize)
        self.runner.warmup()
        self.context, self.blocks_per_seq, self.vocab = context, blocks_per_seq, self.runner.model.config.vocab_size

    def _seqs(self, batch: int, tokens: list[list[int]], computed: int) -> list[SeqInput]:
        return [SeqInput(rid=f"b{batch}-{i}", token_ids=tokens[i], num_computed=computed,
                         block_table=list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)),
                         sample=True, sampling=SamplingParams())
                for i in range(batch)]

    def prefill(self, batch: int) -> list[int]:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, self.vocab, (batch, self.context), generator=gen).tolist()
        last = []
        for start in range(0, batch, max(1, 2048 // self.context)):  # prefill in budget-sized groups
            group = list(range(start, min(batch, start + max(1, 2048 // self.context))))
            seqs = [s for s in self._seqs(batch, prompts, 0) if int(s.rid.split("-")[1]) in group]
            last += self.runner.step(seqs).token_ids
        return last

    def decode(self, batch: int, last: list[int], computed: int) -> tuple[float, list[int]]:
        """One decode step feeding each sequence its ``last`` token after ``computed`` cached ones: its
        seconds and the sampled tokens."""
        seqs = self._seqs(batch, [[t] for t in last], computed)
        t0 = time.perf_counter()
        tokens = self.runner.step(seqs).token_ids
        return time.perf_counter() - t0, tokens

    def time_steps(self, batch: int, steps: int) -> float:
        """Median seconds per decode step over ``steps`` steps after a fresh prefill."""
        last = self.prefill(batch)
        times = []
        for k in range(steps):
            seconds, last = self.decode(batch, last, self.context + k)
            times.append(seconds)
        self.runner.drop([f"b{batch}-{i}" for i in range(batch)])
        return statistics.median(times)


def best_medians(sides: dict[str, LlmbusDecode], batches: list[int], steps: int,
                 repeats: int) -> dict[str, dict[int, float]]:
    """{side: {batch: the best of ``repeats`` median step seconds}}, the sides taking turns at each batch size
    so that the machine's drift hits them alike."""
    best: dict[str, dict[int, float]] = {name: {} for name in sides}
    for _ in range(repeats):
        for batch in batches:
            for name, side in sides.items():
                seconds = side.time_steps(batch, steps)
                best[name][batch] = min(best[name].get(batch, float("inf")), seconds)
    return best


def add_timing_options(p, batches: str, steps: int, dry_run: str) -> None:
    """``best_medians``' options: the batch sizes, each sequence's context, the steps timed, the alternated
    rounds; and ``--dry-run`` (``dry_run`` its help)."""
    p.add_argument("--batches", default=batches)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best median counts")
    p.add_argument("--dry-run", action="store_true", help=dry_run)


def timing_of(a, dry_batches: list[int]) -> tuple[list[int], int, int, int]:
    """(batches, steps, repeats, context) of ``add_timing_options``' options; a dry run's are ``dry_batches``,
    3 steps, one round and 16 tokens of context."""
    if a.dry_run:
        return dry_batches, 3, 1, 16
    return [int(b) for b in a.batches.split(",")], a.steps, a.repeats, a.context


class TransformersDecode:
    def __init__(self, model_dir: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.vocab = self.model.config.vocab_size

    def time_steps(self, batch: int, context: int, steps: int) -> float:
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=context + steps + 1)
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, self.vocab, (batch, context), generator=gen)
        with torch.inference_mode():
            out = self.model(prompts, past_key_values=cache, cache_position=torch.arange(context), use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for k in range(steps):
                position = torch.tensor([context + k])
                t0 = time.perf_counter()
                out = self.model(next_ids, past_key_values=cache, cache_position=position, use_cache=True)
                times.append(time.perf_counter() - t0)
                next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="local model folder (default: the demo small model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best median counts")
    a = p.parse_args()
    a.model_id = a.model_id or default_model_dir()
    dtype = getattr(torch, a.dtype)
    batches = [int(b) for b in a.batches.split(",")]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}, context {a.context}, "
          f"{a.steps} timed steps, best of {a.repeats} rounds")
    bandwidth = read_bandwidth(reduce=min)  # the highest bandwidth seen makes the bound the strictest
    ours = LlmbusDecode(a.model_id, dtype, max(batches), a.context, a.steps)
    theirs = TransformersDecode(a.model_id, dtype)
    wbytes = weight_bytes(a.model_id, dtype)
    bound = wbytes / bandwidth
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per step {wbytes / 1e6:.1f} MB; "
          f"batch-1 bandwidth bound {bound * 1e3:.2f} ms/step ({1 / bound:.0f} tok/s)")

    results = {}
    for batch in batches:
        best_ours, best_theirs = float("inf"), float("inf")
        for _ in range(a.repeats):
            best_ours = min(best_ours, ours.time_steps(batch, a.steps))
            best_theirs = min(best_theirs, theirs.time_steps(batch, a.context, a.steps))
        results[batch] = (best_ours, best_theirs)

    print(f"\n{'batch':>5} {'llmbus ms':>10} {'transformers ms':>16} {'llmbus/transformers':>20} "
          f"{'llmbus tok/s':>13}")
    for batch, (o, t) in results.items():
        print(f"{batch:>5} {o * 1e3:>10.2f} {t * 1e3:>16.2f} {o / t:>20.2f} {batch / o:>13.0f}")
    if 1 in results:
        print(f"\nbatch-1 step vs bandwidth bound: {bound / results[1][0]:.2f} of the bound (target >= 0.70)")
    worst = max(o / t for o, t in results.values())
    print(f"worst llmbus/transformers ratio: {worst:.2f} (target <= 1.00)")


if __name__ == "__main__":
    main()
