"""Soak: N clients send requests back to back for a while; does any process grow?

Starts `llmbus up`, runs clients in a loop, and samples every process's resident memory (RSS, from /proc)
once a minute. Prints the table (one column per process, one row per minute), then requests served,
errors, tokens/s and the KV blocks free once the load stopped, and a PASS/FAIL line: every process within
``--tolerance`` (2%) of its RSS at ``--reference-minute`` (5) from then to the end, no failed request, and
every KV block free.

- ``--mode plain`` (the demo `small` model): 8 clients of streaming requests of a few lengths, a quarter
  cut mid-stream by the client.
- ``--mode mixed`` (issue #36; SmolLM2's bfloat16 folder, ``--dtype bfloat16 --speculate 4``): 16 clients,
  each request one kind drawn in turn: greedy, seeded sampling, a stream the client cuts, tools with
  ``tool_choice: "required"``, a strict JSON schema, stop sequences, ``top_n_tokens``, ``n=2`` on
  /v1/completions, ``best_of=2``. ``--kinds`` sends only some of them (to find which one leaves something
  behind).

    python benchmarks/soak.py --mode mixed --duration 3600
    python benchmarks/soak.py --duration 600 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from _server import READY_TIMEOUT_S, client_session, default_model_dir, exit_on_sigterm, stream_tokens, wait_metrics

from llmbus.bus.procfs import command_words, descendants, rss_bytes
from llmbus.testing import Server

PROMPTS = ["Tell me about the history of the city by the river.", "Write a short poem about winter.",
           "List the parts of a bridge.", "Why do ships float?", "Describe a market square in summer."]
# The mixed mode's /generate prompts, in SmolLM2's chat format (ChatML): a raw prompt makes an instruct model
# answer with end-of-sequence at once, which would leave the decode paths unexercised.
CHAT_PROMPTS = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "find_bridge", "description": "Bridges over a river",
        "parameters": {"type": "object", "properties": {"river": {"type": "string"},
                                                        "limit": {"type": "integer", "minimum": 1}},
                       "required": ["river"]}}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "founded", "districts"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "founded": {"type": "integer"},
                         "districts": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                       "maxItems": 4}}}


def rss_by_process(root: int) -> dict[str, int]:
    """Resident bytes of each process of the launch, by a readable name (no pid: a name stays the same
    column across samples)."""
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
        out[name] = rss
    return out


# -- what one request of each kind sends, and whether its answer is what it asked for -------------------

async def _post(session, url: str, path: str, body: dict) -> dict:
    async with session.post(f"{url}{path}", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{path} HTTP {resp.status}: {text[:200]}")
        return json.loads(text)


def _tokens(answer) -> int:
    """Generated tokens of a TGI answer (one object or a list)."""
    answers = answer if isinstance(answer, list) else [answer]
    return sum(a.get("details", {}).get("generated_tokens", 0) for a in answers)


async def greedy(session, url, rng):
    out = await _post(session, url, "/generate", {"inputs": rng.choice(CHAT_PROMPTS), "parameters": {
        "max_new_tokens": rng.choice([16, 48]), "details": True}})
    return _tokens(out)


async def seeded(session, url, rng):
    out = await _post(session, url, "/generate", {"inputs": rng.choice(CHAT_PROMPTS), "parameters": {
        "max_new_tokens": 48, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(2**32),
        "details": True}})
    return _tokens(out)


async def cut_stream(session, url, rng):
    cut_at = rng.choice([2, 6, 12])
    s = await stream_tokens(session, url, rng.choice(CHAT_PROMPTS), {"max_new_tokens": 96},
                            until=lambda st: len(st.times) >= cut_at)
    if s.error is not None:
        raise RuntimeError(f"stream: {s.error}")
    return len(s.times)


async def tools(session, url, rng):
    out = await _post(session, url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": rng.choice(["Weather in Paris?", "Bridges over the Thames?"])}],
        "tools": TOOLS, "tool_choice": "required", "max_tokens": 64})
    choice = out["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        for call in choice["message"]["tool_calls"]:
            json.loads(call["function"]["arguments"])  # a call must parse
    return out["usage"]["completion_tokens"]


async def json_schema(session, url, rng):
    out = await _post(session, url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Describe a city as JSON."}], "max_tokens": 96,
        "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(2**32),
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                                  "strict": True}}})
    choice = out["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])  # a complete answer must parse
    return out["usage"]["completion_tokens"]


async def stop_sequences(session, url, rng):
    out = await _post(session, url, "/generate", {"inputs": rng.choice(CHAT_PROMPTS), "parameters": {
        "max_new_tokens": 64, "stop": [".", "\n", " the"], "details": True}})
    return _tokens(out)


async def top_n(session, url, rng):
    out = await _post(session, url, "/generate", {"inputs": rng.choice(CHAT_PROMPTS), "parameters": {
        "max_new_tokens": 24, "top_n_tokens": 5, "details": True, "decoder_input_details": True}})
    return _tokens(out)


async def completions_n2(session, url, rng):
    out = await _post(session, url, "/v1/completions", {
        "prompt": rng.choice(CHAT_PROMPTS), "n": 2, "max_tokens": 32, "temperature": 0.9, "seed": rng.randrange(2**32)})
    if len(out["choices"]) != 2:
        raise RuntimeError(f"n=2 answered {len(out['choices'])} choices")
    return out["usage"]["completion_tokens"]


async def best_of(session, url, rng):
    out = await _post(session, url, "/generate", {"inputs": rng.choice(CHAT_PROMPTS), "parameters": {
        "max_new_tokens": 32, "best_of": 2, "do_sample": True, "details": True}})  # TGI refuses a seed here
    return _tokens(out)


KINDS = {f.__name__: f for f in (greedy, seeded, cut_stream, tools, json_schema, stop_sequences, top_n,
                                 completions_n2, best_of)}


async def plain(session, url, rng):
    """The plain mode's one kind: a streaming request of some length, a quarter cut by the client."""
    cut = rng.random() < 0.25
    s = await stream_tokens(session, url, rng.choice(PROMPTS), {"max_new_tokens": rng.choice([8, 32, 96])},
                            until=(lambda st: len(st.times) >= 4) if cut else None)
    if s.error is not None:
        raise RuntimeError(f"stream: {s.error}")
    return len(s.times)


