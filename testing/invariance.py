"""Batch invariance (issue #35 part 4): the same requests alone and under every disturbance a server puts
them through, on SmolLM2-135M-Instruct, compared token for token.

A request's tokens must not depend on what shares its steps, how its prompt was chunked, whether its
prefix came from the cache, whether it was preempted and recomputed, or whether speculation verified its
tokens several at a time. The ``targets`` (8 chat prompts, each greedy and seeded: seeded draws are a
function of the seed and the position only, ``workers/sampling.py``) run alone, one at a time, and then in
each of ``VARIANTS``, driven through a ``ModelRunner`` by ``runner_driver.drive``; ``mismatches`` names
every request whose tokens differ and where they first do.

Each variant changes one thing, so a failure points at one cause:

- ``crowd``: among 63 other random requests (arrivals mid-way, chunked prompts beside decodes, steps of
  up to ~80 rows, prompt rows and decode rows of other requests in the same step);
- ``prefix_hit``: after the same prompt ran once, its full blocks come from the cache and only the rest
  of the prompt is computed;
- ``chunked``: the prompt in chunks of ``CHUNK`` tokens (``--max-batch-prefill-tokens 16``);
- ``speculate``: ``SPECULATE`` guesses per decode, from the request's own tokens alone with every third one
  wrong (so steps keep some and reject others), verified as one-token rows of one sequence;
- ``preempted``: dropped halfway and recomputed from its prompt and generated tokens (one prompt step);
- ``beside_long_context``: its prompt in the same step as a request with a context of 1760 tokens;
- ``beside_adapters``: among 8 requests on a LoRA adapter (their rows add the adapter's deltas).

Alone, every target runs by itself; in a variant the 16 run together in one continuous batch (a server's
case, and a sixteenth of the steps), or, with ``together=False`` (for finding a cause), each by itself too.

``FORMS`` are the weight forms a CPU serves SmolLM2 in: float32, bfloat16 (a dense bf16 folder, which
``write_bf16_folder`` makes from the package's GGUF), ``--quantize int8`` and the package's own Q4_1 GGUF
served as ``llmbus up`` serves it by default.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import Request, drive

BLOCK_SIZE = 16  # small enough that every prompt has full blocks for a prefix hit
NUM_BLOCKS = 512  # the crowd's peak, with room (float32 K/V: ~46 KB a token)
MAX_NEW_TOKENS = 16
CHUNK = 16
SPECULATE = 4
CROWD = 63
LONG_CONTEXT = 1760  # beside the targets' 632 prompt tokens: a step of 648 tokens x 1760 keys, past 2**20
ADAPTER = "beside"  # beside_adapters' LoRA adapter: a runner the variants run on loads it under this name
ADAPTER_CROWD = 8
EOS = (2, 0)  # SmolLM2's <|im_end|> and <|endoftext|> (not an end here: every request runs its tokens)

# The chat template's default system prompt, so every prompt is 35-55 tokens: 2-3 full blocks for a
# prefix hit, 3-4 chunks of CHUNK.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph for a child who is ten years old.",
    "List three prime numbers.",
    "How do I reverse a list in Python? Show code.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish, German and Italian, and say which is most formal.",
    "Why is the sky blue?",
)
SEEDED_TEMPERATURE = 0.8


@dataclass(frozen=True)
class Form:
    """A weight form: which folder (``"gguf"``, the package's Q4_1 file; ``"bf16"``, its dense bfloat16
    expansion), ``--dtype`` and ``--quantize``."""

    folder: str
    dtype: torch.dtype
    quantize: str | None = None


FORMS = {
    "float32": Form("gguf", torch.float32),  # the GGUF dequantized to float32 (the reference precision)
    "bfloat16": Form("bf16", torch.bfloat16),
    "int8": Form("bf16", torch.bfloat16, "int8"),  # --quantize int8 (on a bf16 folder, as from the Hub)
    "q4_1": Form("gguf", torch.bfloat16),  # `llmbus up`'s default: the GGUF's Q4_1 blocks kept as int4
}


def chat_text(question: str) -> str:
    """SmolLM2's chat prompt for one user turn (what its template renders, with its default system turn)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def chat(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(chat_text(question), add_special_tokens=False).ids


