"""C kernels for the CPU path, compiled on first use with the machine's C compiler and loaded with ctypes.

Why C and not a torch extension: the kernel needs no torch headers (it takes raw pointers), so it builds
in about a second with ``cc`` alone, where ``torch.utils.cpp_extension`` needs ninja and a minute of
C++ per build; and why not a wheel: llmbus installs as pure Python on any torch. The library links
OpenMP's ``libgomp.so.1``, which resolves to the copy torch already loaded, so the kernel's threads are
torch's threads (``torch.set_num_threads`` applies) rather than a second pool competing for the cores.

The library is cached under ``$LLMBUS_KERNEL_CACHE`` (default ``~/.cache/llmbus/kernels``), keyed by
the source, the flags, the compiler and the CPU (``-march=native``). Where there is no compiler, or the
build fails, or ``LLMBUS_CPU_KERNELS=0``, ``decode_attention_kernel()`` returns None and attention runs
on torch ops: slower, same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
DISABLE_ENV = "LLMBUS_CPU_KERNELS"
CACHE_ENV = "LLMBUS_KERNEL_CACHE"

log = structlog.get_logger("llmbus.workers.cpu_kernels")


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmbus" / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _build(compiler: str, source_path: Path = SOURCE) -> Path:
    source = source_path.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: ranks starting together may build at once.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source_path)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


_POINTER, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_POINTER, _I64, _POINTER, _I64, _POINTER, _I64,  # query, new key, new value (+ row strides)
             _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _I64,  # mirror K/V, pool K/V, pool slots, size
             _POINTER, _POINTER, _POINTER,  # out, lens, starts
             _I64, _I64, _I64, _I64, _I64, _F32, _POINTER]  # batch, heads, kv heads, capacity, head dim, ...


class DecodeAttentionKernel:
    """``decode_attention.c`` loaded: one call per layer of a decode step over the K/V mirror."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        for dtype, name in ((torch.bfloat16, "decode_attention_bf16"), (torch.float32, "decode_attention_f32")):
            function = getattr(library, name)
            function.argtypes = _ARGTYPES
            function.restype = ctypes.c_int
            self._functions[dtype] = function
        self._scratch = torch.empty(0, dtype=torch.float32)

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._functions and head_dim % 2 == 0

    @staticmethod
    def layout(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., capacity, D]`` K and V (capacity a multiple of 16) in the kernel's layout for their
        dtype: bf16 K as ``[..., capacity/16, D/2, 16, 2]`` and V as ``[..., capacity/2, D, 2]``; float32
        as they are."""
        if key.dtype != torch.bfloat16:
            return key, value
        *lead, capacity, head_dim = key.shape
        key = key.view(*lead, capacity // 16, 16, head_dim // 2, 2).transpose(-3, -2).contiguous()
        value = value.view(*lead, capacity // 2, 2, head_dim).transpose(-2, -1).contiguous()
        return key, value

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mirror_key: torch.Tensor,
                 mirror_value: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, scale: float,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``query [B, Hq, D]``, ``key``/``value [B, Hkv, D]``; ``mirror_key``/``mirror_value`` contiguous
        ``[Hkv, B, ...]`` in the layout ``layout`` gives their dtype; ``lens``/``starts [B]`` int64: each
        sequence's context length with this token, and its first visible key. Writes the new K/V at
        ``lens - 1`` in the mirror and, with ``pool = (key slots [Hkv, S, D], value slots, slots [B])``,
        into the pool; returns the attended ``[B, Hq, D]``."""
        batch, num_heads, head_dim = query.shape
        num_kv_heads = mirror_key.shape[0]
        capacity = mirror_key[0, 0].numel() // head_dim  # positions per pair, whatever the layout
        # Rows may be strided (views into the fused QKV output); within a row the heads must be packed.
        query, key, value = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()
                             for t in (query, key, value))
        needed = batch * num_heads * (capacity + 16)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.float32)
        out = query.new_empty(batch, num_heads, head_dim)
        pool_key, pool_value, slots = pool if pool is not None else (None, None, None)
        status = self._functions[query.dtype](
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            mirror_key.data_ptr(), mirror_value.data_ptr(),
            pool_key.data_ptr() if pool is not None else None, pool_value.data_ptr() if pool is not None else None,
            slots.data_ptr() if pool is not None else None, pool_key.shape[1] if pool is not None else 0,
            out.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            batch, num_heads, num_kv_heads, capacity, head_dim, scale, self._scratch.data_ptr())
        if status != 0:
            raise ValueError(f"decode attention cannot take {num_heads} heads over {num_kv_heads} KV heads "
                             f"of dimension {head_dim}")
        return out


@functools.cache
def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The kernel, built if needed; None where it cannot be (logged once, with the reason)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention runs on torch ops (slower)")
        return None
    try:
        return DecodeAttentionKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("could not build the decode attention kernel: it runs on torch ops (slower)", error=str(exc))
        return None
