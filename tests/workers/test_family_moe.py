"""Mixtral and Qwen3-MoE served natively: top-k routed experts as grouped matmuls (``models/moe.py``),
each expert's intermediate dimension split over TP ranks. Token-exact against transformers in float32 at
TP=1 and TP=2 on a mixed batch with a chunked prefill, a preemption and a prefix hit; the MoE block itself
against transformers' on a batch where every expert gets tokens and one where some get none; Mixtral under
``--quantize int8`` against transformers on the re-quantized weights. Decode steps of one rank go through
the fused decode layer's routed experts (decode_layer.c); in bf16 every step does, bitwise batch-invariant."""

from __future__ import annotations

import pytest
import torch
from llmbus.testing.families import (assert_matches_reference, assert_speculation_matches_reference, family_runner,
                                     parametrized_family, reference, requantized_copy, run_family,
                                     run_family_tensor_parallel)
from llmbus.workers.models.moe import SparseMoE

NUM_EXPERTS = 4
FAMILIES = {
    # Mixtral renormalises the kept top-2 probabilities.
    "mixtral": ("MixtralConfig", dict(num_local_experts=NUM_EXPERTS, num_experts_per_tok=2, sliding_window=None)),
    # Qwen3-MoE does not (norm_topk_prob=False), has QK-norm, and its second layer is a dense MLP.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=NUM_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return parametrized_family(request, tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def runner(family):
    return family_runner(family[1])


def test_moe_matches_transformers(family, runner):
    name, _, prompts, ref = family
    kinds = [type(layer.mlp).__name__ for layer in runner.model.layers]
    assert kinds == (["SparseMoE", "LlamaMLP"] if name == "qwen3_moe" else ["SparseMoE", "SparseMoE"])
    assert runner.model.fused_decode is not None  # decode steps through decode_layer.c's routed experts
    assert_matches_reference(ref, prompts, run_family(runner, prompts))


def test_speculative_rows_match_transformers(family, runner):
    _, _, prompts, ref = family
    assert_speculation_matches_reference(runner, prompts, ref)


def test_moe_tensor_parallel_2_matches_transformers(family, tmp_path):
    _, path, prompts, ref = family
    assert_matches_reference(ref, prompts, run_family_tensor_parallel(path, prompts, str(tmp_path)))


@pytest.mark.parametrize("num_tokens", [64, 1])
def test_moe_block_equals_transformers_with_busy_and_idle_experts(family, runner, num_tokens):
    """64 tokens reach every expert; one token (top-2 of 4) leaves two experts without any."""
    import transformers

    _, path, _, _ = family
    ours = runner.model.layers[0].mlp
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0].mlp
    hidden = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    used = torch.unique(ours.route(hidden)[1]).numel()
    assert used == NUM_EXPERTS if num_tokens > 1 else used == 2
    with torch.no_grad():
        expected = theirs(hidden[None])[0]
    torch.testing.assert_close(ours(hidden), expected, rtol=1e-5, atol=1e-5)


def test_moe_int8_matches_transformers_on_requantized_weights(family, tmp_path):
    _, path, prompts, _ = family
    runner = family_runner(path, quantize="int8")
    assert isinstance(runner.model.layers[0].mlp, SparseMoE) and "int8" in runner.model.weight_summary
    requantized = requantized_copy(path, str(tmp_path / "int8"), "int8")
    assert_matches_reference(reference(requantized, prompts), prompts, run_family(runner, prompts),
                             logprob_atol=1e-3)


def test_moe_rows_compute_the_same_bits_in_any_batch_through_the_tiled_layer(family):
    """bf16 weights where the tiled kernel runs: every step (prompts too) goes through decode_layer.c's routed
    experts, whose per-row arithmetic does not depend on the rows beside it. Each request of the mixed batch
    (chunked prompt, prefix hit, preemption) gets bitwise the logprobs it gets alone."""
    from llmbus.testing.runner_driver import Request, drive
    from llmbus.workers.kernels import bindings

    library = bindings.library()
    if library is None or not library.tiled_kernel_isa():
        pytest.skip("no tiled kernel on this CPU: bf16 runs torch's arithmetic")
    _, path, prompts, _ = family
    runner = family_runner(path, dtype=torch.bfloat16)
    assert runner.model.fused_decode is not None and runner.model.fused_decode.invariance_gap is None
    together = run_family(runner, prompts)
    for i, prompt in enumerate(prompts):
        alone = drive(runner, [Request(rid="alone", prompt=prompt)])["alone"]
        assert (alone.tokens, alone.logprobs) == together[f"r{i}"], i