# -- the load and the samples -----------------------------------------------------------------------

async def client(url: str, deadline: float, rng: random.Random, kinds: list, counts: dict) -> None:
    async with client_session() as session:
        i = rng.randrange(len(kinds))  # clients start at different kinds, then take each in turn
        while time.monotonic() < deadline:
            kind = kinds[i % len(kinds)]
            i += 1
            try:
                # awaited before the += : `counts[k] += await ...` reads the count before the await and
                # would drop the tokens every other client added meanwhile
                tokens = await kind(session, url, rng)
                counts["tokens"] += tokens
            except Exception as e:  # noqa: BLE001 - a failure is counted and shown, the soak goes on
                counts["errors"] += 1
                if counts["errors"] <= 5:
                    print(f"error ({kind.__name__}): {type(e).__name__}: {e}", file=sys.stderr)
            counts["requests"] += 1


async def load(url: str, clients: int, seconds: float, kinds: list, counts: dict, server_pid: int,
               samples: list) -> None:
    """``clients`` clients for ``seconds``; RSS of every process into ``samples`` at the start and at
    every full minute after it (while the load runs, so each sample is taken under load)."""
    started = time.monotonic()
    deadline = started + seconds
    tasks = [asyncio.create_task(client(url, deadline, random.Random(i), kinds, counts)) for i in range(clients)]
    minute = 0
    while True:
        samples.append((minute, rss_by_process(server_pid), counts["requests"]))
        minute += 1
        next_sample = started + 60 * minute
        if next_sample > deadline:
            break
        # waits on the clients, woken by the clock only to take the next minute's sample
        done, _ = await asyncio.wait(tasks, timeout=next_sample - time.monotonic())
        if len(done) == len(tasks):
            break
    await asyncio.gather(*tasks)


def verdict(samples: list, reference_minute: int, tolerance: float) -> tuple[dict[str, float], bool]:
    """Each process's largest relative distance from its RSS at ``reference_minute`` over the samples from
    then on (None where the run was shorter), and whether all stay within ``tolerance``."""
    ref = next((rss for minute, rss, _ in samples if minute == reference_minute), None)
    if ref is None:
        return {}, False
    worst = {name: max(abs(rss[name] - base) / base for minute, rss, _ in samples
                       if minute >= reference_minute and name in rss) for name, base in ref.items()}
    return worst, all(w <= tolerance for w in worst.values())


