"""Triton's kernels on the CPU, by its interpreter (``TRITON_INTERPRET=1``), for tests in a process where other
modules may have imported triton without it."""

from __future__ import annotations

import importlib
import os
import sys

import pytest


def interpreted_triton_kernels():
    """``triton_kernels`` decorated for Triton's interpreter. triton.jit reads TRITON_INTERPRET when a
    function is decorated, and triton decorates its own library functions (tl.sum, tl.max, ...) when it is
    first imported, so both must happen under the variable. Where another module of this process imported
    triton without it (every xdist worker collects every test module), triton's Python modules are imported
    again (its compiled extension stays loaded). The variable is set only meanwhile, and again while this
    module's tests run (``interpret``): servers that other tests of this process start must not inherit it."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        standard = importlib.import_module("triton.language.standard")
        ours = sys.modules.get("llmbus.workers.attention.triton_kernels")
        if type(standard.sum).__name__ != "InterpretedFunction" or (ours and not ours.interpreted()):
            stale = [name for name in sys.modules if name == "llmbus.workers.attention.triton_kernels"
                     or (name.split(".")[0] == "triton" and not name.startswith("triton._C"))]
            for name in stale:
                del sys.modules[name]
        return importlib.import_module("llmbus.workers.attention.triton_kernels")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
