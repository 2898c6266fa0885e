"""Tiny checkpoints of the natively served model families and the checks every family's test runs.

A family's checkpoint is made with transformers' own config class (seeded, widened weights: see
``runner_driver.widen_weights``), saved with ``save_pretrained`` in the layout hub checkpoints have. The
workload is ``runner_driver.mixed_requests`` plus a preemption (resumed from one cached block) and a
request that starts from a prefix-cache hit on another's blocks; ``assert_matches_reference`` compares
every request's greedy tokens and logprobs with transformers' float32 ``generate``.
"""

from __future__ import annotations

import os

import torch
from llmbus.testing.runner_driver import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Reference,
    Request,
    drive,
    drive_tensor_parallel,
    make_prompts,
    mixed_requests,
    reference,
    widen_weights,
)

# The shape every family's tiny checkpoint shares (a family may override any of it).
TINY_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  num_hidden_layers=2, vocab_size=509, max_position_embeddings=256, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)


def save_tiny_family(path: str, config_class: str, *, seed: int = 0, **arguments) -> object:
    """A tiny ``transformers.<config_class>`` model with widened weights drawn from ``seed``, saved in
    ``path``; its config."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY_SHAPE, **arguments})
    model = transformers.AutoModelForCausalLM.from_config(config)
    widen_weights(model)
    with torch.no_grad():  # norm weights other than ones, so a norm whose weight is misread shows
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return config


def requantized_copy(path: str, out: str, method: str, ranks: int = 1) -> str:
    """``path`` with every projection replaced by its ``method`` re-quantization, dequantized, as ``ranks``
    tensor-parallel ranks quantize it (a row-parallel projection's columns one rank's share at a time); the
    embedding and the LM head as int8 (what ``--quantize`` makes them); routers and norms as they are."""
    import shutil

    from llmbus.workers import quant
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    state = load_file(os.path.join(out, "model.safetensors"))
    for name, tensor in state.items():
        if tensor.dim() != 2 or name.endswith(".gate.weight"):
            continue
        if "layers" in name:
            row_parallel = any(part in name for part in ("o_proj", "down_proj", ".w2."))
            shares = tensor.float().chunk(ranks, dim=1) if row_parallel else [tensor.float()]
            state[name] = torch.cat([quant.quantize(s, method).dequantize() for s in shares], dim=1).to(tensor.dtype)
        else:
            state[name] = quant.quantize_int8(tensor.float()).dequantize().to(tensor.dtype)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def tiny_family(path: str, config_class: str, **arguments) -> tuple[str, list[list[int]], Reference]:
    """``save_tiny_family`` in ``path``, then (path, the prompts, transformers' greedy reference of them)."""
    config = save_tiny_family(path, config_class, **arguments)
    prompts = make_prompts(config.vocab_size)
    return path, prompts, reference(path, prompts)


def parametrized_family(request, tmp_path_factory, families: dict[str, tuple[str, dict]]):
    """For a module fixture parametrized over ``families`` (name -> (config class, its arguments)): (name,
    path, prompts, reference) of ``request.param``'s tiny checkpoint."""
    config_class, arguments = families[request.param]
    return request.param, *tiny_family(str(tmp_path_factory.mktemp(request.param)), config_class, **arguments)


def family_runner(path: str, **kwargs):
    """A warmed-up ``ModelRunner`` of ``path`` for ``family_requests`` (``kwargs``: quantize, ...)."""
    from llmbus.workers.model_runner import ModelRunner

    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256, **kwargs)
    runner.warmup()
    return runner


def family_requests(prompts: list[list[int]]) -> list[Request]:
    """``mixed_requests`` with r1 preempted after 5 tokens (resuming from its first block) and a request
    "hit" that starts with r4's first two blocks already computed (a prefix-cache hit)."""
    requests = mixed_requests(prompts)
    requests[1].preempt_after, requests[1].resume_cached_blocks = 5, 1
    lender = requests[4]
    lender.blocks = [NUM_BLOCKS - 1, NUM_BLOCKS - 2]
    requests.append(Request(rid="hit", prompt=prompts[4], arrival_step=9, computed=2 * BLOCK_SIZE,
                            blocks=list(lender.blocks)))
    return requests


def assert_matches_reference(ref: Reference, prompts: list[list[int]],
                             results: dict[str, tuple[list[int], list[float]]], logprob_atol: float = 1e-4) -> None:
    """Every request of ``family_requests`` got transformers' greedy tokens and log-probabilities (to
    ``logprob_atol``: quantized kernels sum in another order than the float reference)."""
    expected = {f"r{i}": i for i in range(len(prompts))} | {"hit": len(prompts) - 1}
    for rid, i in expected.items():
        tokens, logprobs = results[rid]
        assert tokens == ref.tokens[i], f"{rid} (prompt length {len(prompts[i])})"
        torch.testing.assert_close(torch.tensor(logprobs), ref.greedy_logprobs(i), rtol=0, atol=logprob_atol)


def run_family(runner, prompts: list[list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    """``family_requests`` through ``runner`` (a ``ModelRunner``): {rid: (tokens, logprobs)}."""
    results = drive(runner, family_requests(prompts))
    assert results["r1"].preemptions == 1
    return {rid: (r.tokens, r.logprobs) for rid, r in results.items()}


def assert_speculation_matches_reference(runner, prompts: list[list[int]], ref: Reference) -> None:
    """``family_requests`` with 3 guesses a decode step (every third one wrong, ``runner_driver.drive``):
    kept and rejected guesses give transformers' greedy tokens."""
    requests = family_requests(prompts)
    for req in requests:
        req.speculate, req.oracle = 3, ref.tokens[int(req.rid[1:]) if req.rid != "hit" else len(prompts) - 1]
    results = drive(runner, requests)
    for req in requests:
        assert results[req.rid].tokens == req.oracle, req.rid
    assert sum(r.kept_guesses for r in results.values()) > 0


def run_family_tensor_parallel(path: str, prompts: list[list[int]], work_dir: str):
    """``family_requests`` over two gloo ranks: rank 0's {rid: (tokens, logprobs)}."""
    os.makedirs(work_dir, exist_ok=True)
    return drive_tensor_parallel(path, {"family": family_requests(prompts)}, work_dir)["family"]


__all__ = ["TINY_SHAPE", "assert_matches_reference", "assert_speculation_matches_reference", "family_requests",
           "family_runner", "make_prompts", "parametrized_family", "reference", "requantized_copy", "run_family",
           "run_family_tensor_parallel", "save_tiny_family", "tiny_family"]
