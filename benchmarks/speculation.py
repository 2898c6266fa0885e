"""N-gram speculation (`--speculate N`) against plain decoding, same model, same run.

SmolLM2-135M-Instruct (the dense float32 folder of the packaged weights) on input-grounded tasks, where
the answer repeats its input: rewriting a piece of code with one change, and repeating a passage with one
word changed. Single stream: tokens/s of each task with and without speculation (greedy, so the outputs
must be identical, which the script checks), and the acceptance rate from /metrics. Then 64 concurrent
streams of the same tasks with and without `--speculate` (speculation switches itself off in steps with
more than --speculate-max-batch decodes): the target is no regression.

    python benchmarks/speculation.py [--speculate 4] [--new-tokens 160]

Targets (issue #19): >= 1.8x single-stream tokens/s on the grounded tasks; <= 2% slower at c=64.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import LlmbusServer, client_session, exit_on_sigterm, metrics, stream_tokens  # noqa: E402
from _smollm2 import dense_folder  # noqa: E402

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
TASKS = {
    "code rewrite": "Rewrite this Python function, renaming the parameter `values` to `samples`. Output only "
                    "the code.\n\n" + CODE,
    "passage copy": "Repeat the following passage exactly, but replace the word 'river' with 'canal'.\n\n" + PASSAGE,
}


def chat(prompt: str) -> str:
    # SmolLM2-Instruct's chat template, written out: /generate takes raw text, as TGI's does
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


async def single(url: str, prompt: str, new_tokens: int) -> tuple[float, list[str]]:
    async with client_session() as session:
        s = await stream_tokens(session, url, chat(prompt), {"max_new_tokens": new_tokens, "details": True})
    assert s.error is None, s.error
    return len(s.times) / (s.times[-1] - s.sent), s.last["generated_text"]


async def concurrent(url: str, n: int, new_tokens: int) -> float:
    prompts = list(TASKS.values())
    async with client_session() as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_tokens(session, url, chat(prompts[i % len(prompts)]),
                                                       {"max_new_tokens": new_tokens, "ignore_eos": False})
                                         for i in range(n)))
        elapsed = time.perf_counter() - t0
    assert not [s.error for s in streams if s.error]
    return sum(len(s.times) for s in streams) / elapsed


def main() -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    model = str(dense_folder("bfloat16"))
    common = ["--model-id", model, "--dtype", "float32", "--max-total-tokens", "1024",
              "--kv-cache-memory", str(2 * 2**30), "--max-concurrent-requests", "256"]
    results = {}
    for label, extra in (("plain", []), ("speculate", ["--speculate", str(args.speculate)])):
        with LlmbusServer([*common, *extra]) as srv:
            per_task = {}
            for task, prompt in TASKS.items():
                asyncio.run(single(srv.url, prompt, 8))  # warm the path once
                runs = [asyncio.run(single(srv.url, prompt, args.new_tokens)) for _ in range(args.repeats)]
                per_task[task] = (statistics.median(r[0] for r in runs), runs[0][1])
            before = metrics(srv.url)
            c64 = [asyncio.run(concurrent(srv.url, args.concurrency, 64)) for _ in range(2)]
            after = metrics(srv.url)
            results[label] = {"tasks": per_task, "c64": max(c64), "metrics": before,
                              "c64_proposed": after.get("llmbus_speculative_proposed_tokens_total", 0)
                              - before.get("llmbus_speculative_proposed_tokens_total", 0)}
    plain, spec = results["plain"], results["speculate"]
    print(f"\nSmolLM2 float32, greedy, {args.new_tokens} new tokens, median of {args.repeats}; "
          f"--speculate {args.speculate}")
    print(f"{'task':<14} {'plain tok/s':>12} {'speculate tok/s':>16} {'ratio':>7}  same output")
    for task in TASKS:
        a, text_a = plain["tasks"][task]
        b, text_b = spec["tasks"][task]
        print(f"{task:<14} {a:>12.1f} {b:>16.1f} {b / a:>6.2f}x  {text_a == text_b}")
    m = spec["metrics"]
    proposed = m.get("llmbus_speculative_proposed_tokens_total", 0)
    accepted = m.get("llmbus_speculative_accepted_tokens_total", 0)
    print(f"acceptance over the single-stream runs: {accepted:.0f} of {proposed:.0f} guesses "
          f"({accepted / max(proposed, 1):.0%})")
    print(f"c={args.concurrency}: plain {plain['c64']:.1f} tok/s, speculate {spec['c64']:.1f} tok/s "
          f"({spec['c64'] / plain['c64']:.3f}x; guesses fed at this load: {spec['c64_proposed']:.0f})")
    same = all(plain["tasks"][t][1] == spec["tasks"][t][1] for t in TASKS)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
