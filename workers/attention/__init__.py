"""Attention over the paged KV cache, behind one interface (``AttentionBackend``, in ``base.py``).

Backends, and where each is picked (``make_attention_backend``):
- ``CPUKernelBackend`` (``cpu.py``, its kernel ``decode_kernel.py``): CPU with the C kernels built (a C
  compiler is there): decodes read the pool in place; prompts take the portable path, or the kernel too
  (``prompt_rows``).
- ``TorchSDPABackend`` (``torch_sdpa.py``): everywhere else: gathers blocks, then SDPA or batched matmuls.
A GPU backend over a paged kernel library (FlashInfer's paged prefill and decode wrappers, page size 16)
fills the same two calls: it goes first in ``BACKENDS`` with an ``available`` that checks the device and
the library's import, and owns its pool layout as the CPU backend does.
"""

from __future__ import annotations

import torch

from llmbus.workers.attention.base import AttentionBackend, AttentionMetadata, KernelRows
from llmbus.workers.attention.cpu import CPUKernelBackend
from llmbus.workers.attention.torch_sdpa import TorchSDPABackend

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "CPUKernelBackend", "KernelRows", "TorchSDPABackend",
           "make_attention_backend"]

# Tried in order; the first available one is used. The portable backend is always available.
BACKENDS: tuple[type[AttentionBackend], ...] = (CPUKernelBackend, TorchSDPABackend)


def make_attention_backend(device: torch.device,
                           sliding_windows: list[int | None] | tuple[int | None, ...] = (), *,
                           prompt_rows: bool = False) -> AttentionBackend:
    """The first backend of ``BACKENDS`` available on ``device``, told each layer's sliding window (None:
    full attention) and whether to give steps with prompts as kernel rows (``AttentionBackend``)."""
    backend = next(cls for cls in BACKENDS if cls.available(device))
    return backend(sliding_windows, prompt_rows=prompt_rows)
