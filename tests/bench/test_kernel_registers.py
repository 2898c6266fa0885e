"""benchmarks/kernel_registers.py: the attention kernel's variants and the other kernels of a step's graphs compile
for an H100 (sm_90) here, without a GPU, and those a Llama-family model serves spill no registers. The
interpreter that checks their numerics runs Python: a kernel it runs may still not compile (it happened: a
tile's name reused in the key loop with another shape), or spill to local memory on the device (the first
NEW_KV loop spilled 712 bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this triton has no NVIDIA backend to compile with", allow_module_level=True)


def test_the_kernels_compile_for_sm90_and_the_served_ones_do_not_spill():
    # ptxas's reports kept beside triton's compiled kernels, by their PTX: a kernel changed is compiled and
    # checked afresh, an unchanged one costs no ptxas run (most of the script's time with triton's cache warm)
    reports = Path(triton.knobs.cache.dir) / "kernel_registers_ptxas"
    done = subprocess.run([sys.executable, "benchmarks/kernel_registers.py", "--json", "--ptxas-cache", str(reports)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 12 + 3 + 8 and not [r for r in rows if "error" in r], rows
    assert all(r["registers"] <= 255 for r in rows)
    # without a window: Llama 3's attention, decodes and the piecewise steps' prompt tiles alike, and the
    # other kernels of a step's graphs
    assert all(r["spilled_bytes"] == 0 for r in rows if "window" not in r["name"]), rows
