"""What a LoRA adapter costs a served request: decode tokens/s of requests on an adapter against the base
model's, on one `llmbus up --lora-adapters` (the same server, the same run, rounds interleaved).

    python benchmarks/lora_cost.py [--model-id DIR] [--dtype float32] [--rank 16] [--new-tokens 64]
                                   [--rounds 3] [--concurrency 1,8]

- The adapter is PEFT's, on every projection (q, k, v, o, gate, up, down) at rank ``--rank``, with random
  ``lora_B`` (``llmbus.testing.lora.save_lora_adapter``); its values do not change the cost.
- At each concurrency ``c`` a round runs ``c`` streams of the base model, then ``c`` on the adapter, then
  ``c`` mixed (every other stream on the adapter), each ``--new-tokens`` long past a 32-token prompt
  (``ignore_eos_token``); decode tokens/s is the tokens after each stream's first over the time from the
  first first-token to the last token. The ratios are adapter/base and mixed/base, medians over rounds.
- Default model: SmolLM2-135M-Instruct's dense float32 folder (``_smollm2.dense_folder``), else
  ``--model-id``.

What it says: on CPU the fused decode layer adds an adapter row's deltas beside the base projections
(decode_layer.c's lora_add), so the ratio is the deltas' cost (their float32 matrices, two barriers a
projection); on CUDA the adapters' Triton kernels inside the graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

from _server import READY_TIMEOUT_S, client_session, exact_token_prompt, exit_on_sigterm, load_tokenizer, \
    stream_tokens

from llmbus.bus.procfs import load_average
from llmbus.testing import Server
from llmbus.testing.lora import save_lora_adapter

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = "bench"


async def decode_rate(url: str, prompts: list[str], adapters: list[str], new_tokens: int) -> float:
    """Decode tokens/s of streams run together, each on its adapter ("" the base model)."""
    async with client_session() as session:
        streams = await asyncio.gather(*(
            stream_tokens(session, url, prompt, {"max_new_tokens": new_tokens, "ignore_eos_token": True,
                                                 **({"adapter_id": adapter} if adapter else {})})
            for prompt, adapter in zip(prompts, adapters)))
    for s in streams:
        if s.error or len(s.times) != new_tokens:
            raise RuntimeError(f"request failed: {s.error or f'{len(s.times)} tokens'}")
    start, end = min(s.times[0] for s in streams), max(s.times[-1] for s in streams)
    return sum(len(s.times) - 1 for s in streams) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    a = parser.parse_args()
    exit_on_sigterm()
    if a.model_id is None:
        from _smollm2 import dense_folder

        a.model_id = str(dense_folder("float32"))
    tokenizer = load_tokenizer(a.model_id)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = save_lora_adapter(a.model_id, f"{tmp}/adapter", MODULES, r=a.rank, alpha=2 * a.rank)
        with Server(["--model-id", a.model_id, "--dtype", a.dtype, "--lora-adapters", f"{ADAPTER}={adapter_dir}"],
                    ready_timeout=READY_TIMEOUT_S) as server:
            print(f"model {a.model_id} ({a.dtype}), adapter rank {a.rank} on {len(MODULES)} projections, "
                  f"{a.new_tokens} tokens a stream, load average {load_average()}")
            for c in (int(x) for x in a.concurrency.split(",")):
                kinds = {"base": [""] * c, "adapter": [ADAPTER] * c,
                         "mixed": [ADAPTER if i % 2 else "" for i in range(c)]}
                rates: dict[str, list[float]] = {k: [] for k in kinds}
                for r in range(a.rounds + 1):  # the first round warms up and is not counted
                    for kind, adapters in kinds.items():
                        prompts = [exact_token_prompt(tokenizer, 32, f"{kind} {c} {r} {i}") for i in range(c)]
                        rate = asyncio.run(decode_rate(server.url, prompts, adapters, a.new_tokens))
                        if r:
                            rates[kind].append(rate)
                base = statistics.median(rates["base"])
                print(f"c={c}: base {base:.1f} tok/s; "
                      + "; ".join(f"{kind} {statistics.median(rates[kind]):.1f} tok/s "
                                  f"({statistics.median(x / y for x, y in zip(rates[kind], rates['base'])):.3f}x)"
                                  for kind in ("adapter", "mixed")))


if __name__ == "__main__":
    main()
