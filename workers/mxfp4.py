"""MXFP4 blocks expanded to floats: gpt-oss's experts as published (``bus/prequantized.py`` describes the
layout). A block is 32 values that share one power of two: 16 bytes of two 4-bit e2m1 codes each (the even
value's in the low nibble) and one e8m0 scale byte (the exponent plus 127). Every such value is exact in
float32 and bfloat16, so expanding rounds nothing: the numbers are transformers' (``convert_moe_packed_tensors``)."""

from __future__ import annotations

import torch

# e2m1's values by code: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated (the 4th bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` -> uint8 codes ``[..., G * 32]`` in weight order."""
    if blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} are not 16 bytes each")
    packed = blocks.to(torch.uint8)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-3)


def e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes -> their float32 values."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (uint8, the exponent plus 127) -> float32 powers of two (2^-127 .. 2^127: all exact)."""
    return torch.ldexp(torch.ones(scales.shape, device=scales.device), scales.to(torch.int32) - 127)


def scale_bytes(values: torch.Tensor) -> torch.Tensor:
    """``scale_values`` undone: float32 powers of two (2^-127 .. 2^128) -> their e8m0 bytes. Raises ValueError
    for a value that is not one."""
    stored = ((values.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    if not torch.equal(scale_values(stored), values.float()):
        raise ValueError("MXFP4 scales must be powers of two from 2^-127 to 2^128")
    return stored


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32 ``[..., G * 32]``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    groups = scales.shape[-1]
    return (e2m1(codes(blocks)).unflatten(-1, (groups, BLOCK)) * scale_values(scales)[..., None]).flatten(-2)
