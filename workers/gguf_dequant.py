"""GGUF blocks to float32 with torch: every block of a tensor at once, on torch's threads.

``gguf.quants.dequantize`` walks a tensor sixteen rows at a time in single-threaded numpy: 0.1 s per 16.8M
weights, about 50 s per rank for an 8B model and half of SmolLM2-135M's load. The functions here follow
gguf-py's own (the reference for every file served, and for llama.cpp's ``dequantize_row_*``) operation for
operation, so the floats they give are the same bits: scales are widened from float16 exactly, each product
and each sum is its own float32 rounding (``d * q``, then ``+ m`` or ``- m``; never a fused multiply-add), and
integer codes become floats only where gguf-py makes them so. Types not here go back to gguf-py.

Input is what ``gguf_index``/GGUFReader give a rank: ``[..., bytes per row]`` uint8, each row a run of blocks.
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # weights in a K-quant super-block
_CHUNK_WEIGHTS = 1 << 21


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 field at byte ``start`` of each block, widened (exactly) to float32: ``[blocks, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 2, n]`` from ``[..., n]`` bytes: low nibbles, then high ones, as ggml packs a run of 2n
    weights (the first n in the low halves)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """The bits of ``[blocks, n]`` bytes as ``[blocks, n * 8]`` 0/1 uint8, lowest bit of the first byte first
    (a little-endian uint32 read bit by bit)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], -1)


# Each writes the weights of ``blocks`` ([n, bytes per block] uint8) into ``out`` ([n, weights per block]
# float32). The integer codes are written first (an exact conversion) and scaled in place: a multiply of
# uint8 by float32 in one kernel takes torch's slow mixed-type path, and every fresh float32 temporary costs
# its page faults, which on a small machine are most of the time.

def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # torch widens bfloat16 by shifting its bits, as gguf-py does: a NaN's payload comes through untouched
    out.copy_(blocks.view(torch.bfloat16))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(_half(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks[:, 2:]).view(-1, 32).view(torch.int8) - 8).mul_(_half(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks[:, 4:]).view(-1, 32)).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


# ggml's MXFP4 values by code: twice e2m1's, from an int8 table (so code 8, e2m1's -0, is +0 here)
_MXFP4_KVALUES = torch.tensor((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=torch.float32)


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # times half the block's power of two, 2^(e - 128), as ggml_e8m0_to_fp32_half (exact: e = 255 is 2^127)
    half_scale = torch.ldexp(torch.ones(blocks.shape[0], 1), blocks[:, :1].to(torch.int32) - 128)
    out.copy_(_MXFP4_KVALUES[_nibbles(blocks[:, 1:]).view(-1, 32).long()]).mul_(half_scale)


def _q5(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit codes of a Q5_0/Q5_1 block (uint8): a nibble from ``qs``, the fifth bit from ``qh``."""
    low = _nibbles(blocks[:, qh_at + 4:]).view(-1, 32)
    return low | (_bits(blocks[:, qh_at:qh_at + 4]) << 4)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5(blocks, 2).view(torch.int8) - 16).mul_(_half(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5(blocks, 4)).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight sub-block scales and mins (6 bits each, packed in 12 bytes after d and dmin) as
    float32 ``[blocks, 8, 1]`` already times d and dmin, as gguf-py's get_scale_min and its caller give them."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return (sc.float().mul_(_half(blocks, 0)).unsqueeze(-1),
            mn.float().mul_(_half(blocks, 2)).unsqueeze(-1))


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K block's (4-bit codes ``[blocks, 8, 32]`` uint8, scales and mins ``[blocks, 8, 1]``): w = q *
    scale - min, sub-block by sub-block (``quant.from_gguf`` keeps them as int4 in groups of 32)."""
    scale, low = _k_scales(blocks)
    return _nibbles(blocks[:, 16:].view(-1, 4, 32)).view(-1, 8, 32), scale, low


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q, scale, low = q4_k_parts(blocks)
    out.view(-1, 8, 32).copy_(q).mul_(scale).sub_(low)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale, low = _k_scales(blocks)
    q = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).view(-1, 8, 32)
    # bit j of qh[l] is the fifth bit of weight l of sub-block j
    high = (blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    out.view(-1, 8, 32).copy_(q | (high << 4)).mul_(scale).sub_(low)


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q6_K block's (signed 6-bit codes ``[blocks, 16, 16]`` int8, scales ``[blocks, 16, 1]``): w = q * scale,
    16 weights a scale (``quant.from_gguf`` keeps them as int8 in groups of 16)."""
    scale = blocks[:, 192:208].view(torch.int8).float().mul_(_half(blocks, 208)).unsqueeze(-1)
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).view(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).view(-1, 8, 32)
    return ((low | (high << 4)).view(torch.int8) - 32).view(-1, 16, 16), scale


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q, scale = q6_k_parts(blocks)
    out.view(-1, 16, 16).copy_(q).mul_(scale)


_DEQUANTIZE = {"BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
               "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}
IMPLEMENTED = ("F32", "F16", *_DEQUANTIZE)  # what ``dequantize`` takes


def dequantize(data: np.ndarray, qtype_name: str) -> torch.Tensor:
    """float32 weights ``[..., columns]`` of GGUF data of type ``qtype_name`` (F32 and F16 as numbers, any
    type in IMPLEMENTED as ``[..., bytes per row]`` uint8). Always a fresh tensor, never a view of ``data``."""
    if qtype_name == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
    if qtype_name == "F16":
        return torch.from_numpy(np.asarray(data, dtype=np.float16).astype(np.float32))
    import gguf  # on use, as gguf_checkpoint imports it: 0.13 s that a safetensors model never needs

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]]
    shape = data.shape[:-1] + (data.shape[-1] // type_size * block_size,)
    # the file's memory map is read-only and torch warns on read-only arrays; a copy of the blocks costs a
    # fraction of the float32 output they become
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()
    blocks = torch.from_numpy(raw).view(-1, type_size)
    out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32)
    # a slice of blocks at a time keeps the byte-sized temporaries small (an embedding is ~10^9 weights)
    step = max(1, _CHUNK_WEIGHTS // block_size)
    for start in range(0, blocks.shape[0], step):
        _DEQUANTIZE[qtype_name](blocks[start:start + step], out[start:start + step])
    return out.view(shape)
