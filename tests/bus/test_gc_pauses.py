"""``bus/gc_pauses.py``: the startup heap frozen out of the collector's sight, while what serving makes is still
collected; the collections counted per window. The freeze runs in a process of its own (it would freeze this
test process's heap for good)."""

from __future__ import annotations

import gc
import subprocess
import sys

from llmbus.bus.gc_pauses import GcPauses

FREEZE = """
import gc
from llmbus.bus.gc_pauses import freeze_startup_heap

class Node:
    def __init__(self):
        self.other = self

startup = [Node() for _ in range(10_000)]  # alive for good, as a model's objects are
assert len(gc.get_objects()) > 10_000
frozen = freeze_startup_heap()
assert frozen > 10_000, frozen
assert len(gc.get_objects()) < 1_000  # a full collection walks none of them now
for _ in range(100):
    Node()  # cycles made while serving, garbage at once
assert gc.collect() >= 100  # ... are still collected
print("ok")
"""


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    done = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_collections_are_counted_per_window_while_installed():
    pauses = GcPauses().start()
    try:
        gc.collect()
        gc.collect(0)
        window = pauses.take()
    finally:
        pauses.stop()
    assert window["gc_collections"] >= 2 and window["gc_full"] >= 1, window
    assert window["gc_ms"] >= window["gc_longest_ms"] >= 0
    assert pauses.take()["gc_collections"] == 0  # taken: the next window starts from nothing
    gc.collect()
    assert pauses.take()["gc_collections"] == 0  # stopped: no longer counted
