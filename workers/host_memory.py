"""The host's memory: how freed memory is kept for the next step, and how much oneDNN's shape-keyed caches
may hold. (How much the machine can still give, what CPU-side sizing is checked against, is
``bus.procfs.mem_available_bytes``.)"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# oneDNN's GEMMs (workers/linear.py's packed projections: float32 prompts and steps past 8 rows, and any
# projection the fused layer does not take) are built per input shape, i.e. per row count, and kept in two
# caches of 1024 entries each by default: ideep's (LRU_CACHE_CAPACITY, the primitive descriptors) and oneDNN's
# own (ONEDNN_PRIMITIVE_CACHE_CAPACITY, the primitives with their JIT code). Each entry holds about 300 KiB,
# so a server whose steps take ever new row counts (prompts of every length, speculation's verification rows)
# grew by up to ~600 MiB over an hour (issue #36; docs/architecture.md, "Memory").
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4

# madvise advice values (linux/mman.h); MADV_COLLAPSE is Linux 6.1's
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
HUGE_PAGE_BYTES = 2 * 1024 * 1024
# A rank's heap past its KV pool below this is left on the pages it has. Past the pool the heap holds the
# weights and what the warmup's activations freed: 96 MB for the demo model's few MB of weights, 370 MB and more
# for SmolLM2-135M (268 MB of weights in bf16), the smallest model served for real and the one the gain was
# measured on.
MIN_HUGE_HEAP_BYTES = 256 * 1024 * 1024
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether this kernel gives transparent huge pages (mode ``always`` or ``madvise``)."""
    return THP_MODE.is_file() and "[never]" not in THP_MODE.read_text()


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


def heap_on_huge_pages(min_bytes: int = 0, besides: int = 0) -> int | None:
    """Ask the kernel to put this process's heap on 2 MB pages, once its weights are in place: returns the
    bytes of the span asked for, or None where it cannot be asked (not Linux, no transparent huge pages, no
    heap, no madvise) or is not worth asking: the span less ``besides`` (a KV pool, one tensor whose blocks
    torch's allocator marks for huge pages itself) under ``min_bytes``. Weights that small stream from the
    caches, not through the TLB, and the collapse costs 0.3-2 s of CPU at start whatever the model
    (``MIN_HUGE_HEAP_BYTES``).

    With keep_freed_memory every block comes from glibc's heap, and torch's allocator (THP_MEM_ALLOC_ENABLE)
    marks each block of 2 MB or more for huge pages on its own. A model's projections are many blocks of a
    few MB, each with a tail short of a 2 MB boundary, and its smaller tensors are not marked at all: in a
    rank that loaded SmolLM2, 108-125 of the fused layer's 268 MB of weights were on huge pages, and its
    batch-1 decode steps took 5.5-6% longer than those of a second runner built in the same process, whose
    weights reused freed blocks that were. Marking the heap's whole span (MADV_HUGEPAGE, which also merges
    the many areas the per-block marks split it into) and collapsing it now (MADV_COLLAPSE, synchronous, on
    Linux 6.1 and later; khugepaged does it in the background on older kernels) puts 255 of the 268 MB on
    huge pages in half a second, for 2 MB more resident memory (design notes, "Large CPU blocks on 2 MB
    pages"). Parts that cannot be collapsed stay as they are: the call's errors are not failures."""
    if not huge_pages_offered():
        return None
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps if line.split()[-1] == "[heap]"]
    if not spans:
        return None
    start = -(-min(a for a, _ in spans) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = max(b for _, b in spans) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start or end - start - besides < min_bytes:
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    madvise(start, end - start, _MADV_HUGEPAGE)
    madvise(start, end - start, _MADV_COLLAPSE)
    return end - start
