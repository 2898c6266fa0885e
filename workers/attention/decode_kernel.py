"""``decode_attention.c`` for torch tensors: decode attention over one layer's paged pool read in place, the
write of tokens' K/V into the pool, and the pool's bfloat16 layout (the CPU backend, ``cpu.py``).

Where the kernel library cannot be built (no compiler, a failed build, ``LLMBUS_CPU_KERNELS=0``),
``decode_attention_kernel()`` returns None and attention runs on torch ops: slower, same results up to float
rounding.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llmbus.workers.kernels import bindings

# Per pool dtype: the C entries' suffix (bindings.POOL_SUFFIXES), and the dtype of the queries, new K/V and
# output they take. A float16 pool is a float32 model's narrower cache (--kv-cache-dtype float16).
_ENTRIES = {torch.bfloat16: ("bf16", torch.bfloat16), torch.float32: ("f32", torch.float32),
            torch.float16: ("f16kv", torch.float32)}


def score_slots() -> int:
    """The [group, scores_stride] slots of attention's scores scratch: one a thread of the kernels' regions
    that attend (at most internal.h's SCORE_SLOTS), each (kv head, row) pair's scores in the slot of the
    thread that takes it, so the scratch does not grow with a step's rows. Not fewer when a step has fewer
    pairs than threads: the pair loops give a pair to whichever thread is free."""
    return bindings.library().attention_threads()


def _check_activations(tensor: torch.Tensor, pool: torch.Tensor) -> None:
    """The C entry of a pool reads queries and new K/V of one dtype only (``_ENTRIES``)."""
    if _ENTRIES[pool.dtype][1] != tensor.dtype:
        raise ValueError(f"a {pool.dtype} pool takes {_ENTRIES[pool.dtype][1]} activations, not {tensor.dtype}")


def _packed_rows(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows may be strided (views into the fused QKV output); within a row the heads must be packed."""
    return tensor if tensor.stride(2) == 1 and tensor.stride(1) == head_dim else tensor.contiguous()


class DecodeAttentionKernel:
    """``decode_attention.c``'s entries: decode attention over one layer's paged pool, read in place, and
    the write of tokens' K/V into the pool in the kernel's layout."""

    def __init__(self, library: ctypes.CDLL):
        """``library``: the kernel library, bound (``kernels.bindings.library``)."""
        suffixes = {dtype: suffix for dtype, (suffix, _) in _ENTRIES.items()}
        self._attend = {dtype: getattr(library, f"decode_attention_{suffix}") for dtype, suffix in suffixes.items()}
        self._write = {dtype: getattr(library, f"write_kv_{suffix}") for dtype, suffix in suffixes.items()}
        self._scratch = torch.empty(0, dtype=torch.float32)

    def supports(self, dtype: torch.dtype, head_dim: int, block_size: int,
                 compute_dtype: torch.dtype | None = None) -> bool:
        """Whether a pool of ``dtype`` blocks of ``block_size`` positions of ``head_dim`` can be attended
        by queries of ``compute_dtype`` (default: ``dtype``)."""
        return (dtype in self._attend and _ENTRIES[dtype][1] == (compute_dtype or dtype) and head_dim % 2 == 0
                and (dtype != torch.bfloat16 or block_size % 16 == 0))

    @staticmethod
    def uses_own_layout(dtype: torch.dtype) -> bool:
        """Whether the kernel keeps blocks of ``dtype`` in a layout of its own (see ``to_layout``)."""
        return dtype == torch.bfloat16

    @staticmethod
    def to_layout(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., block_size, D]`` K and V blocks in the kernel's layout for their dtype: bf16 K as
        ``[..., block_size/16, D/2, 16, 2]`` and V as ``[..., block_size/2, D, 2]`` (same shapes back);
        float32 as they are."""
        if not DecodeAttentionKernel.uses_own_layout(key.dtype):
            return key, value
        *lead, block_size, head_dim = key.shape
        laid_key = key.reshape(*lead, block_size // 16, 16, head_dim // 2, 2).transpose(-3, -2)
        laid_value = value.reshape(*lead, block_size // 2, 2, head_dim).transpose(-2, -1)
        return laid_key.reshape(key.shape), laid_value.reshape(value.shape)

    @staticmethod
    def from_layout(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of ``to_layout``: blocks as torch reads them, ``[..., block_size, D]``."""
        if not DecodeAttentionKernel.uses_own_layout(key.dtype):
            return key, value
        *lead, block_size, head_dim = key.shape
        torch_key = key.reshape(*lead, block_size // 16, head_dim // 2, 16, 2).transpose(-3, -2)
        torch_value = value.reshape(*lead, block_size // 2, head_dim, 2).transpose(-2, -1)
        return torch_key.reshape(key.shape), torch_value.reshape(value.shape)

    def write(self, key: torch.Tensor, value: torch.Tensor, pool_key: torch.Tensor, pool_value: torch.Tensor,
              slots: torch.Tensor) -> None:
        """``key``/``value [T, Hkv, D]`` into one layer's pool ``[Hkv, blocks, block_size, D]`` at ``slots
        [T]`` (int64, block * block_size + position)."""
        tokens, num_kv_heads, head_dim = key.shape
        _check_activations(key, pool_key)
        key, value = _packed_rows(key, head_dim), _packed_rows(value, head_dim)
        self._write[pool_key.dtype](key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                    pool_key.data_ptr(), pool_value.data_ptr(), pool_key.shape[1],
                                    pool_key.shape[2], slots.data_ptr(), tokens, num_kv_heads, head_dim)

    def __call__(self, query: torch.Tensor, pool_key: torch.Tensor, pool_value: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, starts: torch.Tensor, max_len: int, scale: float,
                 new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``query [B, Hq, D]`` of each sequence's new token; ``pool_key``/``pool_value``: one layer's
        contiguous ``[Hkv, blocks, block_size, D]`` pool in the kernel's layout for their dtype; ``tables
        [B, n]`` int64 each sequence's blocks in order; ``lens``/``starts [B]`` int64 each sequence's
        context length with this token, and its first visible key; ``max_len`` the largest of ``lens``.
        ``new = (key, value, slots)``: each sequence's new ``[B, Hkv, D]`` K/V, written at ``slots [B]``
        first; without it the pool already holds them. ``softcap``: the scaled scores become ``softcap *
        tanh(score / softcap)``; ``sinks``: float32 ``[Hq]`` logits that join each head's softmax (None: neither).
        Returns the attended ``[B, Hq, D]``."""
        batch, num_heads, head_dim = query.shape
        num_kv_heads, pool_blocks, block_size = pool_key.shape[0], pool_key.shape[1], pool_key.shape[2]
        _check_activations(query, pool_key)
        query = _packed_rows(query, head_dim)
        key, value, slots = ((_packed_rows(new[0], head_dim), _packed_rows(new[1], head_dim), new[2])
                             if new is not None else (query, query, None))
        scores_stride = -(-max_len // 16) * 16 + 16
        needed = score_slots() * (num_heads // num_kv_heads) * scores_stride
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.float32)
        out = query.new_empty(batch, num_heads, head_dim)
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,)
                                  or not sinks.is_contiguous()):
            raise ValueError(f"sinks must be a contiguous float32 [{num_heads}] tensor, not {sinks.dtype} "
                             f"{tuple(sinks.shape)}")
        status = self._attend[pool_key.dtype](
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            pool_key.data_ptr(), pool_value.data_ptr(), pool_blocks, block_size,
            slots.data_ptr() if slots is not None else None, tables.data_ptr(), tables.stride(0),
            out.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            batch, num_heads, num_kv_heads, head_dim, scale, softcap or 0.0,
            sinks.data_ptr() if sinks is not None else None, self._scratch.data_ptr(), scores_stride)
        if status != 0:
            raise ValueError(f"decode attention cannot take {num_heads} heads over {num_kv_heads} KV heads "
                             f"of dimension {head_dim} in blocks of {block_size}")
        return out




@functools.cache
def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The kernel, built if needed; None where it cannot be (``kernels.bindings.library``)."""
    library = bindings.library()
    return DecodeAttentionKernel(library) if library is not None else None
