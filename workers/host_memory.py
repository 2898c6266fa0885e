"""The host's memory: how freed memory is kept for the next step. (How much the machine can still give, what
CPU-side sizing is checked against, is ``bus.procfs.mem_available_bytes``.)"""

from __future__ import annotations

import ctypes

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