def print_table(samples: list) -> None:
    names = list(samples[0][1])
    width = max(12, *(len(n) + 1 for n in names))
    print(f"{'minute':>6} {'requests':>9} " + " ".join(f"{n:>{width}}" for n in names) + "   (RSS MiB)")
    for minute, rss, requests in samples:
        print(f"{minute:>6} {requests:>9} "
              + " ".join(f"{rss[n] / 2**20:>{width}.1f}" if n in rss else f"{'-':>{width}}" for n in names))


def server_args(args) -> list[str]:
    if args.mode == "plain":
        model = args.model_id or default_model_dir()
        return ["--model-id", model, "--max-total-tokens", "256", "--max-concurrent-requests", "64"]
    if args.model_id is None:
        from _smollm2 import dense_folder

        model = str(dense_folder("bfloat16"))
    else:
        model = args.model_id
    return ["--model-id", model, "--dtype", args.dtype, "--speculate", "4", "--max-total-tokens", "1024",
            "--max-concurrent-requests", "128"]


def main() -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("plain", "mixed"), default="plain")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load after the warm-up")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before minute 0")
    ap.add_argument("--clients", type=int, default=None, help="default: 8 (plain), 16 (mixed)")
    ap.add_argument("--model-id", default=None,
                    help="default: the demo `small` model (plain), SmolLM2's bfloat16 folder (mixed)")
    ap.add_argument("--dtype", default="bfloat16", help="mixed mode's --dtype")
    ap.add_argument("--kinds", default=",".join(KINDS), help="mixed mode: the kinds sent, comma-separated")
    ap.add_argument("--reference-minute", type=int, default=5, help="the sample every later one is held to")
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative RSS change allowed")
    ap.add_argument("--server-arg", action="append", default=[], help="one more `llmbus up` argument (repeat)")
    args = ap.parse_args()
    clients = args.clients or (8 if args.mode == "plain" else 16)
    kinds = [plain] if args.mode == "plain" else [KINDS[k] for k in args.kinds.split(",")]
    with Server(server_args(args) + args.server_arg, ready_timeout=READY_TIMEOUT_S) as srv:
        counts = {"requests": 0, "tokens": 0, "errors": 0}
        asyncio.run(load(srv.url, clients, args.warmup, kinds, counts, srv.proc.pid, []))
        served_before, samples = dict(counts), []
        t0 = time.monotonic()
        asyncio.run(load(srv.url, clients, args.duration, kinds, counts, srv.proc.pid, samples))
        elapsed = time.monotonic() - t0
        # the scheduler's numbers reach /metrics asynchronously: wait for the pool to be whole again
        final = wait_metrics(srv.url, lambda s: s.get("llmbus_kv_blocks_free") == s.get("llmbus_kv_blocks_total"))
        samples.append((round(elapsed / 60, 1), rss_by_process(srv.proc.pid), counts["requests"]))
    free, total = final.get("llmbus_kv_blocks_free", float("nan")), final.get("llmbus_kv_blocks_total", float("nan"))
    print(f"soak ({args.mode}): {clients} clients, {elapsed:.0f} s after a {args.warmup:.0f} s warm-up; "
          f"{counts['requests'] - served_before['requests']} requests, "
          f"{(counts['tokens'] - served_before['tokens']) / elapsed:.1f} tokens/s, {counts['errors']} errors; "
          f"KV blocks free at the end: {free:.0f} of {total:.0f}")
    print_table(samples)
    worst, within = verdict(samples, args.reference_minute, args.tolerance)
    for name, w in worst.items():
        print(f"{name}: at most {100 * w:.2f}% from minute {args.reference_minute}")
    print(f"leftover processes after stop: {srv.leftover}")
    ok = within and not counts["errors"] and free == total and not srv.leftover
    print(f"{'PASS' if ok else 'FAIL'}: every process within {100 * args.tolerance:g}% of minute "
          f"{args.reference_minute}{'' if worst else ' (run too short to tell)'}, {counts['errors']} errors, "
          f"{free:.0f} of {total:.0f} KV blocks free")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
