"""What a served c=64 run of vs_llama_server.py is made of: llmbus alone, SmolLM2 float32.

    python benchmarks/served_breakdown.py [--requests 64] [-- extra `llmbus up` flags]

The same load as vs_llama_server.py's c=64 row (64 distinct 128-token prompts at once, 128 new tokens each,
streamed over the OpenAI completions route, after 8 warm-up requests), then, for that level only:

- tokens/s and wall time;
- prefill and decode steps from ``/metrics``: their count, the worker's forward time summed
  (``tgi_batch_forward_duration``) and the scheduler's time from sending each step to its result
  (``tgi_batch_inference_duration``): the difference is the step round trip through the bus;
- CPU seconds of every process of the launch (``/proc``) and of this load generator, over the level: what
  the frontend and scheduler take from the worker's two cores.
"""

from __future__ import annotations

import argparse
import resource
import time

from _server import READY_TIMEOUT_S, exact_token_prompt, exit_on_sigterm, metrics
from _smollm2 import dense_folder
from vs_llama_server import KV_TOKENS, kv_bytes_for

from llmbus.bench import BenchConfig, run_bench
from llmbus.bus.procfs import command_line, cpu_seconds, load_average
from llmbus.testing import Server

SERVICES = ("frontend", "scheduler", "workers", "supervisor")


def process_cpu_seconds(server: Server) -> dict[str, float]:
    """User + system seconds of every process of the launch, summed by llmbus service, and of this load
    generator."""
    out: dict[str, float] = {}
    for pid in server.pids:
        seconds, command = cpu_seconds(pid), command_line(pid)
        if seconds is None:  # exited since the launch was listed
            continue
        name = next((s for s in SERVICES if f"llmbus.{s}" in command), "other")
        out[name] = out.get(name, 0.0) + seconds
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["load generator"] = usage.ru_utime + usage.ru_stime
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("extra", nargs="*", help="more `llmbus up` flags (after --)")
    a = p.parse_args()
    exit_on_sigterm()
    from tokenizers import Tokenizer

    dense = dense_folder("bfloat16")
    tokenizer = Tokenizer.from_file(str(dense / "tokenizer.json"))
    many = [exact_token_prompt(tokenizer, 128, f"request {i}") for i in range(a.requests)]
    warm = [exact_token_prompt(tokenizer, 128, f"warm-up {i}") for i in range(8)]
    print(f"load average before: {load_average()}", flush=True)
    kv = kv_bytes_for(dense, KV_TOKENS, "float32")
    server_args = ["--model-id", str(dense), "--dtype", "float32", "--kv-cache-memory", str(kv), *a.extra]
    with Server(server_args, ready_timeout=READY_TIMEOUT_S) as srv:
        common = dict(url=srv.url, api="openai", max_new_tokens=(128, 128), timeout=600.0, max_duration=2400.0)
        run_bench(BenchConfig(concurrency=[len(warm)], requests=len(warm), warmup=0, prompts=warm, **common))
        before, cpu_before, t0 = metrics(srv.url), process_cpu_seconds(srv), time.monotonic()
        level = run_bench(BenchConfig(concurrency=[len(many)], requests=len(many), warmup=0, prompts=many,
                                      **common)).levels[0]
        wall, cpu_after, after = time.monotonic() - t0, process_cpu_seconds(srv), metrics(srv.url)
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    print(f"c={len(many)}: {level.stats['output_throughput']:.1f} tok/s, {wall:.1f} s wall "
          f"(load average after: {load_average()})")
    for method in ("prefill", "decode"):
        steps = delta(f'tgi_batch_forward_duration_count{{method="{method}"}}')
        forward = delta(f'tgi_batch_forward_duration_sum{{method="{method}"}}')
        step = delta(f'tgi_batch_inference_duration_sum{{method="{method}"}}')
        if steps:
            print(f"  {method}: {steps:.0f} steps, forward {forward:.2f} s ({forward / steps * 1e3:.1f} ms a step), "
                  f"sent to result {step:.2f} s (round trip {(step - forward) / steps * 1e3:.1f} ms a step)")
    for name in sorted(cpu_after):
        print(f"  CPU {name}: {cpu_after[name] - cpu_before.get(name, 0.0):.2f} s")


if __name__ == "__main__":
    main()
