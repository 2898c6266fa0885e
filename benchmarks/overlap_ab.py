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
"""

from __future__ import annotations

import argparse
import statistics
import time

from _revision import comparison_model
from _server import READY_TIMEOUT_S, exact_token_prompt, exit_on_sigterm
from served_ab import measure, show
from vs_llama_server import KV_TOKENS, kv_bytes_for

from llmbus.bus.procfs import load_average
from llmbus.testing import Server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None,
                   help="default: SmolLM2's bfloat16 folder (_smollm2.dense_folder), served in --dtype")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=4, help="measured requests per server and round")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("extra", nargs="*", help="more `llmbus up` flags (after --)")
    a = p.parse_args()
    exit_on_sigterm()
    from tokenizers import Tokenizer

    dense = comparison_model(a.model_id)
    tokenizer = Tokenizer.from_file(str(dense / "tokenizer.json"))
    args = ["--model-id", str(dense), "--dtype", a.dtype,
            "--kv-cache-memory", str(kv_bytes_for(dense, KV_TOKENS, a.dtype)), *a.extra]
    print(f"load average before: {load_average()}", flush=True)
    ratios = []
    with Server(args, ready_timeout=READY_TIMEOUT_S) as overlap, \
            Server([*args, "--disable-overlap"], ready_timeout=READY_TIMEOUT_S) as lock_step:
        for k in range(a.rounds):
            prompts = [exact_token_prompt(tokenizer, a.prompt_tokens, f"round {k} {i} {time.time_ns()}")
                       for i in range(a.concurrency + a.requests)]
            order = [("overlap", overlap), ("lock-step", lock_step)]
            results = {name: measure(srv, prompts, a) for name, srv in (order if k % 2 else order[::-1])}
            for name, r in results.items():
                print(show(f"round {k + 1}, {name}", r), flush=True)
            ratios.append(results["overlap"]["tok_s"] / results["lock-step"]["tok_s"])
            print(f"round {k + 1}: tokens/s ratio (overlap / lock-step) {ratios[-1]:.3f}", flush=True)
    print(f"median ratio (overlap / lock-step): {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); load average after: {load_average()}")


if __name__ == "__main__":
    main()
