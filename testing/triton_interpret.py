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
        lighten_the_interpreter()
        return importlib.import_module("llmbus.workers.attention.triton_kernels")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def lighten_the_interpreter() -> None:
    """Take out of Triton's interpreter work it repeats in every program and that never changes what the kernels
    compute (``patch_language_once_per_launch``, ``numpy_dtypes_looked_up_once``): a quarter of its time here.
    Only the interpreter is touched: the GPU's compiled kernels never take these paths."""
    patch_language_once_per_launch()
    numpy_dtypes_looked_up_once()


def patch_language_once_per_launch() -> None:
    """Make Triton's interpreter patch ``triton.language`` for a called ``@triton.jit`` function (``tl.sum``,
    ``tl.max``, ``rotate_halves``) once per launch instead of at every call: triton 3.7 repatches every module
    the callee sees at each call, in each program (``InterpretedFunction.__call__``): some 0.7 ms, about a
    third of an interpreted ``rms_norm`` row, and twice per tile of keys in the attention. The patches are the
    same each time (wrappers of the same builtins; the launch itself patches the kernel's own modules and
    restores them after), so what the kernels compute does not change, only how often the interpreter sets
    them up. Outside a launch, or where triton's interpreter is not laid out as this expects, nothing changes."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if (getattr(interpreter.InterpretedFunction, "_patched_once_per_launch", False)
            or not all(hasattr(interpreter, name) for name in ("_patch_lang", "InterpreterError", "GridExecutor"))):
        return
    grid_call, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    launch = {"id": None, "count": 0}
    patched_in: dict = {}  # the callee's function -> the launch it was last patched in

    def run_grid(self, *args, **kwargs):
        launch["count"] += 1
        launch["id"] = launch["count"]
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["id"] = None

    def call_device_function(self, *args, **kwargs):
        if launch["id"] is None:
            return device_call(self, *args, **kwargs)
        if patched_in.get(self.fn) != launch["id"]:
            interpreter._patch_lang(self.fn)
            patched_in[self.fn] = launch["id"]
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = run_grid
    interpreter.InterpretedFunction.__call__ = call_device_function
    interpreter.InterpretedFunction._patched_once_per_launch = True


def numpy_dtypes_looked_up_once() -> None:
    """Each operation's numpy dtype from a table kept between calls: triton 3.7's ``_get_np_dtype`` builds its
    table of 17 types (hashing each) at every call, several times an operation, a tenth of an interpreted
    ``rms_norm``. A block's is its element's, as there; what it cannot key (a pointer type) it leaves to
    triton's function."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "_looked_up_once", False):
        return
    block_type = interpreter.tl.block_type
    known: dict = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        try:
            return known[key]
        except (KeyError, TypeError):  # not seen yet; unhashable
            found = lookup(tt_dtype)
        try:
            known[key] = found
        except TypeError:
            pass
        return found

    np_dtype._looked_up_once = True
    interpreter._get_np_dtype = np_dtype
