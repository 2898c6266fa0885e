"""Throughput of `llmbus up` at concurrency N (default 64) beside transformers static batching of the same
N requests, measured in the same run (issue #7's throughput bar).

    python benchmarks/model_concurrency.py [--model-id DIR] [--requests 64] [--prompt-tokens 128]
                                           [--new-tokens 128] [--dtype bfloat16] [--server-arg=--flag=value ...]
                                           [--server-env KEY=VALUE ...]

Every request has a prompt of exactly ``--prompt-tokens`` tokens (distinct prompts, so the prefix cache
does not help) and generates exactly ``--new-tokens`` tokens (greedy, ``ignore_eos_token``). llmbus:
all N streams sent at once over HTTP, throughput = generated tokens / wall time from the first send to
the last token. transformers: one ``generate`` call on the N prompts as one batch (same length, so no
padding), same dtype, the same time definition. The compute roofline (``--peak-gflops``, default the
bf16 GEMM rate measured in this run on a large matmul) divided by the model's FLOPs per token gives the
tokens/s ceiling the result is compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch

from _server import (READY_TIMEOUT_S, client_session, default_model_dir, exact_token_prompt, exit_on_sigterm,
                     load_tokenizer, stream_tokens)

from llmbus.bus.procfs import load_average
from llmbus.testing import Server


async def _all_streams(url: str, prompts: list[str], new_tokens: int) -> tuple[list, float]:
    params = {"max_new_tokens": new_tokens, "ignore_eos_token": True, "do_sample": False}
    async with client_session() as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(stream_tokens(session, url, p, params) for p in prompts))
    return streams, t0


def llmbus_throughput(model_dir: str, dtype: str, prompts: list[str], warm: list[str], new_tokens: int,
                      server_args: list[str]) -> dict:
    with Server(["--model-id", model_dir, "--dtype", dtype, *server_args], ready_timeout=READY_TIMEOUT_S) as srv:
        asyncio.run(_all_streams(srv.url, warm, 8))  # warm-up: every path once
        streams, t0 = asyncio.run(_all_streams(srv.url, prompts, new_tokens))
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, first: {errors[0]}")
    tokens = sum(len(s.times) for s in streams)
    wall = max(s.times[-1] for s in streams) - t0
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall, startup=srv.startup_s,
                ttft=statistics.median(s.ttft for s in streams))


def transformers_throughput(model_dir: str, dtype: torch.dtype, prompts: list[str], new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = tok(prompts, return_tensors="pt").input_ids  # equal lengths: no padding
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        warm = ids[:4]
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kw)
        wall = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall)


def peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def flops_per_token(model_dir: str) -> float:
    """2 x the weights a generated token multiplies (the embedding is a lookup; a tied one counts once,
    as the LM head), ignoring attention's context-dependent part (small at these lengths)."""
    from roofline import weight_bytes

    return 2 * weight_bytes(model_dir, torch.float32) / 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--peak-gflops", type=float, default=None)
    p.add_argument("--server-arg", action="append", default=[], help="extra `llmbus up` argument (repeatable)")
    p.add_argument("--server-env", action="append", default=[],
                   help="KEY=VALUE in the server's environment only, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    p.add_argument("--skip-transformers", action="store_true")
    a = p.parse_args()
    exit_on_sigterm()
    a.model_id = a.model_id or default_model_dir()
    dtype = getattr(torch, a.dtype)
    tokenizer = load_tokenizer(a.model_id)
    prompts = [exact_token_prompt(tokenizer, a.prompt_tokens, f"Request {i}:") for i in range(a.requests)]
    warm = [exact_token_prompt(tokenizer, a.prompt_tokens, f"Warm-up {i}:") for i in range(4)]
    print(f"model {a.model_id}, {a.dtype}: {a.requests} requests x {a.prompt_tokens} prompt tokens, "
          f"{a.new_tokens} new tokens; load average {load_average()}", flush=True)

    # This process's OpenMP runtime read its environment when torch was imported: only the server's
    # processes (started below) see these.
    os.environ.update(kv.split("=", 1) for kv in a.server_env)
    ours = llmbus_throughput(a.model_id, a.dtype, prompts, warm, a.new_tokens, a.server_arg)
    print(f"llmbus: {ours['tokens']} tokens in {ours['wall']:.2f} s = {ours['tok_s']:.0f} tok/s "
          f"(median TTFT {ours['ttft'] * 1e3:.0f} ms; startup {ours['startup']:.1f} s)", flush=True)
    peak = a.peak_gflops or peak_gflops(dtype)
    ceiling = peak * 1e9 / flops_per_token(a.model_id)
    print(f"compute roofline: {peak:.0f} GFLOP/s / {flops_per_token(a.model_id) / 1e6:.0f} MFLOP per token "
          f"= {ceiling:.0f} tok/s; llmbus at {ours['tok_s'] / ceiling:.0%} of it")
    if not a.skip_transformers:
        theirs = transformers_throughput(a.model_id, dtype, prompts, a.new_tokens)
        print(f"transformers static batch of {a.requests}: {theirs['tokens']} tokens in {theirs['wall']:.2f} s "
              f"= {theirs['tok_s']:.0f} tok/s")
        print(f"llmbus / transformers: {ours['tok_s'] / theirs['tok_s']:.2f}x (bar >= 2.5x); "
              f"load average {load_average()}")


if __name__ == "__main__":
    main()
