"""Time to first token of a 1,500-token prompt whose prefix is in llmbus's prefix cache, against one whose
prefix is not, on one `llmbus up` (prefix caching on, the default).

    python benchmarks/prefix_cache_ttft.py [--model-id DIR] [--prompt-tokens 1500] [--trials 5]
                                           [--new-tokens 2] [--control]

- Prompts have exactly ``--prompt-tokens`` tokens under the model's tokenizer (``tokenizer.json``,
  special tokens included, as the server counts them); every trial checks the server's count too, in
  the ``input_length`` of the stream's last event (``details``).
- An *uncached* trial sends a fresh prompt: it starts with its own tag ("uncached 3 ...") and goes on
  with words drawn from that tag, so it shares no leading KV block with any earlier prompt. The
  *cached* trial right after it sends the same prompt again: all its full blocks but the last token's
  are in the cache, so only ``prompt_tokens - floor((prompt_tokens - 1) / block) * block`` tokens are
  computed. Trials alternate uncached, cached, uncached, ..., so machine noise hits both kinds alike.
- TTFT is the time from sending ``POST /generate_stream`` to the arrival of its first token event
  (client side: HTTP, tokenization, queueing and the prefill step). One warm-up pair runs first.
- The cache's own account: ``llmbus_prefix_cache_hit_tokens_total`` from /metrics before and after,
  and each trial's hit tokens (the counters' growth across it).
- ``--control`` runs the same trials on a second server with ``--prefix-caching false``: there both
  kinds should cost the same (ratio about 1) and the hit counter stays at 0.

Target: median uncached TTFT / median cached TTFT >= 10.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from _server import (READY_TIMEOUT_S, client_session, default_model_dir, exact_token_prompt, exit_on_sigterm,
                     load_tokenizer, metrics, stream_tokens, wait_metrics)

from llmbus.bus.procfs import load_average
from llmbus.testing import Server

TARGET = 10.0
HIT = "llmbus_prefix_cache_hit_tokens_total"
QUERIED = "llmbus_prefix_cache_queried_tokens_total"


async def one_trial(session, url: str, prompt: str, a) -> dict:
    """TTFT of one streamed request and the prefix-cache tokens it hit (from /metrics)."""
    before = metrics(url)
    s = await stream_tokens(session, url, prompt, {"max_new_tokens": a.new_tokens, "details": True})
    if s.error or not s.times:
        raise RuntimeError(f"request failed: {s.error or 'no token'}")
    after = wait_metrics(url, lambda m: m.get(QUERIED, 0) >= before.get(QUERIED, 0) + a.prompt_tokens)
    counted = ((s.last or {}).get("details") or {}).get("input_length")
    if counted != a.prompt_tokens:
        raise RuntimeError(f"the server counted {counted} prompt tokens, not {a.prompt_tokens}")
    return {"ttft": s.ttft, "hit": after.get(HIT, 0) - before.get(HIT, 0),
            "queried": after.get(QUERIED, 0) - before.get(QUERIED, 0)}


async def run_trials(url: str, prompts: list[str], warmup: str, a) -> tuple[list[dict], list[dict], tuple]:
    """(uncached trials, cached trials, the hit counter before and after them: after the warm-up pair)."""
    uncached, cached = [], []
    async with client_session() as session:
        for _ in range(2):
            await one_trial(session, url, warmup, a)
        hit_before = metrics(url).get(HIT, 0.0)
        for i, prompt in enumerate(prompts):
            u = await one_trial(session, url, prompt, a)
            c = await one_trial(session, url, prompt, a)
            uncached.append(u)
            cached.append(c)
            print(f"  trial {i + 1}: uncached {u['ttft'] * 1000:8.1f} ms (hit {u['hit']:5.0f}/{u['queried']:.0f} "
                  f"tokens) | cached {c['ttft'] * 1000:8.1f} ms (hit {c['hit']:5.0f}/{c['queried']:.0f} tokens)",
                  flush=True)
    return uncached, cached, (hit_before, metrics(url).get(HIT, 0.0))


def measure(label: str, server_args: list[str], prompts: list[str], warmup: str, a) -> dict:
    print(f"\n== {label}")
    with Server(server_args, ready_timeout=READY_TIMEOUT_S) as srv:
        print(f"ready in {srv.startup_s:.1f} s; load average {load_average()}")
        uncached, cached, (hit_before, hit_after) = asyncio.run(run_trials(srv.url, prompts, warmup, a))
        errors = srv.log_lines("[error", "[warning", "Traceback")
    u = statistics.median(t["ttft"] for t in uncached)
    c = statistics.median(t["ttft"] for t in cached)
    print(f"{HIT}: {hit_before:.0f} before the trials (after the warm-up pair), {hit_after:.0f} after "
          f"(+{hit_after - hit_before:.0f}; cached trials hit {sum(t['hit'] for t in cached):.0f}, "
          f"uncached {sum(t['hit'] for t in uncached):.0f})")
    print(f"median TTFT: uncached {u * 1000:.1f} ms, cached {c * 1000:.1f} ms, ratio {u / c:.1f}x")
    print(f"server shut down with exit code {srv.proc.returncode}; leftover server processes: "
          f"{srv.leftover or 'none'}; server error/warning lines: {len(errors)}")
    for line in errors[:10]:
        print(f"  {line}")
    return {"uncached": u, "cached": c, "ratio": u / c, "hit_delta": hit_after - hit_before,
            "cached_hits": [t["hit"] for t in cached], "uncached_hits": [t["hit"] for t in uncached],
            "command": srv.command_line, "leftover": srv.leftover, "exit": srv.proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--trials", type=int, default=5, help="uncached and cached trials each")
    p.add_argument("--new-tokens", type=int, default=2, help="max_new_tokens of each request")
    p.add_argument("--block-size", type=int, default=16, help="KV block size passed to the server")
    p.add_argument("--control", action="store_true",
                   help="also run the trials on a server with --prefix-caching false")
    a = p.parse_args()
    exit_on_sigterm()
    if a.model_id is None:
        a.model_id = default_model_dir()
    tokenizer = load_tokenizer(a.model_id)
    prompts = [exact_token_prompt(tokenizer, a.prompt_tokens, f"uncached {i}") for i in range(a.trials)]
    warmup = exact_token_prompt(tokenizer, a.prompt_tokens, "warm-up")
    server_args = ["--model-id", a.model_id, "--dtype", a.dtype, "--block-size", str(a.block_size),
                   "--max-input-tokens", str(a.prompt_tokens),
                   "--max-total-tokens", str(a.prompt_tokens + a.new_tokens),
                   "--graceful-termination-timeout", "5"]
    cached_blocks = (a.prompt_tokens - 1) // a.block_size
    print(f"model {a.model_id}; {a.trials} uncached + {a.trials} cached trials of a {a.prompt_tokens}-token "
          f"prompt, max_new_tokens {a.new_tokens}; a cached trial can hit {cached_blocks * a.block_size} "
          f"tokens ({cached_blocks} blocks of {a.block_size}) and computes the other "
          f"{a.prompt_tokens - cached_blocks * a.block_size}")

    on = measure("prefix caching on", server_args, prompts, warmup, a)
    off = measure("control: --prefix-caching false", [*server_args, "--prefix-caching", "false"],
                  prompts, warmup, a) if a.control else None

    expected = a.trials * cached_blocks * a.block_size
    used = on["hit_delta"] == expected and all(h == 0 for h in on["uncached_hits"])
    print("\n== summary")
    print(f"server: {on['command']}")
    print(f"prompt {a.prompt_tokens} tokens, {a.trials} trials of each kind, load average now {load_average()}")
    print(f"median TTFT uncached {on['uncached'] * 1000:8.1f} ms")
    print(f"median TTFT cached   {on['cached'] * 1000:8.1f} ms")
    print(f"ratio uncached/cached {on['ratio']:.1f}x  (target >= {TARGET:.0f}x: "
          f"{'met' if on['ratio'] >= TARGET else 'NOT met'})")
    print(f"prefix cache used: {HIT} +{on['hit_delta']:.0f} over the trials (expected {expected}: "
          f"{a.trials} x {cached_blocks * a.block_size}); uncached trials hit nothing: "
          f"{all(h == 0 for h in on['uncached_hits'])} -> {'yes' if used else 'NO'}")
    if off is not None:
        print(f"control (--prefix-caching false): uncached {off['uncached'] * 1000:.1f} ms, 'cached' "
              f"{off['cached'] * 1000:.1f} ms, ratio {off['ratio']:.2f}x, hit tokens +{off['hit_delta']:.0f}")
    runs = [on] + ([off] if off else [])
    print(f"servers stopped: exit codes {[r['exit'] for r in runs]}, leftover processes "
          f"{[pid for r in runs for pid in r['leftover']] or 'none'}")


if __name__ == "__main__":
    main()
