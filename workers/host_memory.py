"""The host's memory: how freed memory is kept for the next step, and how much oneDNN's shape-keyed caches
may hold. (How much the machine can still give, what CPU-side sizing is checked against, is
``bus.procfs.mem_available_bytes``.)"""

from __future__ import annotations

import ctypes
import os

# oneDNN's GEMMs (workers/linear.py's packed projections: float32 prompts and steps past 8 rows, and any
# projection the fused layer does not take) are built per input shape, i.e. per row count, and kept in two
# caches of 1024 entries each by default: ideep's (LRU_CACHE_CAPACITY, the primitive descriptors) and oneDNN's
# own (ONEDNN_PRIMITIVE_CACHE_CAPACITY, the primitives with their JIT code). Each entry holds about 300 KiB,
# so a server whose steps take ever new row counts (prompts of every length, speculation's verification rows)
# grew by up to ~600 MiB over an hour (issue #36; docs/architecture.md, "Memory").
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve every block from its heap and keep what is freed there, for this process.

    By default a block of 32 MB or more (a prompt step's activations: [4096, 3072] float32 is 50 MB) is
    mapped afresh on each allocation and unmapped on free, so every step page-faults all of it in again,
    the kernel zeroing each page, which costs a prompt step a good share of its CPU time (design notes,
    "Freed memory stays in the heap"). Decode steps allocate little and were already free of faults.
    The cost: the heap keeps its peak size (vLLM and SGLang get the same from tcmalloc or jemalloc,
    preloaded). Returns False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def bound_onednn_caches(capacity: int) -> dict[str, str]:
    """Cap oneDNN's shape-keyed caches (``ONEDNN_CACHE_VARIABLES``) at ``capacity`` entries each, for this
    process; a variable the operator set keeps its value. Both are read at the first oneDNN operation, so
    this must run before any (importing torch is fine). Returns each variable's effective value."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in ONEDNN_CACHE_VARIABLES}
