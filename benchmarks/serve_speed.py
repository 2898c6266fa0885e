"""Startup, single-stream and 16-concurrent throughput of `llmbus up`, beside transformers in the same run.

    python benchmarks/serve_speed.py [--model-id DIR] [--new-tokens 128] [--concurrency 16] [--server-env K=V]

Prints absolute numbers and ratios against transformers `generate` (batch 1, same checkpoint and dtype),
measured in this run: machines are noisy, ratios are what to compare across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from _server import READY_TIMEOUT_S, default_model_dir

from llmbus.testing import Server

PROMPT = "The history of the city begins with a small settlement on the river, where " * 8


def stream_timed(url: str, prompt: str, new_tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds to first token, seconds from first to last token) of one streaming request."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}
    req = urllib.request.Request(f"{url}/generate_stream", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: "):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    return n, first - t0, last - first


def transformers_batch1(model_dir: str, dtype: str, prompt: str, new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        dt = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) / dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-id", default=None, help="default: the demo `small` model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--server-env", action="append", default=[],
                   help="KEY=VALUE in the server's environment only, e.g. OMP_WAIT_POLICY=PASSIVE (repeatable)")
    a = p.parse_args()
    a.model_id = a.model_id or default_model_dir()  # built before timing startup

    server_env = dict(kv.split("=", 1) for kv in a.server_env)  # transformers' side keeps the defaults
    t0 = time.perf_counter()
    srv = Server(["--model-id", a.model_id, "--dtype", a.dtype], env=server_env, ready_timeout=READY_TIMEOUT_S)
    startup = time.perf_counter() - t0
    try:
        stream_timed(srv.url, PROMPT, 8)  # warm-up
        n, ttft, decode = stream_timed(srv.url, PROMPT, a.new_tokens)
        single = (n - 1) / decode
        t1 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            results = list(pool.map(lambda i: stream_timed(srv.url, PROMPT + str(i), a.new_tokens),
                                    range(a.concurrency)))
        wall = time.perf_counter() - t1
        total = sum(r[0] for r in results)
    finally:
        srv.stop()
    base = transformers_batch1(a.model_id, a.dtype, PROMPT, a.new_tokens)
    print(f"server environment: {server_env or 'inherited'}")
    print(f"model {a.model_id} dtype {a.dtype}, prompt {len(PROMPT)} chars, {a.new_tokens} new tokens")
    print(f"startup to ready:                 {startup:6.1f} s")
    print(f"single request: TTFT              {ttft * 1000:6.0f} ms, decode {single:7.1f} tok/s "
          f"({n} tokens)")
    print(f"{a.concurrency} concurrent:                 {total / wall:7.1f} tok/s generated "
          f"({total} tokens in {wall:.1f} s; median TTFT {statistics.median(r[1] for r in results) * 1000:.0f} ms)")
    print(f"transformers generate, batch 1:   {base:7.1f} tok/s")
    print(f"ratio single/transformers {single / base:.2f}x; {a.concurrency}-concurrent/transformers "
          f"{total / wall / base:.2f}x")


if __name__ == "__main__":
    main()
