"""Inter-token latency of 16 running streams while a 2,000-token prompt arrives: chunked prefill on
against off, each on its own `llmbus up` (demo `small` model by default).

    python benchmarks/chunked_prefill_itl.py [--model-id DIR] [--budget 24] [--modes on,off]
                                             [--streams 16] [--long-tokens 2000]

Per mode: ``--streams`` concurrent ``/generate_stream`` clients with short distinct prompts start (after
one warm-up long prompt); once every one has ``--warm-tokens`` tokens, the long prompt (exactly
``--long-tokens`` tokens; the server's count is checked in ``x-prompt-tokens``) goes to ``/generate``
with ``max_new_tokens`` 1. The streams run on until each has ``--tail-tokens`` tokens after the long
prompt's answer, then the client closes them. The demo model has random weights, so a greedy stream
can end on EOS: such a stream is reported and its slot moves on at once to a fresh prompt, so 16
streams keep running (with chunking the new one is admitted only when the step budget has room left,
so not before a long prompt that is being chunked is done).

From the streams' token arrival times (client side), an inter-token latency (ITL) is one gap between
two consecutive tokens of one stream:
- steady state: the gaps between the moment every stream had 3 tokens and the long prompt's sending;
- window: the gaps that overlap [long prompt sent, long prompt answered].
Headline: p99 ITL in the window / median steady-state ITL. Target with chunking: <= 2x.

- on: ``--max-batch-prefill-tokens B`` (``--budget``; a comma list measures several). Each step then
  computes B tokens at most: the streams' 16 decode tokens and a chunk of B - 16 prompt tokens.
- off: ``--prefill-chunking false --max-batch-prefill-tokens 2048``: the prompt is computed whole in
  one step (after TGI's ``waiting_served_ratio``/``max_waiting_tokens`` admission wait), and every
  stream waits for that step.
The table also shows the server's own mean forward and step times (its duration histograms) of steps
with prompt tokens and of decode-only steps, which separates model time from client and bus overhead.

Why the default budget is 24 (a chunk of 8 prompt tokens beside 16 decodes): a step costs about one
decode step plus the chunk's compute plus attention over the context the chunk extends, so only short
chunks keep the last steps of a long prompt near a decode step's time, and smaller budgets only lengthen
the window that catches the machine's stalls. The measurements behind it are in docs/design-notes.md
("Chunked prefill and budgets"). Noise moves the ratios run to run: the script prints the load average,
and the ratios of one run are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _server import (READY_TIMEOUT_S, Stream, client_session, default_model_dir, exact_token_prompt,
                     exit_on_sigterm, load_tokenizer, stream_tokens, wait_metrics)

from llmbus.bus.procfs import load_average
from llmbus.testing import Server

from llmbus.bench.stats import percentile

TARGET = 2.0
PREFILL_STEPS = 'tgi_batch_inference_count{method="prefill"}'
DECODE_STEPS = 'tgi_batch_inference_count{method="decode"}'
PREEMPTIONS = "llmbus_preemptions_total"
FORWARD = 'tgi_batch_forward_duration_{}{{method="{}"}}'
STEP = 'tgi_batch_inference_duration_{}{{method="{}"}}'


def idle(m: dict) -> bool:
    return m.get("tgi_batch_current_size") == 0 and m.get("tgi_queue_size") == 0


async def long_request(session, url: str, prompt: str) -> dict:
    """``/generate`` with max_new_tokens 1: when it was sent and answered, and the server's token count."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 1}}
    sent = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as resp:
        text = await resp.text()
        done = time.perf_counter()
        if resp.status != 200:
            raise RuntimeError(f"long prompt: HTTP {resp.status}: {text}")
        return {"sent": sent, "done": done, "prompt_tokens": int(resp.headers.get("x-prompt-tokens", -1))}