def prompts(tokenizer) -> list[list[int]]:
    return [chat(tokenizer, q) for q in QUESTIONS]


def sampling(mode: str, index: int) -> SamplingParams:
    return (SamplingParams() if mode == "greedy"
            else SamplingParams(do_sample=True, temperature=SEEDED_TEMPERATURE, seed=1000 + index))


MODES = ("greedy", "seeded")


def targets(prompt_ids: list[list[int]], **fields) -> list[Request]:
    """Every prompt greedy and seeded, as Requests named ``"{i}-{mode}"`` with ``fields`` set."""
    return [Request(f"{i}-{mode}", prompt, sampling(mode, i), max_new_tokens=MAX_NEW_TOKENS, **fields)
            for i, prompt in enumerate(prompt_ids) for mode in MODES]


def alone(runner, prompt_ids: list[list[int]]) -> dict[str, Request]:
    """Each target with the runner to itself: one prompt step, then one-row decode steps."""
    return _run(runner, targets(prompt_ids), together=False)


def _run(runner, requests: list[Request], together: bool) -> dict[str, Request]:
    """``requests`` in one continuous batch, or (``together=False``) each with the runner to itself."""
    if together:
        return drive(runner, requests)
    return {req.rid: drive(runner, [req])[req.rid] for req in requests}


# Each variant: (runner, prompts, the targets' results alone, together) -> the targets' results. With
# ``together`` the 16 targets run in one continuous batch (a server's case, and a sixteenth of the steps);
# without, each alone, so that only the variant's own disturbance separates it from ``alone``.


def crowd(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
          together: bool = True) -> dict[str, Request]:
    """The targets among ``CROWD`` random requests in one continuous batch: random prompts of 1-32 tokens,
    arrivals over the first steps, some prompts chunked, greedy and sampled, 1-12 new tokens each.
    (Always together: being together is the variant.)"""
    rng = random.Random(35)
    vocab = runner.vocab_size
    others = []
    for n in range(CROWD):
        length = rng.choice([1, 2, rng.randrange(3, 17), rng.randrange(17, 33)])
        others.append(Request(
            f"other{n}", [rng.randrange(vocab) for _ in range(length)],
            SamplingParams() if rng.random() < 0.5 else SamplingParams(do_sample=True, temperature=1.0,
                                                                       seed=rng.randrange(1 << 30)),
            arrival_step=rng.randrange(8), prefill_chunk=rng.choice([None, None, 8, 24]),
            max_new_tokens=rng.randrange(1, 13)))
    mine = targets(prompt_ids)
    for req in mine:
        req.arrival_step = rng.randrange(6)
    requests = others + mine
    rng.shuffle(requests)  # the targets' rows anywhere in the batch
    out = drive(runner, requests)
    return {req.rid: out[req.rid] for req in mine}


def prefix_hit(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
               together: bool = True) -> dict[str, Request]:
    """Each target after its prompt ran once (all 8 prompts in one step, one token each): its full blocks
    short of the prompt's last token are a cached prefix; the rest of the prompt is computed over them."""
    warm = drive(runner, [Request(f"warm{i}", prompt, max_new_tokens=1) for i, prompt in enumerate(prompt_ids)])
    requests = targets(prompt_ids)
    for req in requests:
        cached = (len(req.prompt) - 1) // runner.block_size
        req.blocks = warm[f"warm{req.rid.split('-')[0]}"].blocks[:cached]
        req.computed = cached * runner.block_size
    return _run(runner, requests, together)


def chunked(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
            together: bool = True) -> dict[str, Request]:
    """Each target's prompt in chunks of ``CHUNK`` tokens (``--max-batch-prefill-tokens 16``)."""
    return _run(runner, targets(prompt_ids, prefill_chunk=CHUNK), together)


def speculate(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
              together: bool = True) -> dict[str, Request]:
    """Each target with ``SPECULATE`` guesses a decode, read from its own tokens alone, every third wrong."""
    requests = targets(prompt_ids, speculate=SPECULATE)
    for req in requests:
        req.oracle = expected[req.rid].tokens
    return _run(runner, requests, together)


