"""Python's garbage collector in a serving process: the heap built at start kept out of its sight, and the pauses
that remain counted.

A full collection walks every object the collector tracks. A worker that has imported torch, transformers and
Triton and built its runner holds some 425,000 of them, and a full collection there took about 200 ms on this
project's CPU (``benchmarks/gc_pauses.py``): on a GPU, a step the host cannot launch for that long, the device idle
meanwhile. Full collections come whenever the objects that survived the younger generations since the last one
reach a quarter of the old generation, which a server's per-request objects do every few seconds of serving.
Those started-up objects live as long as the process, so after its warmup each service collects once and
freezes what is left (``gc.freeze``: into a generation the collector never walks), as vLLM and SGLang do; a
full collection then walks only what serving made.
"""

from __future__ import annotations

import contextlib
import gc
import time


@contextlib.contextmanager
def imports_frozen():
    """Heavy imports (torch's, some 200,000 objects) with the collector paused, and what they built then frozen.

    Their objects live as long as the process, yet while they pile up each full collection that their growth
    triggers walks all of them again, and the one before serving (``freeze_startup_heap``) once more. Frozen here,
    those walks skip them: a rank of the tiny demo model started in 1.96 s of CPU instead of 2.41 (medians of 6
    ``llmbus up`` starts each, 2-core Zen 3); ``benchmarks/gc_pauses.py --startup`` measures the same on a
    runner built in-process."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> int:
    """Collect once, then move every object still alive out of the collector's sight; the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collections and the time they took since the last ``take``, through ``gc.callbacks`` (installed by
    ``start``, removed by ``stop``): what a window of the device timeline reports beside its idle time."""

    def __init__(self):
        self._started = 0.0
        self.collections = 0
        self.full_collections = 0
        self.seconds = 0.0
        self.longest_s = 0.0

    def start(self) -> "GcPauses":
        gc.callbacks.append(self._on_collection)
        return self

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.collections += 1
        self.full_collections += info["generation"] == 2
        self.seconds += took
        self.longest_s = max(self.longest_s, took)

    def take(self) -> dict[str, float]:
        """The window's collections (all, and full ones), their milliseconds and the longest; counts reset."""
        said = {"gc_collections": self.collections, "gc_full": self.full_collections,
                "gc_ms": round(self.seconds * 1e3, 2), "gc_longest_ms": round(self.longest_s * 1e3, 2)}
        self.collections = self.full_collections = 0
        self.seconds = self.longest_s = 0.0
        return said
