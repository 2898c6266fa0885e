"""Weight-only quantized projections: int8 (per row or per group of inputs), int4 (affine, per group) and MXFP4.

Three representations, each a plain tensor set that concatenates along output rows (a fused QKV or gate/up
projection is built from separately stored parts) and is sliced along input columns at group boundaries
(a row-parallel layer on one tensor-parallel rank):

- ``Int8Weight``: ``values`` int8 ``[N, K]`` and a float32 ``scale`` per row and group of ``group``
  inputs (``group=None``: one per row): w = values * scale.
- ``Int4Weight``: ``values`` uint8 ``[N, K]`` holding 0..15, and per row and group a float32 ``scale`` and
  offset ``low``: w = values * scale + low (an affine grid, which Q4_1 is exactly and Q4_0,
  w = d * (q - 8), is with low = -8 d).
- ``Mxfp4Weight``: ``values`` uint8 ``[N, K]`` holding e2m1 codes (``workers/mxfp4.py``), and per row and group
  of 32 a float32 power of two ``scale``: w = e2m1(code) * scale. gpt-oss's experts as published, kept.

Where K is not a multiple of the group the last group is shorter ([N, ceil(K / group)] scales).

The first two come from a float weight (``quantize_int8``/``quantize_int4``, for ``--quantize``) or from a
GGUF file's raw blocks (``from_gguf``), all three exactly: Q8_0 is int8 in groups of 32 with its float16 scales,
Q4_0 and Q4_1 are int4 in groups of 32; every float16 of the file is exact in the float32 scales.

``QuantizedLinear`` computes with ``quant_kernels.c``'s tiled kernel (AVX512-BF16, or the same numbers from
AVX2 + FMA in ``quant_kernels_avx2.c``; built on first use with the other kernels, ``workers/kernels``) for
bfloat16 and float32 activations; MXFP4, and int8 and int4 with activations at bfloat16's precision, with
``integer_products.c``'s integer products, the activations quantized to 16 bits in blocks of 32 (one
implementation for both). Where that kernel cannot run (no compiler, no AVX2 + FMA,
``LLMBUS_CPU_KERNELS=0``, float16) it falls back to torch's CPU ops
(``_weight_int8pack_mm``, per-row scales, ``_weight_int4pack_mm_for_cpu``), with bf16 scales, and for
float32 (and MXFP4, which torch has no CPU kernel for) to a dense weight. Why: docs/design-notes.md,
"Weight-only quantization".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog
import torch
import torch.nn.functional as F

from llmbus.bus.shared_settings import QUANTIZE_METHODS
from llmbus.workers import gguf_dequant, mxfp4
from llmbus.workers.kernels import bindings
from llmbus.workers.linear import Linear

INT4_GROUP = 32  # Q4_0/Q4_1's block: the most accurate group, and as fast as 64 or 128 in the kernel
# --quantize int8: groups of 32, as Q8_0: a few more bytes than one scale per row and as fast, while per-row
# scales lose measurable perplexity on SmolLM2 and groups of 32 do not (design notes, "Weight-only
# quantization: an AVX512-BF16 kernel of our own").
INT8_GROUP = 32
TILE = bindings.QUANT_TILE  # output rows per vector in quant_kernels.c

log = structlog.get_logger("llmbus.workers.quant")


def _groups(k: int, group: int | None) -> int:
    return 1 if group is None else -(-k // group)


def _expand(per_group: torch.Tensor, k: int, group: int | None) -> torch.Tensor:
    """[N, G] per-group numbers -> [N, K], one per column."""
    return per_group.repeat_interleave(k if group is None else group, dim=1)[:, :k]


def _check_cut(start: int, stop: int, k: int, group: int | None) -> None:
    if group is not None and (start % group or (stop % group and stop != k)):
        raise ValueError(f"a weight in groups of {group} splits at multiples of {group} columns, not {start}:{stop}")


def _cat_groups(parts: list) -> int | None:
    if len({(p.group, p.shape[1]) for p in parts}) != 1:
        raise ValueError("parts with different group sizes or input sizes cannot be fused")
    return parts[0].group


@dataclass(eq=False)
class Int8Weight:
    values: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, G]
    group: int | None = None  # None: one scale per row
    packs: dict = field(default_factory=dict, repr=False)  # the kernel forms made of it, shared by users

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * _expand(self.scale, self.shape[1], self.group)

    def cols(self, start: int, stop: int) -> "Int8Weight":
        _check_cut(start, stop, self.shape[1], self.group)
        scale = self.scale if self.group is None else self.scale[:, start // self.group: -(-stop // self.group)]
        return Int8Weight(self.values[:, start:stop].contiguous(), scale.contiguous(), self.group)

    @staticmethod
    def cat(parts: list["Int8Weight"]) -> "Int8Weight":
        group = _cat_groups(parts)
        return Int8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), group)


@dataclass(eq=False)
class Int4Weight:
    values: torch.Tensor  # uint8 [N, K], each 0..15
    scale: torch.Tensor  # float32 [N, G]
    low: torch.Tensor  # float32 [N, G]: the value of q = 0
    group: int = INT4_GROUP
    packs: dict = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        k = self.shape[1]
        return self.values.float() * _expand(self.scale, k, self.group) + _expand(self.low, k, self.group)

    def cols(self, start: int, stop: int) -> "Int4Weight":
        _check_cut(start, stop, self.shape[1], self.group)
        g0, g1 = start // self.group, -(-stop // self.group)
        return Int4Weight(self.values[:, start:stop].contiguous(), self.scale[:, g0:g1].contiguous(),
                          self.low[:, g0:g1].contiguous(), self.group)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        group = _cat_groups(parts)
        return Int4Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.low for p in parts]), group)


@dataclass(eq=False)
class Bf16Weight:
    """A float weight stored as bfloat16, computed with float32 activations by the same tiled kernel as the
    quantized forms (float32 sums, float32 out): bfloat16 storage at float32's arithmetic, as llama.cpp runs
    a bf16 file (design notes, "bfloat16 weights, float32 activations")."""

    values: torch.Tensor  # bfloat16 [N, K]
    packs: dict = field(default_factory=dict, repr=False)
    group = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return self.values.float()

    def cols(self, start: int, stop: int) -> "Bf16Weight":
        return Bf16Weight(self.values[:, start:stop].contiguous())

    @staticmethod
    def cat(parts: list["Bf16Weight"]) -> "Bf16Weight":
        return Bf16Weight(torch.cat([p.values for p in parts]))


@dataclass(eq=False)
class Mxfp4Weight:
    values: torch.Tensor  # uint8 [N, K], each an e2m1 code 0..15 (not its value: integer_products.c looks it up)
    scale: torch.Tensor  # float32 [N, G]: each block's power of two
    group: int = mxfp4.BLOCK
    packs: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "Mxfp4Weight":
        """MXFP4 as stored: ``blocks [N, K/32, 16]`` and e8m0 ``scales [N, K/32]`` (uint8)."""
        return cls(mxfp4.codes(blocks), mxfp4.scale_values(scales))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return mxfp4.e2m1(self.values) * _expand(self.scale, self.shape[1], self.group)

    def rows(self, selected) -> "Mxfp4Weight":
        """The weight's rows ``selected`` (a slice, or indices)."""
        return Mxfp4Weight(self.values[selected].contiguous(), self.scale[selected].contiguous(), self.group)

    def cols(self, start: int, stop: int) -> "Mxfp4Weight":
        _check_cut(start, stop, self.shape[1], self.group)
        g0, g1 = start // self.group, -(-stop // self.group)
        return Mxfp4Weight(self.values[:, start:stop].contiguous(), self.scale[:, g0:g1].contiguous(), self.group)

    @staticmethod
    def cat(parts: list["Mxfp4Weight"]) -> "Mxfp4Weight":
        group = _cat_groups(parts)
        return Mxfp4Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), group)