def preempted(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
              together: bool = True) -> dict[str, Request]:
    """Each target dropped after half its tokens and recomputed from scratch (prompt and generated tokens
    in one prompt step), as a preemption by a full KV pool does."""
    return _run(runner, targets(prompt_ids, preempt_after=MAX_NEW_TOKENS // 2), together)


def beside_long_context(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
                        together: bool = True) -> dict[str, Request]:
    """The targets' prompts in the step of a request with ``LONG_CONTEXT`` tokens of context (a cached
    prefix, whatever its blocks hold, and 16 new tokens): a step whose tokens times its longest context
    passed the CPU backend's former budget for kernel rows (2^20 scores; such a step took the torch path, where
    alone each prompt is kernel rows). (The long request's own tokens are not compared.)"""
    rng = random.Random(36)
    cached = LONG_CONTEXT // runner.block_size - 1
    long = Request("long", [rng.randrange(runner.vocab_size) for _ in range(LONG_CONTEXT)], max_new_tokens=1,
                   blocks=list(range(runner.num_blocks - cached, runner.num_blocks)),
                   computed=cached * runner.block_size)
    requests = targets(prompt_ids)
    if together:
        out = drive(runner, [long, *requests])
        return {req.rid: out[req.rid] for req in requests}
    return {req.rid: drive(runner, [long, req])[req.rid] for req in requests}


def beside_adapters(runner, prompt_ids: list[list[int]], expected: dict[str, Request],
                    together: bool = True) -> dict[str, Request]:
    """The targets (on the base model) in one continuous batch with ``ADAPTER_CROWD`` random requests on the LoRA
    adapter ``ADAPTER`` (which the runner must have loaded), arriving over the first steps: steps whose other rows
    add an adapter's deltas. (Always together: being together is the variant.)"""
    rng = random.Random(37)
    others = [Request(f"lora{n}", [rng.randrange(runner.vocab_size) for _ in range(rng.randrange(1, 33))],
                      arrival_step=rng.randrange(8), max_new_tokens=rng.randrange(1, 13), adapter=ADAPTER)
              for n in range(ADAPTER_CROWD)]
    mine = targets(prompt_ids)
    requests = others + mine
    rng.shuffle(requests)
    out = drive(runner, requests)
    return {req.rid: out[req.rid] for req in mine}


VARIANTS = {"crowd": crowd, "prefix_hit": prefix_hit, "chunked": chunked, "speculate": speculate,
            "preempted": preempted, "beside_long_context": beside_long_context, "beside_adapters": beside_adapters}


def mismatches(expected: dict[str, Request], got: dict[str, Request]) -> dict[str, int]:
    """``{rid: first position where got's tokens differ from expected's}`` of every request that differs."""
    out = {}
    for rid, want in expected.items():
        theirs = got[rid].tokens
        if theirs != want.tokens:
            out[rid] = next((i for i, (a, b) in enumerate(zip(want.tokens, theirs)) if a != b),
                            min(len(want.tokens), len(theirs)))
    return out


def logprob_drift(expected: dict[str, Request], got: dict[str, Request]) -> float:
    """The largest difference between the sampled tokens' logprobs, over the positions before any token
    differs: 0.0 when every step computed bitwise the same distribution (the tokens then match whatever
    the prompts), above 0 when the arithmetic differs but no token flipped (yet)."""
    drift = 0.0
    for rid, want in expected.items():
        theirs = got[rid]
        for a, b, x, y in zip(want.tokens, theirs.tokens, want.logprobs, theirs.logprobs):
            if a != b:
                break
            drift = max(drift, abs(x - y))
    return drift


def write_bf16_folder(gguf_folder: Path, out: Path) -> Path:
    """A Hugging Face folder of ``gguf_folder``'s GGUF (``supervisor.gguf_model.materialize``'s output)
    dequantized and stored as bfloat16 safetensors: a dense bf16 checkpoint of the same model. Written once."""
    from safetensors.torch import save_file

    from llmbus.bus.model_files import gguf_source
    from llmbus.workers.gguf_checkpoint import GGUFCheckpointReader

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with GGUFCheckpointReader(gguf_source(str(gguf_folder))["path"]) as reader:
        state = {name: reader.read(name).to(torch.bfloat16).contiguous() for name in reader.names()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (gguf_folder / name).is_file():
            shutil.copy(gguf_folder / name, tmp / name)
    config = json.loads((gguf_folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out