async def run_streams(url: str, prompts: list[list[str]], long_prompt: str, warm_long: str | None, a) -> tuple:
    """(streams of each slot, long request, /metrics before and after). One slot a prompt list: its
    first prompt streams, and a stream that ends by itself before being cut (EOS, or the ceiling) is
    replaced at once by the slot's next prompt, so ``len(prompts)`` streams keep running. The long
    prompt goes once every slot's stream has warm_tokens tokens; a stream is cut once it has tail_tokens
    tokens after the long prompt's answer."""
    slots: list[list[Stream]] = [[] for _ in prompts]
    answered: list[float] = []

    def until(s: Stream) -> bool:
        return bool(answered) and sum(t > answered[0] for t in s.times[-a.tail_tokens:]) >= a.tail_tokens

    params = {"max_new_tokens": a.max_new_tokens, "details": True}

    async def run_slot(session, i: int) -> None:
        for prompt in prompts[i]:
            s = Stream()
            slots[i].append(s)
            await stream_tokens(session, url, prompt, params, until=until, stream=s)
            if s.error:
                raise RuntimeError(f"stream {i}: {s.error}")
            if s.finish_reason is None:
                return  # cut by until()
        raise RuntimeError(f"slot {i}: all {len(prompts[i])} prompts ended by themselves before being cut")

    async with client_session() as session:
        if warm_long is not None:
            await long_request(session, url, warm_long)
        before = wait_metrics(url, idle)
        tasks = [asyncio.create_task(run_slot(session, i)) for i in range(len(prompts))]
        deadline = time.monotonic() + a.timeout
        try:
            while not all(slot and len(slot[-1].times) >= a.warm_tokens for slot in slots):
                if time.monotonic() > deadline or any(t.done() for t in tasks):
                    await asyncio.gather(*[t for t in tasks if t.done()])  # raises a slot's error
                    raise TimeoutError(f"streams not at {a.warm_tokens} tokens in {a.timeout} s: "
                                       f"{[len(slot[-1].times) if slot else 0 for slot in slots]}")
                await asyncio.sleep(0.01)
            long = await long_request(session, url, long_prompt)
            answered.append(long["done"])
            await asyncio.wait_for(asyncio.gather(*tasks), max(deadline - time.monotonic(), 1.0))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    after = wait_metrics(url, idle)
    return slots, long, before, after


def analyse(slots: list[list[Stream]], long: dict) -> dict:
    sent, done = long["sent"], long["done"]
    started = [slot[0].times[2] for slot in slots if len(slot[0].times) > 2]
    steady_from = max(started) if len(started) == len(slots) else sent
    steady, window, window_max, ended = [], [], [], []
    for i, slot in enumerate(slots):
        mine = []
        for s in slot:
            gaps = list(zip(s.times, s.times[1:]))  # within one stream: never across a replacement
            steady += [t1 - t0 for t0, t1 in gaps if t0 >= steady_from and t1 <= sent]
            mine += [t1 - t0 for t0, t1 in gaps if t1 > sent and t0 < done]
            if s.finish_reason is not None:
                when = "before" if s.times[-1] < sent else "after" if s.times[-1] > done else "inside"
                ended.append(f"stream {i}: {s.finish_reason} after {len(s.times)} tokens, {when} the window")
        window += mine
        window_max.append(max(mine, default=float("nan")))
    steady_median = statistics.median(steady) if steady else float("nan")
    p99 = percentile(window, 99) if window else float("nan")
    return {
        "steady_median": steady_median, "steady_n": len(steady),
        "window_median": statistics.median(window) if window else float("nan"),
        "window_p99": p99, "window_max": max(window, default=float("nan")), "window_n": len(window),
        "ratio": p99 / steady_median, "window_s": done - sent,
        "stream_window_max": (min(window_max), max(window_max)),
        "ended_early": ended,
        # slots whose one stream ran from before the long prompt's sending to after its answer
        "spanning": sum(1 for slot in slots if len(slot[-1].times) > 1 and slot[-1].times[0] < sent
                        and slot[-1].times[-1] > done),
        "tokens": [sum(len(s.times) for s in slot) for slot in slots],
    }


def mean_ms(before: dict, after: dict, family: str, method: str) -> float:
    """Mean of a duration histogram's observations between two /metrics reads, in ms."""
    n = after.get(family.format("count", method), 0) - before.get(family.format("count", method), 0)
    total = after.get(family.format("sum", method), 0) - before.get(family.format("sum", method), 0)
    return total / n * 1000 if n else float("nan")


