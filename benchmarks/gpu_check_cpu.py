"""Part 6 of benchmarks/gpu_check.py, cpu overlap (``CpuOverlapPart``, a base of its ``Check``): issue #39's CPU
target, c=1 SmolLM2 float32 decode tokens/s with the scheduler's overlap on against off, at least 1.08x, measured
on the lent machine's host CPU in the same run as the GPU parts.

On the 2-core dev machine (benchmarks/overlap_ab.py) the worker's two OpenMP threads share the cores with the
scheduler and the frontend, so there is no idle core for the overlap to use; the lent machine's host has 16. The
servers are launched as a user launches them, so each worker computes with llmbus's default threads (a thread a
physical core it may run on, within a cgroup's CPU quota, less two cores left to the scheduler and the frontend
from 8 cores up: ``placement.CpuBudget``); ``OMP_NUM_THREADS`` set for this script reaches both workers. Run 5
found a 31 ms forward pass at 16 threads on that host (about 7-10 ms on 2 cores here), so the row first times
the batch-1 step in this process at each thread count worth knowing (``thread_sweep``): whether the default is
the fast count there, and which compute paths the runner took. Where the fastest count beats the default by more
than 15%, both servers run at it (``OMP_NUM_THREADS``, recorded as ``threads_env``), so the row still measures
the overlap.
The method is overlap_ab.py's, through the same functions of served_ab.py: two `llmbus up --device cpu --dtype
float32` launches of one folder (``launch``), one as it is and one with ``--disable-overlap``, side by side (an
idle server takes no CPU), measured in turn (``alternate``: which goes first alternates, each round on prompts of
its own) at concurrency 1, 128 prompt + 128 new tokens.

The model is SmolLM2-135M's shape with random weights (``random_llama_dir``, part 3's builder; a byte-level BPE of
its 49,152-token vocabulary): the lent machine has no network and no SmolLM2 file. A decode step's compute is set
by the shapes and the dtype alone (30 layers of hidden 576, 9 heads over 3 KV heads, MLP 1536, the tied
49,152 x 576 head, all float32), so a token costs what the real model's does; only the token ids differ. Like
overlap_ab.py's folder the weights are stored in bfloat16 and served as float32.

Every request ignores end-of-sequence tokens (``run_bench``'s default: TGI's ``ignore_eos_token``), so only
``max_new_tokens`` ends it, and the row is ok only where every stream of both sides carried all its tokens: the
tokens/s ratio compares equal work. The load streams from TGI's ``/generate_stream``, one event per token: the
OpenAI route holds back a token whose text ends inside a UTF-8 character, which a random model's byte-level
tokens can do far more often than SmolLM2's English, and that would merge its events (and stretch the time
between them) where the real model's would not.

Not a benchmark itself: gpu_check.py runs it (``--parts 6``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from _revision import add_model_arguments
from gpu_check_served import READY_TIMEOUT_S, get_json, random_llama_dir
from served_ab import add_load_arguments, alternate, launch

from llmbus.bus.procfs import load_average
from llmbus.testing import Server
from llmbus.workers.placement import CpuBudget, cpu_budget

TARGET = 1.08  # overlap on / off, issue #39's CPU row
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, rope_parameters=dict(rope_type="default", rope_theta=100000.0))
# The dry run's: 2 layers, 3 query heads a KV head as SmolLM2's, tied.
SMOLLM2_DRY = dict(SMOLLM2_135M, hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, vocab_size=1024, max_position_embeddings=1024)
# served_ab.py's load flags: 4 rounds x (1 warm-up + 2 measured) requests a side, 128 + 128 tokens at c=1
LOAD = ["--concurrency", "1", "--rounds", "4", "--requests", "2", "--prompt-tokens", "128", "--new-tokens", "128"]
LOAD_DRY = ["--concurrency", "1", "--rounds", "1", "--requests", "1", "--prompt-tokens", "16", "--new-tokens", "8"]
SIDES = ("overlap", "lock-step")


class CpuOverlapPart:
    """Part 6, ``cpu_overlap``: a base class of gpu_check's ``Check``, whose ``dry``, ``device`` (where the
    weights are drawn), ``work``, ``row`` and ``free`` it uses."""

    def cpu_overlap(self) -> None:
        t0 = time.perf_counter()
        shape = SMOLLM2_DRY if self.dry else SMOLLM2_135M
        model_dir = random_llama_dir(self.work / "smollm2_shape", shape, self.device, torch.bfloat16)
        self.free()
        built_s = time.perf_counter() - t0
        budget = cpu_budget()
        sweep = thread_sweep(model_dir, budget, steps=4 if self.dry else 32, least_pool=self.dry)
        print(f"6 cpu overlap: {budget.describe()}; default {budget.threads(1)} threads; batch-1 step by threads: "
              + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sweep["step_ms"].items()), flush=True)
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        add_load_arguments(parser)
        a = parser.parse_args(["--model-id", str(model_dir), "--dtype", "float32", "--api", "tgi",
                               *(LOAD_DRY if self.dry else LOAD), "--", "--device", "cpu"])
        tokenizer, args = launch(a)
        threads_env = _fastest_threads_env(sweep["step_ms"], budget.threads(1))
        with _side_by_side(args, [*args, "--disable-overlap"], env=threads_env) as servers:
            started_s = time.perf_counter() - t0 - built_s
            info = get_json(f"{servers[0].url}/info")
            threads = [_worker_threads(s) for s in servers]
            load_before = load_average()
            print(f"6 cpu overlap: {os.cpu_count()} cores, worker threads {threads}; load average before: "
                  f"{load_before}", flush=True)
            result = alternate(a, tokenizer, *zip(SIDES, servers))
            commands = [s.command_line for s in servers]
        expected = a.requests * a.new_tokens
        short = [(k + 1, side, r[side]["output_tokens"], r[side]["errors"]) for k, r in enumerate(result["rounds"])
                 for side in SIDES if r[side]["output_tokens"] != expected or r[side]["errors"]]
        sides = {side: _medians([r[side] for r in result["rounds"]]) for side in SIDES}
        median, ratios = result["median"], result["ratios"]
        ok = not short and (median >= TARGET if not self.dry else median > 0)
        said = ", ".join(f"{side} {s['tok_s']:.1f} tok/s (ITL {s['itl_ms']:.2f} ms, forward {s['forward_ms']:.2f} ms)"
                         for side, s in sides.items())
        self.row("6 cpu overlap", f"c={a.concurrency} overlap on/off", ok,
                 f"{median:.3f}x (rounds {', '.join(f'{r:.3f}' for r in ratios)}; target >= {TARGET}); {said}; "
                 f"{budget.describe()}, worker threads {threads}; batch-1 step by threads "
                 + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sweep["step_ms"].items())
                 + (f"; streams cut short (round, side, tokens, errors): {short}" if short else ""),
                 backend=info.get("attention_backend", ""), device="cpu", dtype="float32", median_ratio=median,
                 ratios=ratios, target=TARGET, sides=sides, rounds=result["rounds"], short_streams=short,
                 tokens_a_side_and_round=expected, concurrency=a.concurrency, prompt_tokens=a.prompt_tokens,
                 new_tokens=a.new_tokens, requests=a.requests, api=a.api, cpu_count=os.cpu_count(),
                 cpu_affinity=len(os.sched_getaffinity(0)), worker_threads=dict(zip(SIDES, threads)),
                 cpu_budget=budget.describe(), default_threads=budget.threads(1), thread_sweep=sweep,
                 threads_env=threads_env,
                 load_average_before=load_before, load_average_after=load_average(), model=shape, info=info,
                 commands=commands,
                 model_build_seconds=round(built_s, 1), ready_seconds=round(started_s, 1),
                 seconds=round(time.perf_counter() - t0, 1))


def _fastest_threads_env(step_ms: dict[int, float], default: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for both servers where the sweep's fastest count beats the default by more than 15%
    on this host (and this script was not given one): the row then measures the overlap at a count an operator
    would set, not llmbus's default (which the sweep beside it judges)."""
    fastest = min(step_ms, key=step_ms.get)
    if "OMP_NUM_THREADS" in os.environ or default not in step_ms or step_ms[fastest] >= 0.85 * step_ms[default]:
        return {}
    return {"OMP_NUM_THREADS": str(fastest)}


