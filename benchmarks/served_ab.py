"""Served single-stream (or any concurrency) speed of this checkout against another git revision.

    python benchmarks/served_ab.py --against HEAD~1 [--quantize int8] [--concurrency 1] [--rounds 4]
                                   [--requests 4] [-- more `llmbus up` flags]

For a change on the serving path (frontend, bus, scheduler, the worker's step) that step_ab.py cannot see:
two `llmbus up` launches of SmolLM2, one of this checkout and one of the revision (a temporary git worktree
imported in place of this one), run side by side (an idle server takes no CPU) and are measured in turn,
alternating which goes first, each round on prompts of its own (neither engine's prefix cache helps).

Per server and round, it prints what a generated token is made of:
- tokens/s and the median time between tokens (the client's);
- from ``/metrics``: the worker's forward pass a decode step and the scheduler's time from sending a step to
  its result (the rest is the bus round trip);
- CPU milliseconds a token of every process of the launch, by service, and of this load generator: on a
  2-core machine whatever the frontend and scheduler spend is taken from the worker's two threads.

Then the ratio of tokens/s (this checkout / the revision: above 1 means this checkout is faster) per round,
and their median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _revision import add_comparison_arguments, comparison_model, revision_package
from _server import READY_TIMEOUT_S, exact_token_prompt, exit_on_sigterm, metrics
from served_breakdown import process_cpu_seconds
from vs_llama_server import KV_TOKENS, kv_bytes_for

from llmbus.bench import BenchConfig, run_bench
from llmbus.bus.procfs import load_average
from llmbus.testing import Server

DECODE = 'method="decode"'


def measure(server: Server, prompts: list[str], a: argparse.Namespace) -> dict:
    """One server's figures over ``a.requests`` requests at ``a.concurrency`` after a warm-up wave. Every
    request ignores end-of-sequence tokens (``run_bench``'s default), so only ``a.new_tokens`` ends it;
    ``output_tokens`` counts the tokens the streams really carried, and CPU time is shared out over them."""
    common = dict(url=server.url, api=a.api, max_new_tokens=(a.new_tokens, a.new_tokens), timeout=600.0,
                  max_duration=2400.0)
    run_bench(BenchConfig(concurrency=[a.concurrency], requests=a.concurrency, warmup=0,
                          prompts=prompts[:a.concurrency], **common))
    before, cpu_before = metrics(server.url), process_cpu_seconds(server)
    level = run_bench(BenchConfig(concurrency=[a.concurrency], requests=a.requests, warmup=0,
                                  prompts=prompts[a.concurrency:], **common)).levels[0]
    after, cpu_after = metrics(server.url), process_cpu_seconds(server)
    if level.stats["errors"]:
        print(f"warning: {level.stats['error_kinds']}", file=sys.stderr)
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    steps = max(delta(f"tgi_batch_forward_duration_count{{{DECODE}}}"), 1.0)
    tokens = max(level.stats["output_tokens"], 1)
    return {"tok_s": level.stats["output_throughput"], "itl_ms": (level.stats["itl_s"]["p50"] or 0.0) * 1e3,
            "output_tokens": level.stats["output_tokens"], "errors": level.stats["errors"],
            "forward_ms": delta(f"tgi_batch_forward_duration_sum{{{DECODE}}}") / steps * 1e3,
            "step_ms": delta(f"tgi_batch_inference_duration_sum{{{DECODE}}}") / steps * 1e3,
            "cpu_ms_a_token": {name: (cpu_after[name] - cpu_before.get(name, 0.0)) / tokens * 1e3
                               for name in sorted(cpu_after)}}


def show(label: str, r: dict) -> str:
    cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in r["cpu_ms_a_token"].items())
    return (f"{label}: {r['tok_s']:.1f} tok/s, ITL {r['itl_ms']:.2f} ms, forward {r['forward_ms']:.2f} ms, "
            f"sent to result {r['step_ms']:.2f} ms; CPU ms a token: {cpu}")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The served load both sides get, and more `llmbus up` flags for both."""
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=4, help="measured requests per server and round")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--api", choices=("openai", "tgi"), default="openai",
                   help="the route the load streams from: OpenAI's /v1/completions or TGI's /generate_stream")
    p.add_argument("extra", nargs="*", help="more `llmbus up` flags (after --)")


def launch(a: argparse.Namespace):
    """The model's tokenizer and the `llmbus up` arguments both sides start with."""
    from tokenizers import Tokenizer

    dense = comparison_model(a.model_id)
    tokenizer = Tokenizer.from_file(str(dense / "tokenizer.json"))
    args = ["--model-id", str(dense), "--dtype", a.dtype,
            "--kv-cache-memory", str(kv_bytes_for(dense, KV_TOKENS, a.dtype)),
            *(["--quantize", a.quantize] if a.quantize else []), *a.extra]
    return tokenizer, args


def alternate(a: argparse.Namespace, tokenizer, first: tuple[str, Server], second: tuple[str, Server]) -> dict:
    """``a.rounds`` rounds measuring both servers in turn (which goes first alternates), each round on prompts
    of its own; prints each side's breakdown and the tokens/s ratio first / second per round and their median,
    and returns them: ``rounds`` (per round, each side's ``measure`` by name and the ``ratio``), ``ratios`` and
    ``median``."""
    (name, _), (other, _) = first, second
    rounds, ratios = [], []
    for k in range(a.rounds):
        prompts = [exact_token_prompt(tokenizer, a.prompt_tokens, f"round {k} {i} {time.time_ns()}")
                   for i in range(a.concurrency + a.requests)]
        order = [first, second]
        results = {n: measure(srv, prompts, a) for n, srv in (order if k % 2 else order[::-1])}
        for n, r in results.items():
            print(show(f"round {k + 1}, {n}", r), flush=True)
        ratios.append(results[name]["tok_s"] / results[other]["tok_s"])
        rounds.append({**results, "ratio": ratios[-1]})
        print(f"round {k + 1}: tokens/s ratio ({name} / {other}) {ratios[-1]:.3f}", flush=True)
    median = statistics.median(ratios)
    print(f"median ratio ({name} / {other}): {median:.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); load average after: {load_average()}")
    return {"rounds": rounds, "ratios": ratios, "median": median}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_comparison_arguments(p)
    add_load_arguments(p)
    a = p.parse_args()
    exit_on_sigterm()
    tokenizer, args = launch(a)
    print(f"load average before: {load_average()}", flush=True)
    with revision_package(a.against, "served_ab.py") as package, \
            Server(args, ready_timeout=READY_TIMEOUT_S) as this, \
                Server(args, env={"PYTHONPATH": str(package)}, ready_timeout=READY_TIMEOUT_S) as other:
        alternate(a, tokenizer, ("this checkout", this), (a.against, other))


if __name__ == "__main__":
    main()
