"""Weight-only int8/int4 kernels on SmolLM2-135M's shapes, against the dense ``linear.Linear`` baseline.

    python benchmarks/quant_kernels.py [--layers 30] [--rows 1,16,64] [--rounds 7]

Per decoder layer: qkv 960x576, o_proj 576x576, gate_up 3072x576, down 576x1536 (N x K); the LM head
49152x576 apart. A stack of ``--layers`` layers is run end to end per timing, so the weights stream
from memory as in a decode step (30 layers of int8 are ~106 MB, beyond the L3), and the per-layer time is
the stack's over the layers. Each round times every backend once, interleaved; the table shows medians
over rounds (the machine is shared: single timings are noisy). Backends:

- dense: ``linear.Linear`` (oneDNN-prepacked) in the activation dtype, and bf16 weights for either
- torch int8: ``aten._weight_int8pack_mm`` (per-row scales); torch int4: ``_weight_int4pack_mm_for_cpu``
  (groups of 32); both take scales in the activation dtype.
- ours: ``workers/kernels/csrc/quant_kernels.c`` through ``quant.QuantizedLinear`` (int8 per row and in groups of 32,
  int4 in groups of 32/64/128: 128 does not divide 576, the last group is shorter).

Also printed: the weight bytes each form keeps, and the reconstruction error of each quantizer on
Gaussian weights (RMS error / RMS weight).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmbus.workers import quant
from llmbus.workers.linear import Linear

LAYER = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


class TorchInt8:
    def __init__(self, w: quant.Int8Weight, dtype):
        self.values, self.scale = w.values, w.scale[:, 0].to(dtype)

    def __call__(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.values, self.scale)


class TorchInt4:
    def __init__(self, w: quant.Int4Weight, dtype):
        zero = w.low + 8 * w.scale
        self.scales_and_zeros = torch.stack((w.scale.t(), zero.t()), dim=-1).to(dtype).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.values.to(torch.int32), 1)
        self.group = w.group

    def __call__(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)


def backends(dtype: torch.dtype, rows: int) -> dict:
    """name -> builder(float weight) -> callable. torch's kernels with float32 activations run 5-50x
    slower than dense (measured), so only at one row."""
    out = {"dense": lambda w: Linear(w.to(dtype))}
    if dtype == torch.float32:
        out["dense bf16 weights"] = lambda w: _cast_in(Linear(w.to(torch.bfloat16)))
    if dtype != torch.float32 or rows == 1:
        out["torch int8"] = lambda w: TorchInt8(quant.quantize_int8(w, None), dtype)
        out["torch int4 g32"] = lambda w: TorchInt4(quant.quantize_int4(w, 32), dtype)
    out["ours int8 row"] = lambda w: quant.QuantizedLinear(quant.quantize_int8(w, None), None, dtype)
    out["ours int8 g32"] = lambda w: quant.QuantizedLinear(quant.quantize_int8(w, 32), None, dtype)
    for group in (32, 64, 128):
        out[f"ours int4 g{group}"] = lambda w, g=group: quant.QuantizedLinear(quant.quantize_int4(w, g), None, dtype)
    return out


def _cast_in(linear):
    return lambda x: linear(x.to(torch.bfloat16)).to(torch.float32)


def weight_bytes(thing) -> int:
    """Bytes of the tensors an object keeps (through quant's packs), counting each storage once."""
    seen, total = set(), 0

    def visit(obj, depth=0):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn:
                total += obj.element_size() * obj.numel()
            elif obj.untyped_storage().data_ptr() not in seen:
                seen.add(obj.untyped_storage().data_ptr())
                total += obj.untyped_storage().nbytes()
        elif depth < 4:
            slots = getattr(type(obj), "__slots__", ())
            fields = [getattr(obj, s, None) for s in slots] + list(getattr(obj, "__dict__", {}).values())
            for value in fields:
                visit(value, depth + 1)

    visit(thing)
    return total


def time_stack(layers: list[list], x_by_k: dict, rounds_out: list) -> None:
    start = time.perf_counter()
    for layer in layers:
        for (_n, k), linear in layer:
            linear(x_by_k[k])
    rounds_out.append((time.perf_counter() - start) / len(layers) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    floats = [[torch.randn(n, k) * 0.02 for n, k in LAYER.values()] for _ in range(args.layers)]
    head = torch.randn(*HEAD) * 0.02
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; per-layer ms = stack of "
          f"{args.layers} layers / {args.layers}, median of {args.rounds} interleaved rounds")
    print(f"{'dtype':9} {'M':>3} {'backend':20} {'layer ms':>9} {'vs dense':>8} {'head ms':>8} {'vs dense':>8}")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            built = {name: ([[(w.shape, make(w)) for w in layer] for layer in floats], make(head))
                     for name, make in backends(dtype, rows).items()}
            x_by_k = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
            layer_ms = {name: [] for name in built}
            head_ms = {name: [] for name in built}
            for layers, head_linear in built.values():  # warm-up: first calls build and page in
                time_stack(layers, x_by_k, [])
                head_linear(x_by_k[576])
            for _ in range(args.rounds):
                for name, (layers, head_linear) in built.items():
                    time_stack(layers, x_by_k, layer_ms[name])
                    time_stack([[(HEAD, head_linear)]], x_by_k, head_ms[name])
            base_layer = statistics.median(layer_ms["dense"])
            base_head = statistics.median(head_ms["dense"])
            for name in built:
                lm, hm = statistics.median(layer_ms[name]), statistics.median(head_ms[name])
                print(f"{str(dtype)[6:]:9} {rows:3} {name:20} {lm:9.4f} {base_layer / lm:7.2f}x {hm:8.3f} "
                      f"{base_head / hm:7.2f}x", flush=True)
            del built
    print("\nweight bytes of one SmolLM2 layer's projections (4 matrices) and of the LM head:")
    for name, make in {"bf16 dense": lambda w: Linear(w.to(torch.bfloat16)),
                       "ours int8 row": lambda w: quant.QuantizedLinear(quant.quantize_int8(w)),
                       "ours int8 g32": lambda w: quant.QuantizedLinear(quant.quantize_int8(w, 32)),
                       "ours int4 g32": lambda w: quant.QuantizedLinear(quant.quantize_int4(w, 32)),
                       "ours int4 g64": lambda w: quant.QuantizedLinear(quant.quantize_int4(w, 64))}.items():
        layer_bytes = sum(weight_bytes(make(w)) for w in floats[0])
        head_bytes = weight_bytes(make(head))
        print(f"  {name:14} layer {layer_bytes:>10,}  x30 {30 * layer_bytes:>12,}  head {head_bytes:>12,}")
    print("\nreconstruction error (RMS error / RMS weight) on Gaussian 3072x576:")
    w = floats[0][2]
    for name, q in {"int8 row": quant.quantize_int8(w), "int8 g32": quant.quantize_int8(w, 32),
                    "int4 g32": quant.quantize_int4(w, 32), "int4 g64": quant.quantize_int4(w, 64),
                    "int4 g128": quant.quantize_int4(w, 128)}.items():
        print(f"  {name:10} {((q.dequantize() - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item():.4f}")


if __name__ == "__main__":
    main()