def measure(label: str, server_args: list[str], prompts: list[list[str]], long_prompt: str,
            warm_long: str | None, a) -> dict:
    print(f"\n== {label}")
    with Server(server_args, ready_timeout=READY_TIMEOUT_S) as srv:
        print(f"ready in {srv.startup_s:.1f} s; load average {load_average()}", flush=True)
        slots, long, before, after = asyncio.run(run_streams(srv.url, prompts, long_prompt, warm_long, a))
        errors = srv.log_lines("[error", "[warning", "Traceback")
    if long["prompt_tokens"] != a.long_tokens:
        raise RuntimeError(f"the server counted {long['prompt_tokens']} long-prompt tokens, not {a.long_tokens}")
    r = analyse(slots, long)
    r.update(label=label, command=srv.command_line, startup=srv.startup_s, leftover=srv.leftover,
             exit=srv.proc.returncode, latency=long["done"] - long["sent"], server_errors=errors,
             **{k: after.get(name, 0) - before.get(name, 0) for k, name in
                (("prefill_steps", PREFILL_STEPS), ("decode_steps", DECODE_STEPS), ("preemptions", PREEMPTIONS))},
             **{f"{k}_{method}": mean_ms(before, after, family, method) for k, family in
                (("forward", FORWARD), ("step", STEP)) for method in ("prefill", "decode")})
    print(f"steady median ITL {r['steady_median'] * 1000:.1f} ms ({r['steady_n']} gaps); window "
          f"{r['window_s'] * 1000:.0f} ms: median {r['window_median'] * 1000:.1f}, p99 {r['window_p99'] * 1000:.1f}, "
          f"max {r['window_max'] * 1000:.1f} ms ({r['window_n']} gaps); p99/steady {r['ratio']:.2f}x")
    print(f"long prompt: {r['latency'] * 1000:.0f} ms; steps during the streams: {r['prefill_steps']:.0f} "
          f"with prompt tokens, {r['decode_steps']:.0f} decode-only; preemptions {r['preemptions']:.0f}")
    print(f"streams: tokens {min(r['tokens'])}..{max(r['tokens'])} each, {r['spanning']}/{len(slots)} streamed "
          f"across the whole window; per-stream max ITL in the window "
          f"{r['stream_window_max'][0] * 1000:.0f}..{r['stream_window_max'][1] * 1000:.0f} ms")
    print(f"streams that ended by themselves (replaced at once): {r['ended_early'] or 'none'}")
    print(f"server shut down with exit code {r['exit']}; leftover server processes: {r['leftover'] or 'none'}; "
          f"server error/warning lines: {len(errors)}")
    for line in errors[:10]:
        print(f"  {line}")
    return r


ROWS = ("steady-state median ITL (ms)", "window median ITL (ms)", "window p99 ITL (ms)", "window max ITL (ms)",
        "p99 window / steady median", "long prompt latency (ms)", "gaps: steady / window",
        "steps with prompt tokens", "  their mean forward / step (ms)", "decode-only forward / step (ms)",
        "preemptions", "streams across the window", "streams ended early (replaced)")


def cells(r: dict) -> list[str]:
    """One run's column of the summary table, in the order of ROWS."""
    ms = {k: r[k] * 1000 for k in ("steady_median", "window_median", "window_p99", "window_max", "latency")}
    return [f"{ms['steady_median']:.1f}", f"{ms['window_median']:.1f}", f"{ms['window_p99']:.1f}",
            f"{ms['window_max']:.1f}", f"{r['ratio']:.2f}x", f"{ms['latency']:.0f}",
            f"{r['steady_n']}/{r['window_n']}", f"{r['prefill_steps']:.0f}",
            f"{r['forward_prefill']:.1f}/{r['step_prefill']:.1f}", f"{r['forward_decode']:.1f}/{r['step_decode']:.1f}",
            f"{r['preemptions']:.0f}", f"{r['spanning']}/{len(r['tokens'])}", str(len(r["ended_early"]))]


