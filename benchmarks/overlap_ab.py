"""Overlapped scheduling against lock-step, served, in one run (issue #39's CPU target: c=1 SmolLM2 float32,
overlap on / off >= 1.08x decode tokens/s).

    python benchmarks/overlap_ab.py [--concurrency 1] [--rounds 4] [--requests 4] [--new-tokens 128]
                                    [--dtype float32] [-- more `llmbus up` flags]

Two `llmbus up` launches of this checkout on SmolLM2, one as it is (the scheduler sends the next step while
one computes) and one with --disable-overlap (each step sent once the last one's tokens are back), run side
by side (an idle server takes no CPU) and measured in turn, alternating which goes first, each round on
prompts of its own (neither engine's prefix cache helps). Per server and round it prints served_ab.py's
breakdown (tokens/s, median time between tokens, the worker's forward pass a decode step, the scheduler's
time from sending a step to its result, CPU milliseconds a token by service); then the tokens/s ratio
(overlap / lock-step) per round and their median.

On a 2-core machine the worker's two threads share the cores with the scheduler and the frontend, so the overlap
has no idle core to use; gpu_check.py's part 6 measures the same on the lent GPU machine's host CPU.
"""

from __future__ import annotations

import argparse

from _revision import add_model_arguments
from _server import READY_TIMEOUT_S, exit_on_sigterm
from served_ab import add_load_arguments, alternate, launch

from llmbus.bus.procfs import load_average
from llmbus.testing import Server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    add_load_arguments(p)
    a = p.parse_args()
    exit_on_sigterm()
    tokenizer, args = launch(a)
    print(f"load average before: {load_average()}", flush=True)
    with Server(args, ready_timeout=READY_TIMEOUT_S) as overlap, \
            Server([*args, "--disable-overlap"], ready_timeout=READY_TIMEOUT_S) as lock_step:
        alternate(a, tokenizer, ("overlap", overlap), ("lock-step", lock_step))


if __name__ == "__main__":
    main()
