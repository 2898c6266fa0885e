"""Soak: N clients stream requests back to back for a while; does any process grow?

Starts `llmbus up` (the demo `small` model by default), lets 8 clients each send streaming requests in a
loop (a mix of lengths, a quarter cut mid-stream by the client), and samples every process's resident
memory (RSS, from /proc) after a warm-up minute and at the end. Prints one row per process: RSS at start
and end and the change, plus requests served, errors and tokens/s. A leak shows as a process that grows
steadily; allocator caches settle within the warm-up.

    python benchmarks/soak.py --duration 600 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from _server import READY_TIMEOUT_S, client_session, default_model_dir, exit_on_sigterm, metrics, stream_tokens

from llmbus.bus.procfs import command_words, descendants, rss_bytes
from llmbus.testing import Server

PROMPTS = ["Tell me about the history of the city by the river.", "Write a short poem about winter.",
           "List the parts of a bridge.", "Why do ships float?", "Describe a market square in summer."]


def rss_by_process(root: int) -> dict[str, int]:
    """Resident bytes of each process of the launch, by a readable name."""
    out = {}
    for pid in [root, *descendants(root)]:
        words, rss = command_words(pid), rss_bytes(pid)
        if not words or rss is None:  # exited since the launch was listed
            continue
        name = next((w.removeprefix("llmbus.") for w in words if w.startswith("llmbus.")), "launcher")
        if "--rank" in words:
            name += f" rank {words[words.index('--rank') + 1]}"
        if "--service-name" in words:
            name = words[words.index("--service-name") + 1]
        out[f"{name} ({pid})"] = rss
    return out


async def client(url: str, deadline: float, rng: random.Random, counts: dict) -> None:
    async with client_session() as session:
        while time.monotonic() < deadline:
            max_new = rng.choice([8, 32, 96])
            cut = rng.random() < 0.25
            s = await stream_tokens(session, url, rng.choice(PROMPTS), {"max_new_tokens": max_new},
                                    until=(lambda st: len(st.times) >= 4) if cut else None)
            counts["requests"] += 1
            counts["tokens"] += len(s.times)
            counts["errors"] += s.error is not None


async def load(url: str, clients: int, seconds: float, counts: dict) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client(url, deadline, random.Random(i), counts) for i in range(clients)))


def main() -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load after the warm-up")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the first sample")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model-id", default=None, help="default: the demo `small` model")
    args = ap.parse_args()
    model = args.model_id or default_model_dir()
    server_args = ["--model-id", model, "--max-total-tokens", "256", "--max-concurrent-requests", "64"]
    with Server(server_args, ready_timeout=READY_TIMEOUT_S) as srv:
        counts = {"requests": 0, "tokens": 0, "errors": 0}
        asyncio.run(load(srv.url, args.clients, args.warmup, counts))
        start = rss_by_process(srv.proc.pid)
        served_before = dict(counts)
        t0 = time.monotonic()
        asyncio.run(load(srv.url, args.clients, args.duration, counts))
        elapsed = time.monotonic() - t0
        end = rss_by_process(srv.proc.pid)
        final = metrics(srv.url)
    print(f"soak: {args.clients} clients, {elapsed:.0f} s after a {args.warmup:.0f} s warm-up; "
          f"{counts['requests'] - served_before['requests']} requests, "
          f"{(counts['tokens'] - served_before['tokens']) / elapsed:.1f} tokens/s, {counts['errors']} errors; "
          f"KV blocks free at the end: {final.get('llmbus_kv_blocks_free', float('nan')):.0f} of "
          f"{final.get('llmbus_kv_blocks_total', float('nan')):.0f}")
    print(f"{'process':<28} {'RSS start MiB':>14} {'RSS end MiB':>12} {'change':>8}")
    for name in start:
        if name in end:
            a, b = start[name] / 2**20, end[name] / 2**20
            print(f"{name:<28} {a:>14.1f} {b:>12.1f} {b - a:>+8.1f}")
    print(f"leftover processes after stop: {srv.leftover}")
    return 1 if counts["errors"] or srv.leftover else 0


if __name__ == "__main__":
    sys.exit(main())
