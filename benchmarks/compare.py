"""llmbus against transformers' three ways of serving the same requests, each beside this machine's ceiling.

    python benchmarks/compare.py [--model-id DIR] [--dtype bfloat16] [--requests 64] [--prompt-tokens 128]
                                 [--new-tokens 128] [--sequential-requests 4] [--output compare.json]
    python benchmarks/compare.py --requests 8 --prompt-tokens 32 --new-tokens 16   # a smoke check

One run, one checkpoint (default: the demo `small` model, what `llmbus up` serves), one dtype, one request
set: ``--requests`` prompts of exactly ``--prompt-tokens`` tokens (cut with the model's own tokenizer, each
starting differently so no prefix cache helps), ``--new-tokens`` greedy tokens each, lengths forced
(ignore EOS on the server, ``min_new_tokens`` in generate, no EOS in generate_batch). Measured in turn,
so nothing shares the CPU with what is timed:

1. the ceilings (roofline.py): matmul FLOP/s and memory bandwidth, and what they allow this model;
2. llmbus over HTTP (`llmbus up` as a child, driven by llmbus.bench): one stream at a time for the
   single-stream decode rate, then the whole set at concurrency ``--concurrency`` (default: all of it);
3. transformers ``generate`` one request at a time: the first ``--sequential-requests`` of the set only.
   Requests alone take the same time each, so tokens/s over a few stands for the whole set (64 in a row
   would take minutes and say nothing more);
4. transformers static batching: the whole set in one ``generate`` (left padding);
5. transformers continuous batching, ``generate_batch``, where the installed version has it: outside
   ``torch.inference_mode()`` (its background thread dies inside it) and with ``num_blocks`` sized to the
   set (else it reserves 60% of free RAM). Timed from the first request added to the last finished.

tokens/s is generated tokens over wall time, prompts' prefill included, for every system. The single-stream
figure is decode only: (tokens - 1) / (time of last token - time of first), the median over the requests.
Targets (issue #7): llmbus at full concurrency >= 2.5x transformers static batching and >= 35% of the
compute roofline; single stream >= 1.5x transformers batch 1 and >= 60% of the bandwidth roofline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from _server import READY_TIMEOUT_S, default_model_dir, exact_token_prompt, exit_on_sigterm, load_tokenizer
from roofline import DTYPES, describe, measure

from llmbus.bench import BenchConfig, run_bench
from llmbus.bench.stats import decode_rate
from llmbus.bus.procfs import load_average
from llmbus.testing import Server

TARGETS = {"vs_static": 2.5, "compute_fraction": 0.35, "single_vs_batch1": 1.5, "bandwidth_fraction": 0.60}


# --- llmbus --------------------------------------------------------------------------------------------


def bench_llmbus(a, prompts: list[str], warm: list[str], single: list[str]) -> dict:
    """Single-stream decode, then the set at --concurrency, against one `llmbus up`."""
    common = dict(max_new_tokens=(a.new_tokens, a.new_tokens), timeout=a.timeout, max_duration=a.timeout * 4)
    with Server(["--model-id", a.model_id, "--dtype", a.dtype, *a.server_arg], ready_timeout=READY_TIMEOUT_S) as srv:
        one = run_bench(BenchConfig(url=srv.url, concurrency=[1], requests=len(single) - 1, warmup=1,
                                    prompts=single, **common), progress=True)
        many = run_bench(BenchConfig(url=srv.url, concurrency=[a.concurrency], requests=len(prompts),
                                     warmup=len(warm), prompts=warm + prompts, **common), progress=True)
    if srv.leftover:
        print(f"warning: llmbus processes still alive after stop: {srv.leftover}", file=sys.stderr)
    one_level, many_level = one.levels[0], many.levels[0]
    for level in (one_level, many_level):
        if level.stats["errors"]:
            print(f"warning: llmbus {level.label}: {level.stats['error_kinds']}", file=sys.stderr)
    rates = [r for r in map(decode_rate, (s for s in one_level.samples if s.ok)) if r]
    return {"tokens_per_s": many_level.stats["output_throughput"], "label": f"llmbus c={a.concurrency}",
            "output_tokens": many_level.stats["output_tokens"], "errors": many_level.stats["errors"],
            "decode_tokens_per_s": statistics.median(rates) if rates else None,
            "ttft_p50_s": many_level.stats["ttft_s"]["p50"], "itl_p50_s": many_level.stats["itl_s"]["p50"],
            "bench": {"single": one.to_dict(), "concurrent": many.to_dict()}}


# --- transformers ----------------------------------------------------------------------------------------


def load_transformers(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()


def forced(tok, new_tokens: int) -> dict:
    """generate() arguments for greedy output of exactly ``new_tokens`` tokens."""
    return dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)


def token_clock():
    """A generate() streamer that records when each put arrives: the prompt first, then every token."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Clock()


