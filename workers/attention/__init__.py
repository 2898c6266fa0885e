"""Attention over the paged KV cache, behind one interface (``AttentionBackend``, in ``base.py``).

Backends, by their ``name`` (``--attention-backend``'s choices; ``make_attention_backend`` makes one):
- ``triton`` (``triton.py``): paged kernels written in Triton, reading and writing the pool in place; CUDA,
  or any device under ``TRITON_INTERPRET=1`` (slowly: how CI tests it on CPU). auto's choice on CUDA.
- ``cpu_kernel`` (``cpu.py``, its kernel ``decode_kernel.py``): CPU with the C kernels built (a C compiler
  is there): decodes read the pool in place; prompts take the portable path, or the kernel too
  (``prompt_rows``). auto's choice on CPU.
- ``torch_sdpa`` (``torch_sdpa.py``): the portable one, everywhere: gathers blocks, then SDPA or batched
  matmuls. auto's choice where the device's own backend is not available.
"""

from __future__ import annotations

import importlib

import torch

from llmbus.bus.service import ServiceError
from llmbus.workers.attention.base import AttentionBackend, AttentionMetadata, KernelRows
from llmbus.workers.attention.cpu import CPUKernelBackend
from llmbus.workers.attention.torch_sdpa import TorchSDPABackend

__all__ = ["AttentionBackend", "AttentionBackendUnavailable", "AttentionMetadata", "BACKEND_CLASSES",
           "CPUKernelBackend", "KernelRows", "TorchSDPABackend", "attention_backend_class",
           "make_attention_backend"]

# Every backend as "module:class", imported when chosen: a backend whose module or library (triton) is
# missing fails only where it is asked for, with its reason, and costs nothing to a rank that does not use it.
BACKEND_CLASSES: dict[str, str] = {
    "triton": "llmbus.workers.attention.triton:TritonAttentionBackend",
    "cpu_kernel": "llmbus.workers.attention.cpu:CPUKernelBackend",
    "torch_sdpa": "llmbus.workers.attention.torch_sdpa:TorchSDPABackend",
}
# auto: per device type, the first of these that imports and is available; the portable one always is.
# On CPU the Triton backend stays out even under TRITON_INTERPRET=1: the interpreter is for tests, and slow.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch_sdpa"), "cpu": ("cpu_kernel", "torch_sdpa")}
PORTABLE = "torch_sdpa"
# TGI's ATTENTION values: its own kernels, all over a paged cache, which every backend here reads; taken as auto.
TGI_ATTENTION_NAMES = ("flashinfer", "flashdecoding", "paged")
# What a backend needs, for the error when one named explicitly cannot run.
NEEDS: dict[str, str] = {
    "triton": ("triton installed (torch's CUDA wheels bring it; else pip install triton) and a CUDA device, or "
               "TRITON_INTERPRET=1 in the environment to run its kernels on CPU, slowly"),
    "cpu_kernel": "a CPU device and llmbus's C kernels built (a C compiler at first start)",
}


class AttentionBackendUnavailable(ServiceError):
    """An attention backend named explicitly that does not exist or cannot run here: its message says why,
    so a rank stops with it and no traceback."""


def _import(name: str) -> type[AttentionBackend]:
    if name not in BACKEND_CLASSES:
        raise AttentionBackendUnavailable(f"unknown attention backend {name!r}: choose auto or one of "
                                          f"{', '.join(BACKEND_CLASSES)}")
    module_name, class_name = BACKEND_CLASSES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing == module_name:
            raise AttentionBackendUnavailable(f"attention backend {name!r} is not part of this llmbus "
                                              f"({module_name} is missing)") from e
        hint = f": pip install {missing}" if missing and "." not in missing else ""
        raise AttentionBackendUnavailable(f"attention backend {name!r} cannot be imported ({e}){hint}") from e
    return getattr(module, class_name)


def attention_backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class ``name`` ("auto": the device's default) picks on ``device``; a backend named
    explicitly that is unknown, not importable or not available on ``device`` raises
    ``AttentionBackendUnavailable`` saying why, rather than falling back to another one silently."""
    if name == "auto" or name in TGI_ATTENTION_NAMES:
        for candidate in AUTO_ORDER.get(device.type, (PORTABLE,)):
            try:
                cls = _import(candidate)
            except AttentionBackendUnavailable:
                continue
            if cls.available(device):
                return cls
        return _import(PORTABLE)
    cls = _import(name)
    if not cls.available(device):
        needs = NEEDS.get(name, "another device")
        raise AttentionBackendUnavailable(f"attention backend {name!r} cannot run on {device}: it needs {needs}. "
                                          f"Use --attention-backend auto (or {PORTABLE}, which runs everywhere)")
    return cls


def make_attention_backend(device: torch.device,
                           sliding_windows: list[int | None] | tuple[int | None, ...] = (), *,
                           prompt_rows: bool = False, name: str = "auto",
                           softcaps: list[float | None] | tuple[float | None, ...] = (),
                           sinks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] = ()
                           ) -> AttentionBackend:
    """Backend ``name`` (``attention_backend_class``) on ``device``, told each layer's sliding window
    (None: full attention), soft cap and sinks, and whether to give steps with prompts as kernel rows
    (``AttentionBackend``)."""
    return attention_backend_class(name, device)(sliding_windows, prompt_rows=prompt_rows, softcaps=softcaps,
                                                 sinks=sinks)
