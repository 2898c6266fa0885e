"""Triton's kernels on the CPU, by its interpreter (``TRITON_INTERPRET=1``), for tests in a process where other
modules may have imported triton without it."""

from __future__ import annotations

import importlib
import os
import sys

import pytest


# Our modules of Triton kernels: each decorates its kernels when imported, for the interpreter or not.
KERNEL_MODULES = ("llmbus.workers.attention.triton_kernels", "llmbus.workers._gpu_ops_kernels")


def _interpreted(module) -> bool:
    kernel = next(v for k, v in vars(module).items() if k.endswith("_kernel"))
    return type(kernel).__name__ == "InterpretedFunction"


def interpreted_triton_kernels():
    """``triton_kernels`` (the attention kernels) decorated for Triton's interpreter, and ``gpu_ops``' kernels
    too. triton.jit reads TRITON_INTERPRET when a function is decorated, and triton decorates its own library
    functions (tl.sum, tl.max, ...) when it is first imported, so both must happen under the variable. Where
    another module of this process imported triton without it (every xdist worker collects every test
    module), triton's Python modules and ours are imported again (its compiled extension stays loaded). The
    variable is set only meanwhile, and again while the tests run (their ``interpret`` fixtures): servers that
    other tests of this process start must not inherit it."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        standard = importlib.import_module("triton.language.standard")
        ours = [sys.modules[name] for name in KERNEL_MODULES if name in sys.modules]
        if type(standard.sum).__name__ != "InterpretedFunction" or not all(_interpreted(m) for m in ours):
            stale = [name for name in sys.modules if name in KERNEL_MODULES
                     or (name.split(".")[0] == "triton" and not name.startswith("triton._C"))]
            for name in stale:
                del sys.modules[name]
        from llmbus.workers import gpu_ops

        gpu_ops._triton.cache_clear()
        for name in KERNEL_MODULES:
            importlib.import_module(name)
        return importlib.import_module("llmbus.workers.attention.triton_kernels")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