QuantizedWeight = Int8Weight | Int4Weight | Bf16Weight | Mxfp4Weight


def _grouped(weight: torch.Tensor, group: int | None) -> torch.Tensor:
    """[N, K] float -> [N, G, group], the last group padded with copies of its first column (which leave
    its minimum, maximum and largest magnitude unchanged)."""
    n, k = weight.shape
    w = weight.float()
    if group is None:
        return w[:, None, :]
    short = -k % group
    if short:
        w = torch.cat((w, w[:, k - (k % group):][:, :1].expand(n, short)), dim=1)
    return w.view(n, -1, group)


def quantize_int8(weight: torch.Tensor, group: int | None = INT8_GROUP) -> Int8Weight:
    """Symmetric int8 per row (or group), round to nearest: each weight within scale / 2 of its value."""
    n, k = weight.shape
    w = _grouped(weight, group)
    scale = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    values = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(values.view(n, -1)[:, :k].contiguous(), scale, group)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric int4 per group of ``group`` inputs (min/max grid, as Q4_1): error at most scale / 2."""
    n, k = weight.shape
    w = _grouped(weight, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    values = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(values.view(n, -1)[:, :k].contiguous(), scale, low, group)


def as_bf16(weight: torch.Tensor) -> Bf16Weight:
    return Bf16Weight(weight.to(torch.bfloat16).contiguous())


_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
# The forms a projection's weight can take besides a dense float tensor: --quantize's, and bfloat16 storage
# (``compute_plan``), which no flag names.
_FORMS = {**_QUANTIZERS, "bf16": as_bf16}
WEIGHT_FORMS = tuple(_FORMS)


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """``--quantize``'s ``method`` ("int8", "int4") with its default grouping, or "bf16" storage."""
    if method in _FORMS:
        return _FORMS[method](weight)
    raise ValueError(f"unknown quantization {method!r} (known: {', '.join(QUANTIZE_METHODS)})")


