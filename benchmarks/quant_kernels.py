"""Weight-only int8 / int4 matmuls on SmolLM2's shapes against the dense bf16 projection, in one run.

    python benchmarks/quant_kernels.py [--rows 1,16,64] [--repeats 50]

For each projection shape of SmolLM2-135M (fused qkv 960x576, o_proj 576x576, fused gate/up 3072x576,
down 576x1536, the tied LM head 49152x576) and each batch of rows M, the median time of:

- dense: llmbus's `Linear` (bf16 weight prepacked for oneDNN), the unquantized path;
- int8: torch's `aten._weight_int8pack_mm` (per-row scales), what `--quantize int8` and GGUF Q8_0 use;
- int4: torch's `aten._weight_int4pack_mm_for_cpu` (groups of 32), what `--quantize int4` and GGUF
  Q4_0/Q4_1 use;
- int8 expand: our own alternative without a native kernel, the int8 weight expanded to bf16 and scaled
  per call, then a plain matmul;
- int8 float32: the int8 kernel with float32 activations (why llmbus expands quantized weights once at
  load in float32).

Ratios are dense / quantized (above 1: the quantized path is faster). Interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmbus.workers import quant
from llmbus.workers.linear import Linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; milliseconds, medians")
    print(f"{'shape':8} {'M':>3} {'dense':>8} {'int8':>8} {'int4':>8} {'i8 expand':>9} {'i8 fp32':>8}"
          f" {'dense/int8':>10} {'dense/int4':>10}")
    totals = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        dense = Linear(w.bfloat16())
        w8, w4 = quant.quantize_int8(w), quant.quantize_int4(w)
        int8 = quant.QuantizedLinear(w8, None, torch.bfloat16)
        int4 = quant.QuantizedLinear(w4, None, torch.bfloat16)
        values, scale = w8.values, w8.scale.bfloat16()
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            x32 = x.float()
            r = {"dense": timed(lambda: dense(x), a.repeats), "int8": timed(lambda: int8(x), a.repeats),
                 "int4": timed(lambda: int4(x), a.repeats),
                 "expand": timed(lambda: F.linear(x, values.to(torch.bfloat16)).mul_(scale), a.repeats),
                 "fp32": timed(lambda: torch.ops.aten._weight_int8pack_mm(x32, values, w8.scale), max(3, a.repeats // 10))}
            for key, value in r.items():
                totals.setdefault((m, key), 0.0)
                totals[(m, key)] += value * (30 if name != "lm_head" else 1)
            print(f"{name:8} {m:3} {r['dense']:8.3f} {r['int8']:8.3f} {r['int4']:8.3f} {r['expand']:9.3f}"
                  f" {r['fp32']:8.3f} {r['dense'] / r['int8']:10.2f} {r['dense'] / r['int4']:10.2f}")
    print("\nwhole model (30 layers + LM head), ms per step:")
    for m in map(int, a.rows.split(",")):
        d, i8, i4 = totals[(m, "dense")], totals[(m, "int8")], totals[(m, "int4")]
        print(f"  M={m:3}: dense {d:7.2f}  int8 {i8:7.2f} ({d / i8:.2f}x)  int4 {i4:7.2f} ({d / i4:.2f}x)")
    params = 30 * sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head")
    print(f"\nweight bytes of the 30 layers: bf16 {params * 2 / 1e6:.0f} MB, int8 {params / 1e6:.0f} MB "
          f"(+ scales), int4 {params / 2e6:.0f} MB (+ scales and zeros)")


if __name__ == "__main__":
    main()