@contextlib.contextmanager
def _side_by_side(*launches: list[str], env: dict[str, str] | None = None):
    """A ``Server`` for each list of `llmbus up` arguments (``env`` added to each one's environment), started
    at once (a start is mostly waiting on its model's load and warm-up) and all stopped at once on leaving, a
    start that failed included."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(launches)) as pool:
        futures = [pool.submit(Server, args, env=env, ready_timeout=READY_TIMEOUT_S) for args in launches]
        servers, failed = [], None
        for future in futures:  # every start is waited for, so that each one that came up is stopped
            try:
                servers.append(stack.enter_context(future.result()))
            except Exception as exc:  # noqa: BLE001  (raised below, once the others are in the stack)
                failed = failed or exc
        if failed is not None:
            raise failed
        try:
            yield servers
        finally:  # a stop is mostly waiting too; each server's own exit then finds it stopped
            list(pool.map(Server.stop, servers))


def thread_sweep(model_dir, budget: CpuBudget, steps: int, least_pool: bool = False) -> dict:
    """The batch-1 float32 decode step of ``model_dir`` in this process at each thread count worth knowing
    (powers of two, the default, every core, every CPU), fastest of three rounds a count: whether the default
    thread count is the fast one on this host. With the CPU model, and the compute paths the runner took (a
    host without a C compiler decodes through torch's ops, much slower). The threads spin as libgomp's default
    has them, not at the ranks' ``GOMP_SPINCOUNT`` (read once, when torch loads it): steps back to back keep
    them awake either way. ``least_pool``: the runner's KV pool only what the steps need (a dry run's)."""
    from decode_step import LlmbusDecode

    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= budget.cpus}
                    | {budget.threads(1), budget.cores, budget.cpus})
    before = torch.get_num_threads()
    decode = LlmbusDecode(str(model_dir), torch.float32, 1, 128, steps, least_pool=least_pool)
    step_ms = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            step_ms[n] = round(min(decode.time_steps(1, steps) for _ in range(3)) * 1e3, 2)
    finally:
        torch.set_num_threads(before)
    return {"step_ms": step_ms, "cpu_model": _cpu_model(), "compute_paths": decode.runner.compute_paths}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def _worker_threads(server: Server) -> int | None:
    """The threads the server's CPU rank computes with, from its "model loaded" log line."""
    for line in server.log_lines("model loaded"):
        found = re.search(r"threads=(\d+)", line)
        if found:
            return int(found.group(1))
    return None


def _medians(results: list[dict]) -> dict:
    """One side's ``measure`` figures, each the median over the rounds (CPU by service too)."""
    out = {key: statistics.median(r[key] for r in results) for key in ("tok_s", "itl_ms", "forward_ms", "step_ms")}
    out["output_tokens"] = sum(r["output_tokens"] for r in results)
    services = sorted({name for r in results for name in r["cpu_ms_a_token"]})
    out["cpu_ms_a_token"] = {name: statistics.median(r["cpu_ms_a_token"].get(name, 0.0) for r in results)
                             for name in services}
    return out
