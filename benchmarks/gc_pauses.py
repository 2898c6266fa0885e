"""What Python's garbage collector costs a worker: a full collection's pause with the startup heap in sight and
frozen out of it (``bus/gc_pauses.py``), and the collections a stretch of continuous batching makes.

    python benchmarks/gc_pauses.py [--requests 1500] [--new-tokens 64]

Each measurement runs in a fresh process that imports what a worker imports (torch, transformers, triton where
installed, llmbus's worker modules) and builds a small Llama runner on the CPU, warmed up: the heap a served
worker holds when it starts serving. Then, once as it is and once after ``freeze_startup_heap``:
1. a full collection (``gc.collect()``, median of 5): the pause a serving step waits through whenever one comes;
2. ``--requests`` requests driven through the runner in continuous batches (``llmbus.testing.runner_driver.drive``:
   two arrivals a step, chunked prompts beside decodes), the collections counted by ``GcPauses``: how many full ones the
   steps' own garbage brings, and their time.
The ratio printed is the full collection's pause without the freeze over with it.

    python benchmarks/gc_pauses.py --startup 5

A worker's start instead, in fresh processes taking turns: the CPU time from its first import of torch to the
collection before serving (imports, a small runner built and warmed up, ``freeze_startup_heap``), with those imports
made inside ``imports_frozen`` (as the worker makes them) and without; the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time


def measure(freeze: bool, requests: int, new_tokens: int) -> dict:
    import gc

    import torch
    import transformers  # noqa: F401  (a worker imports it: its objects are in the heap)

    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    from llmbus.bus.gc_pauses import GcPauses, freeze_startup_heap
    from llmbus.testing.runner_driver import BLOCK_SIZE, Request, drive, save_tiny_llama
    from llmbus.workers.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as model_dir:
        save_tiny_llama(model_dir, tied=False, vocab_size=512)
        runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=8192)
        runner.warmup()
        frozen = freeze_startup_heap() if freeze else 0
        tracked = len(gc.get_objects())
        pauses = []
        for _ in range(5):
            started = time.perf_counter()
            gc.collect()
            pauses.append(time.perf_counter() - started)
        generator = torch.Generator().manual_seed(0)
        work = [Request(f"r{i}", torch.randint(1, 512, (8 + i % 40,), generator=generator).tolist(),
                        arrival_step=i // 2, prefill_chunk=16, max_new_tokens=new_tokens) for i in range(requests)]
        counter = GcPauses().start()
        started = time.perf_counter()
        drive(runner, work)
        seconds = time.perf_counter() - started
        counter.stop()
        return dict(freeze=freeze, frozen=frozen, tracked=tracked, full_collection_ms=statistics.median(pauses) * 1e3,
                    drive_s=seconds, **counter.take())


def startup_cpu_s(frozen_imports: bool) -> float:
    """CPU seconds of a worker's start in this fresh process (see the module's docstring)."""
    import contextlib

    started = time.process_time()
    from llmbus.bus.gc_pauses import freeze_startup_heap, imports_frozen

    with imports_frozen() if frozen_imports else contextlib.nullcontext():
        import torch  # noqa: F401

        from llmbus.testing.runner_driver import BLOCK_SIZE, save_tiny_llama
        from llmbus.workers.model_runner import ModelRunner
    with tempfile.TemporaryDirectory() as model_dir:
        save_tiny_llama(model_dir, tied=False, vocab_size=512)
        ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=64).warmup()
        freeze_startup_heap()
    return time.process_time() - started


def compare_startups(rounds: int) -> None:
    cpu: dict[str, list[float]] = {"as before": [], "imports frozen": []}
    for _ in range(rounds):
        for which in cpu:
            done = subprocess.run([sys.executable, __file__, "--one-startup", which], capture_output=True, text=True,
                                  check=True)
            cpu[which].append(float(done.stdout.strip().splitlines()[-1]))
    for which, seconds in cpu.items():
        print(f"{which:15} median {statistics.median(seconds):.3f} CPU s  ({', '.join(f'{s:.3f}' for s in seconds)})")
    before, after = (statistics.median(seconds) for seconds in cpu.values())
    print(f"a worker's start with its imports frozen: {after / before:.3f}x the CPU ({before - after:.3f} s less)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--startup", type=int, metavar="ROUNDS", help="measure a worker's start instead")
    parser.add_argument("--one", choices=("frozen", "unfrozen"), help=argparse.SUPPRESS)  # a child's measurement
    parser.add_argument("--one-startup", choices=("as before", "imports frozen"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_startup:
        print(startup_cpu_s(args.one_startup == "imports frozen"))
        return 0
    if args.startup:
        compare_startups(args.startup)
        return 0
    if args.one:
        print(json.dumps(measure(args.one == "frozen", args.requests, args.new_tokens)))
        return 0
    rows = []
    for which in ("unfrozen", "frozen"):
        done = subprocess.run([sys.executable, __file__, "--one", which, "--requests", str(args.requests),
                               "--new-tokens", str(args.new_tokens)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'heap':9} {'tracked':>8} {'frozen':>8} {'full gc ms':>10} {'drive s':>8} {'collections':>11} "
          f"{'full':>5} {'gc ms':>8} {'longest ms':>10}")
    for row in rows:
        print(f"{'frozen' if row['freeze'] else 'as is':9} {row['tracked']:8d} {row['frozen']:8d} "
              f"{row['full_collection_ms']:10.2f} {row['drive_s']:8.1f} {row['gc_collections']:11d} "
              f"{row['gc_full']:5d} {row['gc_ms']:8.1f} {row['gc_longest_ms']:10.2f}")
    as_is, frozen = rows
    print(f"a full collection's pause: {as_is['full_collection_ms']:.1f} ms as is, {frozen['full_collection_ms']:.2f} "
          f"ms frozen ({as_is['full_collection_ms'] / max(frozen['full_collection_ms'], 1e-3):.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
