"""Structured output's cost on SmolLM2: tokens/s with every request JSON-schema constrained against the
same requests unconstrained, at one stream and at 64, in one run on one server; and what compiling a
schema and computing masks cost.

    python benchmarks/structured_output.py [--new-tokens 128] [--concurrency 1,64] [--rounds 2]

Every request generates exactly ``--new-tokens`` tokens (EOS ignored) from its own 128-token prompt. The
constrained ones follow a schema no answer completes in that many tokens (an object holding at least 60
short strings), so both sides do the same number of steps and the ratio is the masks' price alone.
Constrained and unconstrained runs alternate (A B A B ...) and the ratio is of their medians: the machine's
drift cancels. Targets (issue #16): constrained >= 0.9x unconstrained at both concurrencies, and a typical
schema compiled in <= 50 ms, cached afterwards.

Then, in this process: the frontend's check of a typical schema (meta-schema + compile) cold and cached,
rank 0's matcher for it cold and cached (a copy of the compiled one), and the masks of a 64-row decode
step (the background thread's work, done on the main thread here to time it alone) next to the step time
the server showed at 64 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _server import (READY_TIMEOUT_S, client_session, exact_token_prompt, exit_on_sigterm, load_tokenizer,
                     stream_tokens)

from llmbus.bus.procfs import load_average
from llmbus.testing import Server

LONG_SCHEMA = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 60}},
    "required": ["notes"], "additionalProperties": False}
TYPICAL_SCHEMA = {  # what an API's response schema looks like: a dozen fields, nesting, enums, bounds
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 60},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "status": {"enum": ["active", "suspended", "deleted"]}, "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "country": {"type": "string", "minLength": 2, "maxLength": 2}},
                    "required": ["city", "country"], "additionalProperties": False},
        "created": {"type": "string", "format": "date-time"}, "admin": {"type": "boolean"},
        "manager": {"anyOf": [{"type": "null"}, {"type": "integer"}]}},
    "required": ["id", "name", "email", "status"], "additionalProperties": False}


async def _run(url: str, prompts: list[str], parameters: dict) -> tuple[int, float]:
    async with client_session() as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_tokens(session, url, p, parameters) for p in prompts))
        wall = time.perf_counter() - t0
    errors = [s.error for s in streams if s.error]
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    return sum(len(s.times) for s in streams), wall


def compile_costs() -> dict[str, float]:
    """Milliseconds: the frontend's check and rank 0's matcher for TYPICAL_SCHEMA, cold and cached."""
    from llmbus.bus.messages import Grammar
    from llmbus.frontend import grammar as frontend_grammar
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.supervisor.weights import smollm2_gguf
    from llmbus.workers.grammar import GrammarMasks

    def ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    out = {"frontend check, cold": ms(lambda: frontend_grammar.json_schema_grammar(TYPICAL_SCHEMA)),
           "frontend check, cached": ms(lambda: frontend_grammar.json_schema_grammar(TYPICAL_SCHEMA))}
    masks = GrammarMasks(materialize(smollm2_gguf()), 49152)
    grammar = Grammar("json_schema", json.dumps(TYPICAL_SCHEMA, separators=(",", ":")))
    out["rank 0 matcher, cold"] = ms(lambda: masks._matcher(grammar))
    out["rank 0 matcher, cached"] = statistics.median(ms(lambda: masks._matcher(grammar)) for _ in range(20))
    return out


def mask_step_ms(batch: int, rounds: int = 20) -> float:
    """Median milliseconds to compute ``batch`` masks of LONG_SCHEMA matchers part-way into their answer."""
    from tokenizers import Tokenizer

    from llmbus.bus.messages import Grammar
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.supervisor.weights import smollm2_gguf
    from llmbus.workers.grammar import GrammarMasks

    folder = materialize(smollm2_gguf())
    masks = GrammarMasks(folder, 49152)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    grammar = Grammar("json_schema", json.dumps(LONG_SCHEMA))
    answer = '{"notes": [' + ", ".join(f'"note number {i} of many"' for i in range(60)) + "]}"
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    for row in range(batch):  # each row at its own point of the answer, as in a real batch
        masks.observe(f"r{row}", grammar, 0, [], 0, ids[:8 + 3 * row])
    positions = [8 + 3 * row for row in range(batch)]
    states = [masks.requests[f"r{row}"] for row in range(batch)]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        masks._compute(states, positions)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=2, help="A/B pairs per concurrency")
    args = parser.parse_args()
    exit_on_sigterm()
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"load average before: {load_average()}")
    base = {"max_new_tokens": args.new_tokens, "ignore_eos_token": True}
    constrained = {**base, "grammar": {"type": "json", "value": LONG_SCHEMA}}
    results: dict[int, dict[str, list[float]]] = {}
    server_args = ["--max-concurrent-requests", "256", "--max-batch-prefill-tokens", "2048"]
    with Server(server_args, ready_timeout=READY_TIMEOUT_S) as server:
        tokenizer = load_tokenizer(_served_model_dir())
        prompts = [exact_token_prompt(tokenizer, args.prompt_tokens, f"p{i}") for i in range(max(levels))]
        asyncio.run(_run(server.url, prompts[:4], {**constrained, "max_new_tokens": 8}))  # warm-up both paths
        asyncio.run(_run(server.url, prompts[:4], {**base, "max_new_tokens": 8}))
        for c in levels:
            results[c] = {"unconstrained": [], "constrained": []}
            for _ in range(args.rounds):
                for name, parameters in (("unconstrained", base), ("constrained", constrained)):
                    tokens, wall = asyncio.run(_run(server.url, prompts[:c], parameters))
                    assert tokens == c * args.new_tokens, (name, tokens)
                    results[c][name].append(tokens / wall)
    print(f"load average after: {load_average()}\n")
    print("| streams | unconstrained tok/s | JSON-schema constrained tok/s | ratio (target >= 0.9) |")
    print("|---|---|---|---|")
    step_ms = {}
    for c, r in results.items():
        free, held = statistics.median(r["unconstrained"]), statistics.median(r["constrained"])
        step_ms[c] = 1000 * c / free
        print(f"| {c} | {free:.1f} | {held:.1f} | {held / free:.3f} |")
    print("\ncompile (ms) of a typical schema (12 fields, nesting, enum, pattern, bounds; target <= 50 cold):")
    for name, value in compile_costs().items():
        print(f"  {name}: {value:.2f}")
    for c in levels:
        masks = mask_step_ms(c)
        print(f"masks of a {c}-row step: {masks:.2f} ms, against the server's unconstrained {c}-stream step of "
              f"{step_ms[c]:.1f} ms ({100 * masks / step_ms[c]:.1f}%; computed during the forward pass)")


def _served_model_dir() -> str:
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.supervisor.weights import smollm2_gguf

    return str(materialize(smollm2_gguf()))


if __name__ == "__main__":
    main()