def hf_sequential(tok, model, prompts: list[str], new_tokens: int) -> dict:
    tokens, seconds, rates = 0, 0.0, []
    with torch.inference_mode():
        warm = tok(prompts[0], return_tensors="pt")
        model.generate(**warm, **forced(tok, 4))
        for prompt in prompts:
            batch = tok(prompt, return_tensors="pt")
            clock = token_clock()
            t0 = time.perf_counter()
            out = model.generate(**batch, **forced(tok, new_tokens), streamer=clock)
            seconds += time.perf_counter() - t0
            n = out.shape[1] - batch.input_ids.shape[1]
            tokens += n
            rates.append((n - 1) / (clock.times[-1] - clock.times[1]))
    return {"tokens_per_s": tokens / seconds, "decode_tokens_per_s": statistics.median(rates),
            "requests": len(prompts), "output_tokens": tokens}


def hf_static(tok, model, prompts: list[str], new_tokens: int) -> dict:
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**batch, **forced(tok, 2))  # warm-up at the timed batch shape
        t0 = time.perf_counter()
        out = model.generate(**batch, **forced(tok, new_tokens))
        seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - batch.input_ids.shape[1]) * len(prompts)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens}


def hf_continuous(tok, model, prompts: list[str], new_tokens: int) -> dict | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import ContinuousBatchingConfig, GenerationConfig

    inputs = [tok(p).input_ids for p in prompts]
    longest = max(map(len, inputs)) + new_tokens

    def run(requests: list[list[int]], new: int):
        # eos_token_id=None: generate_batch disables EOS (-1), so every request runs to max_new_tokens
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)
        page = ContinuousBatchingConfig().page_size
        cb = ContinuousBatchingConfig(num_blocks=len(requests) * math.ceil(longest / page) + 4)
        t0 = time.perf_counter()
        results = model.generate_batch(requests, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
        return results, time.perf_counter() - t0

    run(inputs[:2], 2)  # warm-up
    results, wall = run(inputs, new_tokens)
    outs = list(results.values())
    tokens = sum(len(o.generated_tokens) for o in outs)
    failed = [o.error for o in outs if o.error is not None] + ["missing"] * (len(inputs) - len(outs))
    ends = [o.lifespan[1] for o in outs]
    window = max(ends) - min(o.created_time for o in outs) if outs and min(ends) > 0 else None
    seconds = window if window is not None and 0 < window <= wall else wall
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "wall_seconds": wall, "output_tokens": tokens,
            "failed": failed}


# --- the report -------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = "8.1f") -> str:
    return "-".rjust(len(format(0.0, spec))) if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def pct(x: float | None, ceiling: float) -> float | None:
    return None if x is None else 100 * x / ceiling


def mark(value: float | None, target: float) -> str:
    return "[ -- ]" if value is None else "[PASS]" if value >= target else "[FAIL]"


