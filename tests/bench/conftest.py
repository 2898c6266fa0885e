"""What the benchmark scripts' tests share: running a script's CPU dry run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dry_run(tmp_path):
    """``dry_run("benchmarks/x.py", *args)``: run the script with ``--dry-run --out FILE`` and ``args`` from the
    repository root; assert it exits 0 and return (the finished process, the JSON it wrote)."""

    def run(script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
        out = tmp_path / "report.json"
        done = subprocess.run([sys.executable, script, "--dry-run", "--out", str(out), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done, json.loads(out.read_text())

    return run