def table(runs: list[dict]) -> None:
    width = max(12, *(len(r["label"]) for r in runs)) + 2
    columns = [cells(r) for r in runs]
    print(f"{'':32}" + "".join(f"{r['label']:>{width}}" for r in runs))
    for i, title in enumerate(ROWS):
        print(f"{title:32}" + "".join(f"{col[i]:>{width}}" for col in columns))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget", default="24",
                   help="--max-batch-prefill-tokens with chunking; a comma list measures each (default 24)")
    p.add_argument("--modes", default="on,off", help="on, off or both (on,off)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-prompt-tokens", type=int, default=12)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--max-total-tokens", type=int, default=2048,
                   help="server limit; also the budget without chunking (>= --long-tokens)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="ceiling of each stream (default: what --max-total-tokens leaves; streams are cut anyway)")
    p.add_argument("--warm-tokens", type=int, default=20, help="tokens every stream has before the long prompt")
    p.add_argument("--tail-tokens", type=int, default=10, help="tokens each stream gets after the long prompt")
    p.add_argument("--replacements", type=int, default=5,
                   help="prompts a stream slot may move on to when its stream ends by itself (EOS)")
    p.add_argument("--no-warmup", action="store_true", help="skip the long warm-up prompt before the streams")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the streams of one mode may take")
    a = p.parse_args()
    exit_on_sigterm()
    if a.model_id is None:
        a.model_id = default_model_dir()
    a.max_new_tokens = min(a.max_new_tokens or a.max_total_tokens, a.max_total_tokens - a.stream_prompt_tokens)
    modes = a.modes.split(",")
    budgets = [int(b) for b in a.budget.split(",")]
    tokenizer = load_tokenizer(a.model_id)
    prompts = [[exact_token_prompt(tokenizer, a.stream_prompt_tokens, f"Stream {i}:" if r == 0 else f"Stream {i}.{r}:")
                for r in range(1 + a.replacements)] for i in range(a.streams)]
    long_prompt = exact_token_prompt(tokenizer, a.long_tokens, "long prompt")
    warm_long = None if a.no_warmup else exact_token_prompt(tokenizer, a.long_tokens, "warm-up")
    common = ["--model-id", a.model_id, "--dtype", a.dtype, "--max-input-tokens", str(a.long_tokens),
              "--max-total-tokens", str(a.max_total_tokens), "--graceful-termination-timeout", "5"]
    print(f"model {a.model_id}; {a.streams} streams ({a.stream_prompt_tokens}-token prompts, up to "
          f"{a.max_new_tokens} new tokens, cut {a.tail_tokens} tokens after the long prompt's answer); "
          f"long prompt {a.long_tokens} tokens after {a.warm_tokens} tokens a stream")

    runs = []
    if "on" in modes:
        for b in budgets:
            runs.append(measure(f"on B={b}", [*common, "--max-batch-prefill-tokens", str(b)],
                                prompts, long_prompt, warm_long, a))
    if "off" in modes:
        runs.append(measure("off", [*common, "--prefill-chunking", "false",
                                    "--max-batch-prefill-tokens", str(a.max_total_tokens)],
                            prompts, long_prompt, warm_long, a))

    print("\n== summary")
    for r in runs:
        print(f"{r['label']}: {r['command']}")
    print(f"load average now {load_average()}")
    table(runs)
    for r in runs:
        if r["label"].startswith("on"):
            print(f"{r['label']}: p99 ITL in the window {r['ratio']:.2f}x the steady median "
                  f"(target <= {TARGET:.0f}x: {'met' if r['ratio'] <= TARGET else 'NOT met'})")
    early = [(r["label"], r["ended_early"]) for r in runs if r["ended_early"]]
    print(f"streams that ended by themselves before being cut (each replaced at once): {early or 'none'}")
    print(f"servers stopped: exit codes {[r['exit'] for r in runs]}, leftover processes "
          f"{[pid for r in runs for pid in r['leftover']] or 'none'}")


if __name__ == "__main__":
    main()
