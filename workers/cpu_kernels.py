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
# -fno-trapping-math: without it gcc vectorises no loop that calls exp_nonpositive (the softmax's and SiLU's
# exp), as it may not speculate the float-to-int conversion; nothing here reads floating-point traps.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
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


def _local_includes(source_path: Path) -> list[Path]:
    """The sibling sources ``source_path`` includes with ``#include "name"``, recursively."""
    found = []
    for line in source_path.read_text().splitlines():
        if line.startswith('#include "'):
            included = source_path.with_name(line.split('"')[1])
            found += [included, *_local_includes(included)]
    return found


def _build(compiler: str, source_path: Path = SOURCE) -> Path:
    source = b"\0".join(path.read_bytes() for path in [source_path, *_local_includes(source_path)])
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
_ATTENTION_ARGTYPES = [_POINTER, _I64, _POINTER, _I64, _POINTER, _I64,  # query, new key, new value (+ row strides)
                       _POINTER, _POINTER, _I64, _I64,  # pool K/V, pool blocks, block size
                       _POINTER, _POINTER, _I64,  # slots (or null), block tables (+ row stride)
                       _POINTER, _POINTER, _POINTER,  # out, lens, starts
                       _I64, _I64, _I64, _I64, _F32, _POINTER, _I64]  # batch, heads, kv heads, head dim, scale, scratch
_WRITE_ARGTYPES = [_POINTER, _I64, _POINTER, _I64,  # new key, new value (+ row strides)
                   _POINTER, _POINTER, _I64, _I64,  # pool K/V, pool blocks, block size
                   _POINTER, _I64, _I64, _I64]  # slots, tokens, kv heads, head dim
# Per pool dtype: the C entries' suffix, and the dtype of the queries, new K/V and output they take. A
# float16 pool is a float32 model's narrower cache (--kv-cache-dtype float16).
_ENTRIES = {torch.bfloat16: ("bf16", torch.bfloat16), torch.float32: ("f32", torch.float32),
            torch.float16: ("f16kv", torch.float32)}


def _check_activations(tensor: torch.Tensor, pool: torch.Tensor) -> None:
    """The C entry of a pool reads queries and new K/V of one dtype only (``_ENTRIES``)."""
    if _ENTRIES[pool.dtype][1] != tensor.dtype:
        raise ValueError(f"a {pool.dtype} pool takes {_ENTRIES[pool.dtype][1]} activations, not {tensor.dtype}")