# -- GGUF blocks -----------------------------------------------------------------------------------------
# Q8_0 block (34 bytes): float16 d, then 32 int8 q; w = d * q.
# Q4_0 block (18 bytes): float16 d, then 16 bytes of 4-bit q; w = d * (q - 8).
# Q4_1 block (20 bytes): float16 d, float16 m, then 16 bytes; w = d * q + m.
# MXFP4 block (17 bytes): e8m0 e, then 16 bytes of 4-bit codes; w = kvalue(q) * 2^(e - 128), ggml's kvalues
# being twice e2m1's, so w = e2m1(q) * 2^(e - 127): the same code and scale as gpt-oss's safetensors.
# Within a 4-bit block byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
# Q4_K and Q6_K super-blocks (256 weights; gguf_dequant unpacks them): Q4_K is w = q * scale - min in
# sub-blocks of 32 (int4 in groups of 32, low = -min), Q6_K w = q * scale with signed 6-bit q in sub-blocks of
# 16 (int8 in groups of 16); every scale and min is a float16 times a 6- or 8-bit integer, exact in float32.


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 16] bytes -> [rows, blocks, 32] 4-bit values in weight order."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def from_gguf(raw) -> QuantizedWeight:
    """Raw GGUF blocks as a quantized weight: anything with ``.qtype`` ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K",
    "MXFP4"), ``.data`` (uint8 ``[N, row bytes]``) and ``.shape`` (``(N, K)``), such as ``gguf_checkpoint.GGUFRaw``."""
    rows, cols = raw.shape
    if raw.qtype in ("Q4_K", "Q6_K"):
        super_blocks = raw.data.reshape(rows * (cols // gguf_dequant.QK_K), -1)
        if raw.qtype == "Q4_K":
            q, scale, low = gguf_dequant.q4_k_parts(super_blocks)
            return Int4Weight(q.reshape(rows, cols), scale.reshape(rows, -1), -low.reshape(rows, -1), 32)
        q, scale = gguf_dequant.q6_k_parts(super_blocks)
        return Int8Weight(q.reshape(rows, cols), scale.reshape(rows, -1), 16)
    blocks = raw.data.view(rows, cols // 32, -1)
    if raw.qtype == "MXFP4":  # e8m0 byte, then 16 bytes of codes (twice e2m1's values at half the scale)
        return Mxfp4Weight(_nibbles(blocks[..., 1:17]).reshape(rows, cols).contiguous(),
                           mxfp4.scale_values(blocks[..., 0]))
    d = _half(blocks[..., 0:2])
    if raw.qtype == "Q8_0":
        return Int8Weight(blocks[..., 2:34].contiguous().view(torch.int8).reshape(rows, cols), d, 32)
    if raw.qtype == "Q4_0":
        return Int4Weight(_nibbles(blocks[..., 2:18]).reshape(rows, cols).contiguous(), d, -8 * d, 32)
    if raw.qtype == "Q4_1":
        return Int4Weight(_nibbles(blocks[..., 4:20]).reshape(rows, cols).contiguous(), d,
                          _half(blocks[..., 2:4]), 32)
    raise ValueError(f"GGUF type {raw.qtype} has no quantized form here")


# -- the C kernel --------------------------------------------------------------------------------------------


@functools.cache
def _library():
    """The kernel library where quant_kernels.c's tiled kernel runs here, or None (logged once) where it
    cannot."""
    library = bindings.library()
    if library is None:
        return None
    if library.tiled_kernel_isa() == bindings.TILED_ISA_NONE:
        log.info("this CPU has neither AVX512-BF16 nor AVX2 + FMA: quantized layers run on torch's kernels")
        return None
    return library


def tiled_kernel() -> str | None:
    """Which tiled kernel computes the tiled forms here: "AVX512-BF16" (VDPBF16PS), "AVX2" (FMAs, the same
    numbers: quant_kernels_avx2.c), or None."""
    library = _library()
    return None if library is None else bindings.TILED_ISA_NAMES[library.tiled_kernel_isa()]


_scratch = {"rows": torch.empty(0, dtype=torch.bfloat16), "sums": torch.empty(0)}


def _scratch_of(name: str, numel: int) -> torch.Tensor:
    if _scratch[name].numel() < numel:
        _scratch[name] = torch.empty(numel, dtype=_scratch[name].dtype)
    return _scratch[name]


def _tiles(per_row: torch.Tensor, k_padded: int | None = None) -> torch.Tensor:
    """[N, C] -> [N/16, C, 16] (rows padded to whole tiles with zeros): C columns of 16 rows each."""
    n, c = per_row.shape
    padded = F.pad(per_row, (0, (k_padded or c) - c, 0, -n % TILE))
    return padded.view(-1, TILE, padded.shape[1]).transpose(1, 2).contiguous()


class _KernelPack:
    """A quantized or bf16 weight in quant_kernels.c's tiled layout (see its header)."""

    def __init__(self, weight: QuantizedWeight):
        n, k = weight.shape
        self.n, self.k, self.is_int4 = n, k, isinstance(weight, Int4Weight)
        self.kind = (bindings.TILED_BF16 if isinstance(weight, Bf16Weight)
                     else bindings.TILED_INT4 if self.is_int4
                     else bindings.TILED_MXFP4 if isinstance(weight, Mxfp4Weight) else bindings.TILED_INT8)
        # one scale a row: a group of whole blocks of activations, as the integer products take them
        block = bindings.ACTIVATION_BLOCK
        self.group = weight.group if weight.group is not None else -(-k // block) * block
        self.k_padded = _groups(k, self.group) * self.group
        self.scale = self.low = None
        if self.kind == bindings.TILED_BF16:  # [T, Kp/2, 16, 2]: 16 rows' pairs of columns, as VDPBF16PS reads
            values = weight.values.view(torch.int16)
            if self.k_padded != k or n % TILE:  # else no padded copy: a vocabulary matrix is a GB or more
                values = F.pad(values, (0, self.k_padded - k, 0, -n % TILE))
            self.values = values.view(-1, TILE, self.k_padded // 2, 2).transpose(1, 2).contiguous()
            return
        nibbles = self.kind in (bindings.TILED_INT4, bindings.TILED_MXFP4)
        tiles = _tiles(weight.values, self.k_padded)
        pairs = tiles.view(tiles.shape[0], self.k_padded // 2, 2, TILE)  # [T, Kp, 16] as column pairs
        # int8: [T, Kp/2, 2, 16]; int4, MXFP4: one byte per row and column pair, the even column low.
        self.values = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous() if nibbles else pairs
        # MXFP4's powers of two as their e8m0 bytes, as published: a quarter of float32's bytes
        self.scale = _tiles(mxfp4.scale_bytes(weight.scale) if self.kind == bindings.TILED_MXFP4 else weight.scale)
        self.low = _tiles(weight.low) if self.is_int4 else None

    def tiled(self, split: bool = True) -> bindings.Tiled:
        """The C view of this pack (its tensors must outlive it); ``split`` as ``__call__`` takes it."""
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return bindings.Tiled(values=self.values.data_ptr(), scale=pointer(self.scale), low=pointer(self.low),
                              kind=self.kind, k_padded=self.k_padded, group=self.group, split=int(split))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, split: bool = True) -> torch.Tensor:
        """``x @ w.T + bias``; float32 ``x`` as bf16 hi + lo rows (``split``) or rounded to bf16."""
        m = x.shape[0]
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = x.new_empty(m, self.n)
        is_f32 = int(x.dtype == torch.float32)
        prepared = m * (1 + is_f32 * split)
        rows = _scratch_of("rows", prepared * self.k_padded)
        bias_pointer = bias.data_ptr() if bias is not None else None
        if self.kind == bindings.TILED_BF16:
            status = _library().bf16_matmul(
                x.data_ptr(), is_f32, int(split), m, self.k, x.stride(0),
                self.values.data_ptr(), self.n, self.k_padded,
                bias_pointer, y.data_ptr(), rows.data_ptr())
        elif self.kind == bindings.TILED_MXFP4:
            status = _library().mxfp4_matmul(
                x.data_ptr(), is_f32, int(split), m, self.k, x.stride(0), self.values.data_ptr(),
                self.scale.data_ptr(), self.n, self.k_padded, self.group, bias_pointer, y.data_ptr(),
                rows.data_ptr(), self._sums(m, prepared).data_ptr())
        elif self.is_int4:
            status = _library().int4_matmul(
                x.data_ptr(), is_f32, int(split), m, self.k, x.stride(0),
                self.values.data_ptr(), self.scale.data_ptr(),
                self.low.data_ptr(), self.n, self.k_padded, self.group, bias_pointer, y.data_ptr(),
                rows.data_ptr(), self._sums(m, prepared).data_ptr())
        else:
            status = _library().int8_matmul(
                x.data_ptr(), is_f32, int(split), m, self.k, x.stride(0),
                self.values.data_ptr(), self.scale.data_ptr(),
                self.n, self.k_padded, self.group, bias_pointer, y.data_ptr(), rows.data_ptr(),
                self._sums(m, prepared).data_ptr())
        if status != 0:
            raise RuntimeError(f"quant_kernels.c refused a {m}x{self.k} by {self.n}x{self.k} product ({status})")
        return y

    def _sums(self, m: int, prepared: int) -> torch.Tensor:
        """Scratch for the kernel's per-row sums: int4's group sums of its ``prepared`` bf16 rows, or, where the
        product is integer_products.c's (quant_kernels.c decides), each of the ``m`` rows' block stats."""
        return _scratch_of("sums", max(prepared * (self.k_padded // self.group),
                                       2 * m * (self.k_padded // bindings.ACTIVATION_BLOCK)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the int8 or bf16 weight, dequantized to float32."""
        tile, lane = ids // TILE, ids % TILE
        if self.kind == bindings.TILED_BF16:
            pairs = self.values[tile, :, lane].reshape(len(ids), self.k_padded)[:, : self.k]
            return pairs.view(torch.bfloat16).float()
        values = self.values[tile, :, :, lane].reshape(len(ids), self.k_padded)[:, : self.k]
        scale = self.scale[tile, :, lane]
        return values.float() * _expand(scale, self.k, self.group)


class _TorchPack:
    """torch's own CPU kernels: int8 with per-row scales, int4 in groups of 32..256, bf16/fp16 scales."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        self.weight = None
        if isinstance(weight, Int8Weight):
            if weight.group is not None:  # per-group scales have no place in torch's kernel: re-quantize
                weight = quantize_int8(weight.dequantize(), None)
            self.weight = weight  # its row-major values are the kernel's operand, and embedding rows
            self.scale = weight.scale[:, 0].to(dtype)
        else:
            self.group = weight.group
            # torch's kernel reads w = (q - 8) * scale + zero: zero is the grid's middle, low + 8 * scale.
            zero = weight.low + 8 * weight.scale
            self.scales_and_zeros = torch.stack((weight.scale.t(), zero.t()), dim=-1).to(dtype).contiguous()
            self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.to(torch.int32), 1)

    @staticmethod
    def takes(weight: QuantizedWeight) -> bool:
        # Outside these sizes torch 2.13's kernels refuse, or return garbage (int8 with K = 100) or crash.
        n, k = weight.shape
        if isinstance(weight, Mxfp4Weight):
            return False
        if isinstance(weight, Int8Weight):
            return k % 32 == 0
        return weight.group in (32, 64, 128, 256) and k % weight.group == 0 and n % 16 == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, split: bool = True) -> torch.Tensor:
        if self.weight is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight.values, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4, self.group, self.scales_and_zeros)
        return y + bias if bias is not None else y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return _weight_rows(self.weight, ids)


def _weight_rows(weight: Int8Weight | Bf16Weight, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, Bf16Weight):
        return weight.values[ids].float()
    return weight.values[ids].float() * _expand(weight.scale[ids], weight.shape[1], weight.group)


class _DensePack:
    """The weight expanded into a float ``Linear``: for float32 activations where no kernel of ours runs
    (torch's quantized kernels are slower there than a dense float32 product)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        self.source = weight if isinstance(weight, Int8Weight | Bf16Weight) else None  # for embedding rows
        self.linear = Linear(weight.dequantize().to(dtype))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, split: bool = True) -> torch.Tensor:
        y = self.linear(x)
        return y + bias if bias is not None else y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return _weight_rows(self.source, ids)


def _pack(weight: QuantizedWeight, dtype: torch.dtype):
    """The form this machine computes ``weight`` with for ``dtype`` activations, made once per weight (a
    tied embedding and LM head share it)."""
    if dtype in (torch.bfloat16, torch.float32) and _library() is not None:
        kind, make = "kernel", lambda: _KernelPack(weight)
    elif dtype in (torch.bfloat16, torch.float16) and not isinstance(weight, Bf16Weight) and _TorchPack.takes(weight):
        kind, make = f"torch-{dtype}", lambda: _TorchPack(weight, dtype)
    else:
        kind, make = f"dense-{dtype}", lambda: _DensePack(weight, dtype)
    if kind not in weight.packs:
        weight.packs[kind] = make()
    return weight.packs[kind]


_METHODS = {Int8Weight: "int8", Int4Weight: "int4", Bf16Weight: "bf16", Mxfp4Weight: "mxfp4"}


class QuantizedLinear:
    """``y = x @ w.T + bias`` for 2-D ``x`` of ``dtype`` with a quantized ``w``, keeping only the form the
    kernel reads (``linear.Linear``'s call contract). ``bf16_inputs``: float32 ``x`` enters the tiled kernel
    rounded to bf16 (the bfloat16 plan's arithmetic, ``compute_plan``), not as bf16 hi + lo."""

    __slots__ = ("method", "out_features", "bias", "split", "_pack", "_kernel_bias")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, *, bf16_inputs: bool = False):
        self.split = not bf16_inputs
        self.out_features = weight.shape[0]
        self.method = _METHODS[type(weight)]
        self.bias = bias
        self._pack = _pack(weight, dtype)
        # Our kernel adds a float32 bias before rounding to the output dtype.
        is_kernel = isinstance(self._pack, _KernelPack)
        self._kernel_bias = bias.float().contiguous() if is_kernel and bias is not None else bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._pack(x, self._kernel_bias, self.split)


class QuantizedEmbedding:
    """Embedding rows looked up in an int8 (or bf16) matrix, dequantized: with ``tied_embedding_and_head``
    (or the same weight given to a ``QuantizedLinear`` of the same dtype) an embedding and LM head share
    one copy, in the kernel's layout."""

    def __init__(self, weight: Int8Weight | Bf16Weight, dtype: torch.dtype):
        self._pack, self.dtype = _pack(weight, dtype), dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self._pack.rows(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)


def tied_embedding_and_head(weight: Int8Weight | Bf16Weight,
                            dtype: torch.dtype) -> tuple[QuantizedEmbedding, QuantizedLinear]:
    return QuantizedEmbedding(weight, dtype), QuantizedLinear(weight, None, dtype)


def make_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
                quantize: str | None = None, dtype: torch.dtype | None = None):
    """A ``Linear`` for a float ``weight`` and no ``quantize``, else a ``QuantizedLinear`` for activations
    of ``dtype`` (default: the float weight's dtype, or bfloat16)."""
    if isinstance(weight, torch.Tensor):
        if quantize is None:
            return Linear(weight if dtype is None else weight.to(dtype), bias)
        if quantize not in _FORMS:
            raise ValueError(f"unknown quantization {quantize!r} (known: {', '.join(QUANTIZE_METHODS)})")
        return QuantizedLinear(_FORMS[quantize](weight), bias, dtype or weight.dtype)
    return QuantizedLinear(weight, bias, dtype or torch.bfloat16)


class ComputePlan(NamedTuple):
    dtype: torch.dtype  # what the model computes in: activations, norms, attention, logits
    form: str | None  # the projections' weight form (WEIGHT_FORMS), None: dense in ``dtype``
    bf16_inputs: bool  # tiled projections take float32 inputs rounded to bf16 (else as bf16 hi + lo)


def compute_plan(device: torch.device, dtype: torch.dtype, quantize: str | None) -> ComputePlan:
    """How a native model served in ``dtype`` with ``quantize`` computes. On a CPU where the tiled kernel runs
    (AVX512-BF16, or AVX2 + FMA with the same numbers), bfloat16 means bfloat16 weights and float32
    activations, norms, softmax, residual and logits, the products' inputs rounded to bf16 and summed in
    float32: llama.cpp's arithmetic for a bf16 file, and batch-invariant (design notes, "bfloat16 weights,
    float32 activations"); --quantize's forms then compute so too. Elsewhere the model computes in
    ``dtype``."""
    if device.type != "cpu" or dtype != torch.bfloat16 or _library() is None:
        return ComputePlan(dtype, quantize, False)
    return ComputePlan(torch.float32, quantize or "bf16", True)


def tiled_forms() -> tuple[str, ...]:
    """The weight forms that compute through the tiled kernel on this machine (none without AVX2 + FMA)."""
    return ("int8", "int4", "bf16") if _library() is not None else ()


# --dtype auto on CPU, by which tiled kernel runs: (dtype, the startup log's reason). On AVX2 the choice is
# measured, not inherited: SmolLM2 decode steps on the x86-64-v3 build (design notes, "bfloat16 weights,
# float32 activations": bf16 as fast as float32 for a bf16 checkpoint, a GGUF's Q4_1 kept as int4 about 2x
# float32's expansion for one stream, --quantize int8 twice float32's hi + lo inputs at batch 64).
_AUTO_CPU = {
    "AVX512-BF16": (torch.bfloat16, "bf16 weights computed in float32 by the AVX512-BF16 kernel: half float32's "
                                    "bytes to read per step, float32's norms, attention and logits"),
    "AVX2": (torch.bfloat16, "bf16 weights computed in float32 by the AVX2 tiled kernel (the AVX512-BF16 "
                             "kernel's numbers): as fast as float32 for a bf16 checkpoint, quantized weights "
                             "stay quantized, float32's norms, attention and logits, batch-invariant"),
    None: (torch.float32, "no tiled kernel here (no AVX2 + FMA, or no C compiler): bf16 would be torch's bf16 "
                          "arithmetic, less accurate"),
}


def auto_cpu_dtype() -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` computes in on this CPU, and why."""
    return _AUTO_CPU[tiled_kernel()]
