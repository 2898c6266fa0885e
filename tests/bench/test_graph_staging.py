"""benchmarks/graph_staging.py runs as a user runs it (on the CPU: the graph buffers uncaptured, the Triton
backend interpreted) and its own check of the staged ids, positions and KV slots holds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_graph_staging_measures_and_checks_its_rows():
    done = subprocess.run([sys.executable, "benchmarks/graph_staging.py", "--rows", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"staging 8 rows on cpu: median [0-9.]+ us a step", done.stdout), done.stdout[-2000:]
