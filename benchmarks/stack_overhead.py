"""How many tokens/s the frontend + bus + scheduler stack streams when the model costs nothing.

    python benchmarks/stack_overhead.py [--concurrency 64] [--new-tokens 256] [--requests 256]
                                        [--num-frontends 1] [--profile DIR]

`llmbus up --runner fake` serves the demo model's tokenizer with workers that return a token per request
per step without computing (workers/fake.py), so every second goes to HTTP, validation, tokenization,
the bus, scheduling, detokenization and SSE. `llmbus bench` (the same load generator users run) streams
from 64 concurrent SSE clients; its own process is reported too, since on a 2-core machine the client
competes with the server for the same cores. The bar (issue #7) is 20,000 tokens/s.

With ``--profile DIR``, py-spy samples the frontend and scheduler processes during the measured level
and the script prints where their time goes (self time by function, then by module).
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _server import READY_TIMEOUT_S, default_model_dir, exit_on_sigterm

from llmbus.bench import BenchConfig, run_bench
from llmbus.bus.procfs import command_line, cpu_seconds
from llmbus.testing import Server

TARGET_TOKENS_PER_S = 20_000


def roles(server: Server) -> dict[str, int]:
    """pid of each service by role: frontend(s), scheduler, worker rank(s), launcher."""
    out = {"launcher": server.proc.pid}
    for pid in server.pids[1:]:
        cmd = command_line(pid)
        for role in ("llmbus.frontend", "llmbus.scheduler", "--rank", "llmbus.workers"):
            if role in cmd:
                name = {"llmbus.frontend": "frontend", "llmbus.scheduler": "scheduler", "--rank": "rank",
                        "llmbus.workers": "workers"}[role]
                key = name if name not in out else f"{name}{sum(k.startswith(name) for k in out)}"
                out[key] = pid
                break
    return out


def summarize_profile(collapsed: Path, top: int = 14) -> str:
    """Self time per function and per module from py-spy's collapsed stacks ("a;b;c count" lines)."""
    by_function, by_module, total = collections.Counter(), collections.Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaf = stack.split(";")[-1]  # "function (path/to/file.py:line)"
        function, _, where = leaf.partition(" (")
        path = where.split(":")[0]
        module = "/".join(Path(path).parts[-2:]) if path else "?"
        by_function[f"{function} ({module})"] += n
        by_module[_package(path)] += n
    lines = [f"  {total} samples; self time by function:"]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_function.most_common(top)]
    lines.append("  by package:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_module.most_common(10)]
    return "\n".join(lines)


def summarize_under(collapsed: Path, anchor: str, without: str = "", depth: int = 1, top: int = 12) -> str:
    """Inclusive time below the frames of function ``anchor`` (its first on a stack), by the ``depth`` frames
    under it, over the stacks that hold no frame of function ``without``: what one kind of call is made of
    (a worker's eager steps: ``ModelRunner._forward`` without ``DecodeGraphs.forward``)."""
    below, total = collections.Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        functions = [frame.partition(" (")[0] for frame in stack.split(";")]
        if anchor not in functions or (without and without in functions):
            continue
        at = functions.index(anchor)
        below[" > ".join(functions[at + 1:at + 1 + depth]) or "(self)"] += int(count)
        total += int(count)
    lines = [f"  {total} samples under {anchor}" + (f" without {without}" if without else "") + ":"]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in below.most_common(top)]
    return "\n".join(lines)


def _package(path: str) -> str:
    parts = Path(path).parts
    for anchor in ("site-packages", "lib"):
        if anchor in parts:
            rest = parts[parts.index(anchor) + 1:]
            if rest and rest[0].startswith("python3"):
                rest = rest[1:]
            return f"{anchor}:{rest[0]}" if rest else anchor
    for folder in ("frontend", "scheduler", "bus", "workers"):
        if folder in parts:
            return f"llmbus.{folder}"
    return Path(path).name or "?"


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="model folder (its tokenizer is what is used)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-frontends", type=int, default=1)
    p.add_argument("--profile", type=Path, default=None, help="folder for py-spy's output (needs py-spy)")
    p.add_argument("--output", type=Path, default=None, help="write the numbers as JSON here")
    a = p.parse_args()
    if a.profile is not None and shutil.which("py-spy") is None:
        p.error("--profile needs py-spy (pip install py-spy)")
    model = a.model_id or default_model_dir()
    args = ["--model-id", model, "--runner", "fake", "--max-concurrent-requests",
            str(max(128, 2 * a.concurrency)), "--max-total-tokens", str(a.prompt_tokens + a.new_tokens + 8),
            "--num-frontends", str(a.num_frontends)]
    with Server(args, ready_timeout=READY_TIMEOUT_S) as server:
        pids = roles(server)
        warm = BenchConfig(url=server.url, concurrency=[a.concurrency], requests=a.concurrency, warmup=0,
                           prompt_tokens=(a.prompt_tokens, a.prompt_tokens), max_new_tokens=(16, 16))
        run_bench(warm)  # imports, connections, tokenizer caches
        config = BenchConfig(url=server.url, concurrency=[a.concurrency], requests=a.requests, warmup=0,
                             prompt_tokens=(a.prompt_tokens, a.prompt_tokens),
                             max_new_tokens=(a.new_tokens, a.new_tokens))
        spies = []
        if a.profile is not None:
            a.profile.mkdir(parents=True, exist_ok=True)
            for role in [r for r in pids if r.startswith(("frontend", "scheduler"))]:
                out = a.profile / f"{role}.collapsed"
                spies.append((role, out, subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pids[role]), "--format", "raw", "--rate", "200",
                     "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        client_before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        result = run_bench(config)
        wall = time.perf_counter() - t0
        client_after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
        for _, _, spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled
    for _, _, spy in spies:
        spy.wait(60)
    level = result.levels[0]
    tokens_per_s = level.stats["output_throughput"]
    client_cpu = (client_after.ru_utime - client_before.ru_utime) + (client_after.ru_stime - client_before.ru_stime)
    print(f"\nstack overhead: {a.concurrency} concurrent SSE clients, {a.requests} requests x {a.new_tokens} "
          f"tokens, fake runner, {a.num_frontends} frontend(s)")
    print(f"  streamed {tokens_per_s:,.0f} tokens/s over {wall:.1f} s ({level.stats['errors']} errors); "
          f"target {TARGET_TOKENS_PER_S:,}: {tokens_per_s / TARGET_TOKENS_PER_S:.2f}x "
          f"{'PASS' if tokens_per_s >= TARGET_TOKENS_PER_S else 'below'}")
    print("  CPU seconds per process during the level (cores used = cpu / wall):")
    for role, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"    {role:12s} {seconds:6.2f} s  {seconds / wall:4.2f} cores  "
              f"{1e6 * seconds / max(tokens_per_s * wall, 1):6.1f} us/token")
    print(f"    {'bench client':12s} {client_cpu:6.2f} s  {client_cpu / wall:4.2f} cores  "
          f"{1e6 * client_cpu / max(tokens_per_s * wall, 1):6.1f} us/token")
    for role, out, spy in spies:
        if out.exists():
            print(f"\nprofile of {role} (py-spy, {out}):\n{summarize_profile(out)}")
        else:
            print(f"\nprofile of {role}: py-spy wrote nothing ({spy.stderr.read().decode()[-300:]})")
    if a.output is not None:
        a.output.write_text(json.dumps({"tokens_per_s": tokens_per_s, "wall_s": wall, "cpu_s": cpu,
                                        "client_cpu_s": client_cpu, "stats": level.stats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
