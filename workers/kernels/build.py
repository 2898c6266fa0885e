"""The kernel library built from ``csrc/`` with the machine's C compiler, and cached.

Why C and not a torch extension: the kernels need no torch headers (they take raw pointers), so they build
in seconds with ``cc`` alone, where ``torch.utils.cpp_extension`` needs ninja and a minute of C++ per
build; and why not a wheel: llmbus installs as pure Python on any torch. The library links OpenMP's
``libgomp.so.1``, which resolves to the copy torch already loaded, so the kernels' threads are torch's
threads (``torch.set_num_threads`` applies) rather than a second pool competing for the cores.

Every ``csrc/*.c`` is compiled as its own translation unit into one shared library, cached under
``$LLMBUS_KERNEL_CACHE`` (default ``~/.cache/llmbus/kernels``), keyed by the sources and headers, the
flags, the compiler and the CPU (``-march=native``).

``$LLMBUS_KERNEL_MARCH`` (default ``native``) is the ``-march`` the library is built for: ``x86-64-v3``
(AVX2, FMA, F16C, no AVX-512) builds on an AVX-512 machine exactly the code an AVX2-only CPU runs, so its
tests run there too (tests/workers/test_avx2_build.py). It must name a target this CPU can execute.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from llmbus.bus.procfs import cpu_identity

SOURCE_DIR = Path(__file__).with_name("csrc")
# -fno-trapping-math: without it gcc vectorises no loop that calls exp_nonpositive (the softmax's and SiLU's
# exp), as it may not speculate the float-to-int conversion; nothing here reads floating-point traps.
# -fvisibility=hidden: only what llmbus_kernels.h marks LLMBUS_API is exported.
# -flto: the sources are separate translation units, and the fused layer calls decode attention's and the
# GEMM's functions in its innermost loops; link-time optimisation inlines them across files, as the single
# file that #included the others did (without it a float32 batch-1 step was about 4% slower).
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-fvisibility=hidden",
         "-flto"]
DISABLE_ENV = "LLMBUS_CPU_KERNELS"
MARCH_ENV = "LLMBUS_KERNEL_MARCH"
CACHE_ENV = "LLMBUS_KERNEL_CACHE"
LIBRARY_NAME = "llmbus_kernels"


def disabled() -> bool:
    """Whether ``LLMBUS_CPU_KERNELS=0`` turns the kernels off."""
    return os.environ.get(DISABLE_ENV, "1") == "0"


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def flags(march: str | None = None) -> list[str]:
    """``FLAGS`` with ``march`` (default: ``$LLMBUS_KERNEL_MARCH``, else ``native``) as the target."""
    march = march or os.environ.get(MARCH_ENV) or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a -march target name")
    return [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS]


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmbus" / "kernels"


def _inputs(source_dir: Path) -> list[Path]:
    """What the build reads: the sources and the headers they include, in a fixed order."""
    return sorted([*source_dir.glob("*.c"), *source_dir.glob("*.h")])


def build(compiler: str, source_dir: Path = SOURCE_DIR, march: str | None = None) -> Path:
    """The library built from ``source_dir`` with ``compiler`` for ``march`` (``flags``), from the cache where
    it is there already. Raises RuntimeError (the compiler's message) or OSError / SubprocessError where it
    cannot be built."""
    inputs, build_flags = _inputs(source_dir), flags(march)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([*(path.name.encode() + b"\0" + path.read_bytes() for path in inputs),
                                     " ".join(build_flags).encode(), version.encode(),
                                     cpu_identity().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{LIBRARY_NAME}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: ranks starting together may build at once.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        sources = [str(path) for path in inputs if path.suffix == ".c"]
        result = subprocess.run([compiler, *build_flags, "-o", str(built), *sources], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target
