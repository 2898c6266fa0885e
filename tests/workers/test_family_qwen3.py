"""Qwen3 dense served natively: QK-norm (an RMSNorm over each query and key head before RoPE) in the torch
layers and in the fused CPU decode layer, at TP=1 and TP=2, and under ``--quantize int8``; token-exact
against transformers in float32 on a mixed batch with a chunked prefill, a preemption and a prefix hit."""

from __future__ import annotations

import pytest

from llmbus.testing.families import (assert_matches_reference, make_prompts, reference, requantized_copy, run_family,
                                     run_family_tensor_parallel, save_tiny_family)
from llmbus.testing.runner_driver import BLOCK_SIZE, NUM_BLOCKS
from llmbus.workers.model_runner import ModelRunner

QWEN3 = dict(head_dim=32)  # wider than hidden / heads, as Qwen3's configs are


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    config = save_tiny_family(path, "Qwen3Config", **QWEN3)
    prompts = make_prompts(config.vocab_size)
    return path, prompts, reference(path, prompts)


def _runner(path: str, **kwargs) -> ModelRunner:
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256, **kwargs)
    runner.warmup()
    return runner


def test_qwen3_matches_transformers_through_fused_and_torch_layers(qwen3):
    path, prompts, ref = qwen3
    runner = _runner(path)
    assert runner.model.layers[0].attention.q_norm is not None
    fused = runner.model.fused_decode
    runner.model.fused_decode = None
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    if fused is None:
        pytest.skip("no C compiler: the fused decode layer is optional")
    ran = []
    fused.run = lambda *args, run=fused.run: ran.append(run(*args)) or ran[-1]
    runner.model.fused_decode = fused
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    assert sum(ran) >= 5, "the fused layer took no step"


def test_qwen3_tensor_parallel_2_matches_transformers(qwen3, tmp_path):
    path, prompts, ref = qwen3
    assert_matches_reference(ref, prompts, run_family_tensor_parallel(path, prompts, str(tmp_path)))


def test_qwen3_int8_matches_transformers_on_requantized_weights(qwen3, tmp_path):
    path, prompts, _ = qwen3
    requantized = requantized_copy(path, str(tmp_path / "int8"), "int8")
    runner = _runner(path, quantize="int8")
    assert "int8" in runner.model.weight_summary
    assert_matches_reference(reference(requantized, prompts), prompts, run_family(runner, prompts),
                             logprob_atol=1e-3)
