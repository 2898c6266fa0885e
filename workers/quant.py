"""Weight-only quantized projections: int8 per output channel and int4 in groups along the input.

Two representations, each a plain tensor set that concatenates along output rows (a fused QKV or gate/up
projection is built from separately stored parts) and is sliced along input columns at group boundaries
(a row-parallel layer on one tensor-parallel rank):

- ``Int8Weight``: ``values`` int8 ``[N, K]`` and one float32 ``scale`` per row: w = values * scale.
- ``Int4Weight``: ``values`` uint8 ``[N, K]`` holding 0..15, and per row and group of ``group`` inputs a
  ``scale`` and an offset ``low``: w = values * scale + low (an affine grid, which Q4_1 is exactly and
  Q4_0, w = d * (q - 8), is with low = -8 d).

They come from a float weight (``quantize_int8``/``quantize_int4``, for ``--quantize``) or from a GGUF
file's raw blocks (``from_gguf``): Q4_0 and Q4_1 map onto ``Int4Weight`` with their own 4-bit values;
Q8_0's per-32-weight scales have no place in a per-row int8 kernel, so Q8_0 is re-quantized per row.

``QuantizedLinear`` computes with torch's own CPU kernels, ``aten._weight_int8pack_mm`` and
``aten._weight_int4pack_mm_for_cpu``: they take bfloat16 (or float16) activations and scales of the same
dtype, which is where the int4 path rounds a GGUF file's float16 scales to bfloat16 (2^-9 relative). For
float32 activations (the reference precision) they are slower than a dense float32 matmul, so there the
weight is expanded once at load.
Why these kernels and not ours: docs/design-notes.md, "Weight-only quantization".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.workers import QUANTIZE_METHODS

INT4_GROUP = 32  # Q4_0/Q4_1's block; divides every hidden size in use (SmolLM2's 576 is 18 x 32)
_FAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Int8Weight:
    values: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale[:, None]

    def cols(self, start: int, stop: int) -> "Int8Weight":
        # A per-row scale was chosen for the whole row: a column slice keeps it (still exact, maybe coarse).
        return Int8Weight(self.values[:, start:stop].contiguous(), self.scale)

    @staticmethod
    def cat(parts: list["Int8Weight"]) -> "Int8Weight":
        return Int8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]))


@dataclass
class Int4Weight:
    values: torch.Tensor  # uint8 [N, K], each 0..15
    scale: torch.Tensor  # float32 [N, K // group]
    low: torch.Tensor  # float32 [N, K // group]: the value of q = 0
    group: int = INT4_GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.values.shape
        grouped = self.values.view(n, k // self.group, self.group).float()
        return (grouped * self.scale[..., None] + self.low[..., None]).view(n, k)

    def cols(self, start: int, stop: int) -> "Int4Weight":
        if start % self.group or stop % self.group:
            raise ValueError(f"an int4 weight splits at multiples of {self.group} columns, not {start}:{stop}")
        g0, g1 = start // self.group, stop // self.group
        return Int4Weight(self.values[:, start:stop].contiguous(), self.scale[:, g0:g1].contiguous(),
                          self.low[:, g0:g1].contiguous(), self.group)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        if len({p.group for p in parts}) != 1:
            raise ValueError("int4 parts with different group sizes cannot be fused")
        return Int4Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.low for p in parts]), parts[0].group)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8 (round to nearest): the error of a weight is at most scale / 2."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    values = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(values, scale)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric int4 per group of ``group`` inputs (min/max grid, as Q4_1): error at most scale / 2."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 quantization needs the input size ({k}) to be a multiple of {group}")
    w = weight.float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    values = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(values.view(n, k), scale, low, group)


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise ValueError(f"unknown quantization {method!r} (known: {', '.join(QUANTIZE_METHODS)})")


# -- GGUF blocks -----------------------------------------------------------------------------------------
# Q4_0 block (18 bytes): float16 d, then 16 bytes of 4-bit q; w = d * (q - 8).
# Q4_1 block (20 bytes): float16 d, float16 m, then 16 bytes; w = d * q + m.
# Within a block byte j holds weight j in its low nibble and weight j + 16 in its high nibble.


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 16] bytes -> [rows, blocks, 32] 4-bit values in weight order."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def from_gguf(raw) -> QuantizedWeight:
    """A ``gguf_checkpoint.GGUFRaw`` (Q8_0, Q4_0 or Q4_1 blocks) as a quantized weight."""
    rows, cols = raw.shape
    blocks = raw.data.view(rows, cols // 32, -1)
    if raw.qtype in ("Q4_0", "Q4_1"):
        d = _half(blocks[..., 0:2])
        if raw.qtype == "Q4_0":
            low, packed = -8 * d, blocks[..., 2:18]
        else:
            low, packed = _half(blocks[..., 2:4]), blocks[..., 4:20]
        return Int4Weight(_nibbles(packed).reshape(rows, cols).contiguous(), d, low, 32)
    if raw.qtype == "Q8_0":
        d = _half(blocks[..., 0:2])
        values = blocks[..., 2:34].contiguous().view(torch.int8).float()
        return quantize_int8((values * d[..., None]).view(rows, cols))
    raise ValueError(f"GGUF type {raw.qtype} has no quantized form here")


# -- computing ---------------------------------------------------------------------------------------------


class QuantizedLinear:
    """``y = x @ w.T + bias`` for 2-D ``x`` with a quantized ``w``, keeping only the kernel's packed form.

    With float32 activations (``dtype``) the quantized values are expanded once at load into a float32
    ``Linear``: the same numbers, no memory saved, but no kernel that would be slower than the dense one."""

    __slots__ = ("method", "out_features", "bias", "_int8", "_scale", "_int4", "_scales_and_zeros", "_group",
                 "_dense")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        from llmbus.workers.linear import Linear

        self.out_features = weight.shape[0]
        self.bias = bias
        self.method = "int8" if isinstance(weight, Int8Weight) else "int4"
        self._int8 = self._int4 = self._dense = None
        if dtype not in _FAST_DTYPES:
            self._dense = Linear(weight.dequantize().to(dtype), bias)
        elif isinstance(weight, Int8Weight):
            self._int8, self._scale = weight.values, weight.scale.to(dtype)
        else:
            self._group = weight.group
            # torch's kernel reads w = (q - 8) * scale + zero: zero is the grid's middle, low + 8 * scale.
            zero = weight.low + 8 * weight.scale
            self._scales_and_zeros = torch.stack((weight.scale.t(), zero.t()), dim=-1).to(dtype).contiguous()
            self._int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.to(torch.int32), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense(x)
        if self._int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self._int8, self._scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._int4, self._group, self._scales_and_zeros)
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding:
    """Embedding rows looked up from an int8 matrix, so a tied embedding and LM head share one copy."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype):
        self.values, self.scale, self.dtype = weight.values, weight.scale, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.values.view(torch.uint8)).view(torch.int8)
        return (rows.float() * self.scale[ids][:, None]).to(self.dtype)