def report(a, roof, systems: dict, single: dict) -> list[dict]:
    """Print the tables; return the target checks."""
    ours = systems["llmbus"]["tokens_per_s"]
    print(f"\nthroughput: {a.requests} requests x ({a.prompt_tokens} prompt + {a.new_tokens} new tokens), "
          f"{a.dtype}, {a.model_id}")
    print(f"{'system':<44}{'tok/s':>9}{'llmbus/it':>11}{'of compute roofline':>21}")
    for key, row in systems.items():
        tps = row["tokens_per_s"] if row else None
        label = row["label"] if row else f"{key}: not available in this transformers"
        print(f"{label:<44}{fmt(tps, '9.1f')}{fmt(ratio(ours, tps), '10.2f')}x"
              f"{fmt(pct(tps, roof.compute_tokens_per_s), '20.1f')}%")
    print(f"{'ceiling: compute roofline (large batch)':<44}{fmt(roof.compute_tokens_per_s, '9.1f')}")

    print("\nsingle stream decode (tokens after the first / time after the first)")
    print(f"{'system':<44}{'tok/s':>9}{'llmbus/it':>11}{'of bandwidth roofline':>23}")
    ours1 = single["llmbus"]
    for label, tps in (("transformers generate, batch 1", single["transformers"]), ("llmbus, concurrency 1", ours1)):
        print(f"{label:<44}{fmt(tps, '9.1f')}{fmt(ratio(ours1, tps), '10.2f')}x"
              f"{fmt(pct(tps, roof.bandwidth_tokens_per_s), '22.1f')}%")
    print(f"{'ceiling: bandwidth roofline (batch 1)':<44}{fmt(roof.bandwidth_tokens_per_s, '9.1f')}")

    static = systems["static"]["tokens_per_s"] if systems["static"] else None
    checks = [
        (f"llmbus c={a.concurrency} / transformers static batching", ratio(ours, static), TARGETS["vs_static"], "x"),
        (f"llmbus c={a.concurrency} / compute roofline", ratio(ours, roof.compute_tokens_per_s),
         TARGETS["compute_fraction"], "%"),
        ("single stream / transformers generate batch 1", ratio(ours1, single["transformers"]),
         TARGETS["single_vs_batch1"], "x"),
        ("single stream / bandwidth roofline", ratio(ours1, roof.bandwidth_tokens_per_s),
         TARGETS["bandwidth_fraction"], "%"),
    ]
    print("\ntargets:")
    out = []
    for name, value, target, unit in checks:
        shown = (lambda v: f"{100 * v:.0f}%") if unit == "%" else (lambda v: f"{v:.2f}x")
        print(f"  {mark(value, target)} {name}: {'-' if value is None else shown(value)} (target >= {shown(target)})")
        out.append({"check": name, "value": value, "target": target, "met": value is not None and value >= target})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sequential-requests", type=int, default=4,
                   help="requests transformers generate and single-stream llmbus run one at a time")
    p.add_argument("--concurrency", type=int, default=None, help="llmbus clients in flight; default: --requests")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per llmbus request")
    p.add_argument("--server-arg", action="append", default=[], help="extra `llmbus up` argument (repeatable)")
    p.add_argument("--output", default="compare.json")
    a = p.parse_args()
    a.model_id = a.model_id or default_model_dir()
    a.concurrency = a.concurrency or a.requests
    exit_on_sigterm()

    tokenizer = load_tokenizer(a.model_id)
    make = lambda tag, n: [exact_token_prompt(tokenizer, a.prompt_tokens, f"{tag} {i}") for i in range(n)]  # noqa: E731
    prompts, warm = make("request", a.requests), make("warm-up", min(8, a.requests))
    single = make("single", a.sequential_requests + 1)  # the first warms up
    load_before = load_average()
    print(f"load average before: {load_before}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        # threads that spin-wait for each other lose most of their speed to any competing process
        print("warning: the machine is busy: every number below will be low and noisy",
              file=sys.stderr)

    roof = measure(a.model_id, a.dtype, a.prompt_tokens, a.new_tokens)
    print("\n".join(describe(roof)), flush=True)
    ours = bench_llmbus(a, prompts, warm, single)
    tok, model = load_transformers(a.model_id, a.dtype)
    seq = hf_sequential(tok, model, prompts[:a.sequential_requests], a.new_tokens)
    print(f"transformers sequential: {seq['tokens_per_s']:.1f} tok/s", flush=True)
    static = hf_static(tok, model, prompts, a.new_tokens)
    print(f"transformers static batch: {static['tokens_per_s']:.1f} tok/s", flush=True)
    cb = hf_continuous(tok, model, prompts, a.new_tokens)
    if cb and cb["failed"]:
        print(f"warning: generate_batch: {len(cb['failed'])} requests failed: {cb['failed'][:3]}", file=sys.stderr)

    seq["label"] = f"transformers generate, 1 at a time ({seq['requests']})"
    static["label"] = f"transformers static batch ({a.requests})"
    if cb:
        cb["label"] = f"transformers generate_batch ({a.requests})"
    systems = {"sequential": seq, "static": static, "continuous": cb, "llmbus": ours}
    single_stream = {"transformers": seq["decode_tokens_per_s"], "llmbus": ours["decode_tokens_per_s"]}
    checks = report(a, roof, systems, single_stream)
    load_after = load_average()
    print(f"\nload average after: {load_after} (numbers from a busy machine are low; ratios hold better)")

    bench_runs = ours.pop("bench")
    Path(a.output).write_text(json.dumps({
        "config": vars(a), "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                       "threads": torch.get_num_threads(), "load_before": load_before,
                                       "load_after": load_after},
        "roofline": asdict(roof), "systems": systems, "single_stream_decode": single_stream, "targets": checks,
        "llmbus_bench": bench_runs}, indent=1) + "\n")
    print(f"results: {a.output}")


if __name__ == "__main__":
    main()