def _packed_rows(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows may be strided (views into the fused QKV output); within a row the heads must be packed."""
    return tensor if tensor.stride(2) == 1 and tensor.stride(1) == head_dim else tensor.contiguous()


class DecodeAttentionKernel:
    """``decode_attention.c`` loaded: decode attention over one layer's paged pool, read in place, and
    the write of tokens' K/V into the pool in the kernel's layout."""

    def __init__(self, library: ctypes.CDLL):
        self._attend, self._write = {}, {}
        for pool_dtype, (suffix, _) in _ENTRIES.items():
            attend, write = getattr(library, f"decode_attention_{suffix}"), getattr(library, f"write_kv_{suffix}")
            attend.argtypes, attend.restype = _ATTENTION_ARGTYPES, ctypes.c_int
            write.argtypes, write.restype = _WRITE_ARGTYPES, None
            self._attend[pool_dtype], self._write[pool_dtype] = attend, write
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
                 new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``query [B, Hq, D]`` of each sequence's new token; ``pool_key``/``pool_value``: one layer's
        contiguous ``[Hkv, blocks, block_size, D]`` pool in the kernel's layout for their dtype; ``tables
        [B, n]`` int64 each sequence's blocks in order; ``lens``/``starts [B]`` int64 each sequence's
        context length with this token, and its first visible key; ``max_len`` the largest of ``lens``.
        ``new = (key, value, slots)``: each sequence's new ``[B, Hkv, D]`` K/V, written at ``slots [B]``
        first; without it the pool already holds them. Returns the attended ``[B, Hq, D]``."""
        batch, num_heads, head_dim = query.shape
        num_kv_heads, pool_blocks, block_size = pool_key.shape[0], pool_key.shape[1], pool_key.shape[2]
        _check_activations(query, pool_key)
        query = _packed_rows(query, head_dim)
        key, value, slots = ((_packed_rows(new[0], head_dim), _packed_rows(new[1], head_dim), new[2])
                             if new is not None else (query, query, None))
        scores_stride = -(-max_len // 16) * 16 + 16
        needed = batch * num_heads * scores_stride
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.float32)
        out = query.new_empty(batch, num_heads, head_dim)
        status = self._attend[pool_key.dtype](
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            pool_key.data_ptr(), pool_value.data_ptr(), pool_blocks, block_size,
            slots.data_ptr() if slots is not None else None, tables.data_ptr(), tables.stride(0),
            out.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            batch, num_heads, num_kv_heads, head_dim, scale, self._scratch.data_ptr(), scores_stride)
        if status != 0:
            raise ValueError(f"decode attention cannot take {num_heads} heads over {num_kv_heads} KV heads "
                             f"of dimension {head_dim} in blocks of {block_size}")
        return out


def load_library(source: Path, falls_back: str) -> ctypes.CDLL | None:
    """``source`` built if needed and loaded; None where kernels are disabled (``LLMBUS_CPU_KERNELS=0``),
    there is no C compiler, or the build fails (logged, with ``falls_back``: what runs instead)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning(f"no C compiler found: {falls_back}", source=source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning(f"could not build {source.name}: {falls_back}", error=str(exc))
        return None


@functools.cache
def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The kernel, built if needed; None where it cannot be (logged once, with the reason)."""
    library = load_library(SOURCE, "decode attention runs on torch ops (slower)")
    return DecodeAttentionKernel(library) if library is not None else None


SAMPLING_SOURCE = Path(__file__).with_name("sampling.c")


class SamplingKernels:
    """``sampling.c`` loaded: the greedy choice, and the inverse-CDF draw, of float32 CPU logits ``[rows,
    vocab]`` (rows contiguous), with each chosen token's log-probability."""

    def __init__(self, library: ctypes.CDLL):
        self._greedy, self._sample = library.greedy_f32, library.sample_f32
        self._greedy.argtypes, self._greedy.restype = [_POINTER, _I64, _I64, _I64, _POINTER, _POINTER], ctypes.c_int
        self._sample.argtypes = [_POINTER, _POINTER, _I64, _I64, _I64] + [_POINTER] * 4 + [_I64] + [_POINTER] * 2
        self._sample.restype = ctypes.c_int
        self._scratch = torch.empty(0, dtype=torch.float32)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first argmax and its log-softmax."""
        rows, vocab = logits.shape
        ids, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
        self._greedy(logits.data_ptr(), rows, vocab, logits.stride(0), ids.data_ptr(), logprobs.data_ptr())
        return ids, logprobs

    def sample(self, logits: torch.Tensor, sampled: torch.Tensor, temperatures: torch.Tensor,
               uniforms: torch.Tensor, raw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the first argmax where ``sampled`` (bool) is False, else the inverse-CDF draw at
        ``uniforms`` from the softmax of the row divided by ``temperatures``; and each token's
        log-probability under that distribution. ``raw``: the logits before warpers masked ``logits``
        (same shape and strides), whose argmax a row takes when its scaled logits overflow."""
        raw = logits if raw is None else raw
        if raw.shape != logits.shape or raw.stride() != logits.stride():
            raise ValueError("raw logits must have the warped logits' shape and strides")
        rows, vocab = logits.shape
        threads = torch.get_num_threads()
        if self._scratch.numel() < threads * vocab:
            self._scratch = torch.empty(threads * vocab, dtype=torch.float32)
        sampled = sampled.to(torch.uint8).contiguous()
        temperatures, uniforms = temperatures.float().contiguous(), uniforms.float().contiguous()
        ids, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
        self._sample(logits.data_ptr(), raw.data_ptr(), rows, vocab, logits.stride(0), sampled.data_ptr(),
                     temperatures.data_ptr(), uniforms.data_ptr(), self._scratch.data_ptr(),
                     self._scratch.numel() // vocab, ids.data_ptr(), logprobs.data_ptr())
        return ids, logprobs


@functools.cache
def sampling_kernels() -> SamplingKernels | None:
    """``sampling.c`` built and loaded; None where it cannot be (logged once)."""
    library = load_library(SAMPLING_SOURCE, "tokens are chosen with torch's ops (slower)")
    return SamplingKernels(library) if library is not None else None
