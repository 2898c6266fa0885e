"""N-gram speculation (`--speculate N`) against plain decoding, same model, same run.

SmolLM2-135M-Instruct (the dense float32 folder of the packaged weights) on input-grounded tasks, where
the answer repeats its input: rewriting a piece of code with one change, and repeating a passage with one
word changed; and on two free tasks: a poem, whose greedy output starts free and turns repetitive after
about 65 tokens (the model repeats its own sentences), and a question whose answer guesses do not help
(free prose, few n-gram guesses right). Single stream: tokens/s of each task with and without speculation
(greedy, so the outputs must be identical, which the script checks), the median of the ratios of runs
measured in turn, and each task's acceptance from /metrics. Then 64 concurrent streams of the grounded
tasks with and without `--speculate` (speculation switches itself off in steps with more than
--speculate-max-batch decodes): the target is no regression.

    python benchmarks/speculation.py [--speculate 4] [--new-tokens 160] [--repeats 5] [--concurrency 0]

Targets: >= 1.8x single-stream tokens/s on the grounded tasks (issue #19); > 1.0x on free-then-repetitive
output and >= 0.98x on unhelpful output (issue #35); <= 2% slower at c=64.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from _server import READY_TIMEOUT_S, client_session, exit_on_sigterm, metrics, stream_tokens
from _smollm2 import dense_folder

from llmbus.testing import Server

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''
PASSAGE = ("The river town grew around a stone bridge built in the twelfth century. Merchants crossed it "
           "with wool and salt, and a market square formed at its northern end. In the winter of 1740 a "
           "flood carried away two arches; the town council rebuilt them in brick, and the repair can "
           "still be seen from the towpath. The railway reached the town in 1852, and with it came a mill, "
           "a school and a new church whose tower is the tallest building in the valley.")
GROUNDED = {
    "code rewrite": "Rewrite this Python function, renaming the parameter `values` to `samples`. Output only "
                    "the code.\n\n" + CODE,
    "passage copy": "Repeat the following passage exactly, but replace the word 'river' with 'canal'.\n\n" + PASSAGE,
}
TASKS = {
    **GROUNDED,
    # SmolLM2's greedy answer: about 65 tokens of free verse, then the same two sentences over and over
    "free then rep.": "Write a short poem about the sea.",
    # free prose for 160 tokens: n-gram guesses are rarely right (they pay from about a quarter kept)
    "unhelpful": "Why is the sky blue?",
}


def chat(prompt: str) -> str:
    # SmolLM2-Instruct's chat template, written out: /generate takes raw text, as TGI's does
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


async def single_stream(url: str, prompt: str, new_tokens: int) -> tuple[float, list[str]]:
    async with client_session() as session:
        s = await stream_tokens(session, url, chat(prompt), {"max_new_tokens": new_tokens, "details": True})
    assert s.error is None, s.error
    return len(s.times) / (s.times[-1] - s.sent), s.last["generated_text"]


async def concurrent(url: str, n: int, new_tokens: int) -> float:
    """Tokens/s of ``n`` grounded requests at once."""
    prompts = list(GROUNDED.values())
    async with client_session() as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_tokens(session, url, chat(prompts[i % len(prompts)]),
                                                       {"max_new_tokens": new_tokens, "ignore_eos": False})
                                         for i in range(n)))
        elapsed = time.perf_counter() - t0
    assert not [s.error for s in streams if s.error]
    return sum(len(s.times) for s in streams) / elapsed


def spec_counts(samples: dict[str, float]) -> tuple[float, float]:
    """(guessed, kept) tokens so far, over every method."""
    def total(name: str) -> float:
        return sum(v for k, v in samples.items() if k.split("{")[0] == name)
    return (total("llmbus_speculative_proposed_tokens_total"), total("llmbus_speculative_accepted_tokens_total"))


def sweep(concurrencies: list[int], args) -> int:
    model = str(dense_folder("bfloat16"))
    common = ["--model-id", model, "--dtype", "float32", "--max-total-tokens", "1024",
              "--kv-cache-memory", str(2 * 2**30), "--max-concurrent-requests", "256"]
    always = ["--speculate", str(args.speculate), "--speculate-max-batch", "1000"]
    with Server(common, ready_timeout=READY_TIMEOUT_S) as plain, \
            Server([*common, *always], ready_timeout=READY_TIMEOUT_S) as spec:
        print(f"\n{'concurrency':>11} {'plain tok/s':>12} {'speculate tok/s':>16} {'ratio':>7}")
        for c in concurrencies:
            rates = {"plain": [], "spec": []}
            for _ in range(args.repeats):
                for label, srv in (("plain", plain), ("spec", spec)):
                    rates[label].append(asyncio.run(concurrent(srv.url, c, args.new_tokens)))
            a, b = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            print(f"{c:>11} {a:>12.1f} {b:>16.1f} {b / a:>6.2f}x", flush=True)
    return 0


def main() -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64, help="streams of the loaded run; 0: single streams only")
    ap.add_argument("--sweep", default="", help="instead: concurrencies (e.g. 1,2,4,8) at which to compare plain "
                                                "decoding with speculation that never switches off, to find where "
                                                "it stops paying (--speculate-max-batch)")
    args = ap.parse_args()
    if args.sweep:
        return sweep([int(c) for c in args.sweep.split(",")], args)
    model = str(dense_folder("bfloat16"))
    common = ["--model-id", model, "--dtype", "float32", "--max-total-tokens", "1024",
              "--kv-cache-memory", str(2 * 2**30), "--max-concurrent-requests", "256"]
    # Both servers up at once and measured in turn (A, B, A, B, ...), so a slower minute of this shared
    # machine falls on both.
    with Server(common, ready_timeout=READY_TIMEOUT_S) as plain, \
            Server([*common, "--speculate", str(args.speculate)], ready_timeout=READY_TIMEOUT_S) as spec:
        servers = {"plain": plain, "speculate": spec}
        single = {label: {task: [] for task in TASKS} for label in servers}
        texts = {label: {} for label in servers}
        accepted = {}  # task -> (guessed, kept) over its speculating runs
        for task, prompt in TASKS.items():
            for srv in servers.values():
                asyncio.run(single_stream(srv.url, prompt, 8))  # warm the path once
            before = spec_counts(metrics(spec.url))
            for i in range(args.repeats):
                order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]  # A B, B A, ...
                for label, srv in order:
                    rate, text = asyncio.run(single_stream(srv.url, prompt, args.new_tokens))
                    single[label][task].append(rate)
                    texts[label][task] = text
            after = spec_counts(metrics(spec.url))
            accepted[task] = (after[0] - before[0], after[1] - before[1])
        guessed, kept = spec_counts(metrics(spec.url))
        loaded = {label: [] for label in servers}
        for _ in range(args.repeats if args.concurrency else 0):
            for label, srv in servers.items():
                loaded[label].append(asyncio.run(concurrent(srv.url, args.concurrency, 64)))
        guessed_loaded = spec_counts(metrics(spec.url))[0] - guessed
    print(f"\nSmolLM2 float32, greedy, {args.new_tokens} new tokens, median of {args.repeats}, servers measured "
          f"in turn; --speculate {args.speculate}")
    print(f"{'task':<14} {'plain tok/s':>12} {'speculate tok/s':>16} {'ratio':>7} {'paired':>7}  {'kept':>13}  "
          f"same output")
    for task in TASKS:
        plain_rates, spec_rates = single["plain"][task], single["speculate"][task]
        a, b = statistics.median(plain_rates), statistics.median(spec_rates)
        paired = statistics.median(y / x for x, y in zip(plain_rates, spec_rates))  # each run against its partner
        task_guessed, task_kept = accepted[task]
        share, same = task_kept / max(task_guessed, 1), texts["plain"][task] == texts["speculate"][task]
        print(f"{task:<14} {a:>12.1f} {b:>16.1f} {b / a:>6.3f}x {paired:>6.3f}x  "
              f"{task_kept:>4.0f}/{task_guessed:<4.0f} {share:>3.0%}  {same}")
    print(f"acceptance over the single-stream runs: {kept:.0f} of {guessed:.0f} guesses ({kept / max(guessed, 1):.0%})")
    if not args.concurrency:
        return 0 if all(texts["plain"][t] == texts["speculate"][t] for t in TASKS) else 1
    a, b = statistics.median(loaded["plain"]), statistics.median(loaded["speculate"])
    print(f"c={args.concurrency}: plain {a:.1f} tok/s, speculate {b:.1f} tok/s ({b / a:.3f}x; runs plain "
          f"{[round(x, 1) for x in loaded['plain']]}, speculate {[round(x, 1) for x in loaded['speculate']]}; "
          f"guesses fed at this load: {guessed_loaded:.0f})")
    same = all(texts["plain"][t] == texts["speculate"][t] for t in TASKS)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
