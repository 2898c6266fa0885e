"""This machine's ceilings, measured with torch, and what they allow a model in tokens/s.

    python benchmarks/roofline.py [--model-id DIR] [--dtype bfloat16] [--prompt-tokens 128] [--new-tokens 128]

Two measurements, each the median of repeats (a typical run, not a lucky one):

- matmul FLOP/s: one large square GEMM in the model's dtype (oneDNN's bf16 kernels on an avx512_bf16 CPU,
  MKL's for fp32; cuBLAS on a GPU).
- memory read bandwidth: ``x.sum()`` over 1 GiB of float32 (read once, nothing written back).

And two ceilings for decoding one token of a model with ``context`` tokens already in its KV cache:

- compute: FLOP/s / FLOPs per token, where a token costs 2 FLOPs per matmul weight (every linear layer and
  the LM head; an untied embedding is a gather, not a matmul) plus the attention scores and the weighted
  sum, 2 x 2 x heads x head_dim x context per layer. At large batch, decoding is bound by this.
- bandwidth at batch 1: bandwidth / bytes a step must read, every weight once plus the sequence's K and V
  at ``context``. A single stream cannot decode faster than this.

The context is the average a decode step sees, prompt + new_tokens / 2. The compute ceiling counts decode
work only; the prompts' prefill is extra work per generated token (``compute_with_prefill`` includes it).
Sliding windows are not modelled (the demo models have none).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _seconds(fn, repeats: int, reduce: Callable[[list[float]], float] = statistics.median) -> float:
    fn()  # first call: allocation, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return reduce(times)


def matmul_flops(dtype: torch.dtype, n: int = 3072, repeats: int = 9) -> float:
    """FLOP/s of an n x n x n GEMM in ``dtype``, median of ``repeats``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _seconds(lambda: torch.mm(a, b, out=out), repeats)


def read_bandwidth(gib: float = 1.0, repeats: int = 11, reduce: Callable[[list[float]], float] = statistics.median
                   ) -> float:
    """Bytes/s of reading ``gib`` GiB once (a float32 sum), from the median of ``repeats`` timings (``reduce=min``:
    the best one, the strictest bound)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return x.nbytes / _seconds(x.sum, repeats, reduce)


def weight_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """Bytes a decode step must read: every weight once in ``dtype``. An untied embedding is only
    gathered (a few rows), so it does not count; a tied one is read whole as the LM head."""
    from llmbus.workers.loader import CheckpointReader

    element = torch.empty((), dtype=dtype).element_size()
    with CheckpointReader(model_dir) as reader:
        sizes = {name: math.prod(reader.shape(name)) for name in reader.names()}
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values()) * element


@dataclass
class ModelCost:
    """What one decoded token costs a model, from its config.json and checkpoint."""

    weight_bytes: int  # every weight a step reads, in the serving dtype
    matmul_params: int  # weights that multiply (linear layers, LM head)
    lm_head_params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int

    @classmethod
    def from_dir(cls, model_dir: str, dtype: torch.dtype) -> ModelCost:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        get = lambda *names: next(cfg[n] for n in names if cfg.get(n) is not None)  # noqa: E731
        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head")
        element = torch.empty((), dtype=dtype).element_size()
        wbytes = weight_bytes(model_dir, dtype)
        return cls(weight_bytes=wbytes, matmul_params=wbytes // element,  # norms and biases: a rounding error
                   lm_head_params=get("vocab_size") * hidden, layers=get("num_hidden_layers", "n_layer"),
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads, element_bytes=element)

    def attention_flops(self, context: float) -> float:
        return 4 * self.layers * self.heads * self.head_dim * context

    def flops_per_token(self, context: float) -> float:
        """Decode FLOPs of one token that attends to ``context`` cached tokens."""
        return 2 * self.matmul_params + self.attention_flops(context)

    def bytes_per_token(self, context: float) -> float:
        """Bytes one batch-1 decode step reads: the weights and the sequence's K and V."""
        return self.weight_bytes + 2 * self.layers * self.kv_heads * self.head_dim * context * self.element_bytes

    def flops_per_generated_token(self, prompt: int, new: int) -> float:
        """All of a request's FLOPs (prefill included, its LM head only for the last prompt token) per
        generated token."""
        prefill = prompt * 2 * (self.matmul_params - self.lm_head_params) + 2 * self.lm_head_params \
            + prompt * self.attention_flops(prompt / 2)
        return (prefill + new * self.flops_per_token(prompt + new / 2)) / new


@dataclass
class Roofline:
    dtype: str
    matmul_gflops: float
    bandwidth_gbs: float
    context: float
    mflops_per_token: float
    mbytes_per_token: float
    compute_tokens_per_s: float  # decode at large batch
    compute_with_prefill_tokens_per_s: float  # the same, the prompts' prefill included
    bandwidth_tokens_per_s: float  # decode at batch 1


def measure(model_dir: str, dtype_name: str, prompt_tokens: int, new_tokens: int) -> Roofline:
    dtype = DTYPES[dtype_name]
    flops, bandwidth = matmul_flops(dtype), read_bandwidth()
    cost = ModelCost.from_dir(model_dir, dtype)
    context = prompt_tokens + new_tokens / 2
    return Roofline(
        dtype=dtype_name, matmul_gflops=flops / 1e9, bandwidth_gbs=bandwidth / 1e9, context=context,
        mflops_per_token=cost.flops_per_token(context) / 1e6, mbytes_per_token=cost.bytes_per_token(context) / 1e6,
        compute_tokens_per_s=flops / cost.flops_per_token(context),
        compute_with_prefill_tokens_per_s=flops / cost.flops_per_generated_token(prompt_tokens, new_tokens),
        bandwidth_tokens_per_s=bandwidth / cost.bytes_per_token(context))


def describe(r: Roofline) -> list[str]:
    return [
        f"matmul ({r.dtype} GEMM, median): {r.matmul_gflops:8.1f} GFLOP/s",
        f"memory read bandwidth (median):  {r.bandwidth_gbs:8.1f} GB/s",
        f"per decoded token at context {r.context:g}: {r.mflops_per_token:.1f} MFLOP, "
        f"{r.mbytes_per_token:.1f} MB read at batch 1",
        f"compute roofline (large batch):   {r.compute_tokens_per_s:8.1f} tok/s "
        f"({r.compute_with_prefill_tokens_per_s:.1f} with the prompts' prefill counted)",
        f"bandwidth roofline (batch 1):     {r.bandwidth_tokens_per_s:8.1f} tok/s",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args()
    if a.model_id is None:
        from _server import default_model_dir

        a.model_id = default_model_dir()
    r = measure(a.model_id, a.dtype, a.prompt_tokens, a.new_tokens)
    print(f"model {a.model_id}, {a.prompt_tokens} prompt + {a.new_tokens} new tokens, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(describe(r)))
    print(json.dumps(asdict(r)))


if __name__ == "__main__":
    main()
