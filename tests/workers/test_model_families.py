"""The native decoder serving Llama, Mistral (sliding window) and Qwen2 (q/k/v biases, per-layer windows),
token-exact against transformers at TP=1 and TP=2.

Each family is a tiny checkpoint with seeded random weights (wide normal, biases included, see
``llmbus.testing.runner_driver.widen_weights``) run through the mixed continuous batch of that module:
prompts of 1 to 40 tokens, arrivals mid-way, a chunked prefill beside decodes. The windows (8 and 10
tokens) are much shorter than the longer prompts and generations, and the windowed families also check
that transformers' output with the window switched off differs, so an ignored window cannot pass.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from llmbus.testing.runner_driver import (BLOCK_SIZE, MAX_NEW_TOKENS, NUM_BLOCKS, PROMPT_LENGTHS, Reference, Request,
                                          drive, drive_tensor_parallel, make_prompts, mixed_requests, reference,
                                          widen_weights)
from llmbus.workers.model_runner import ModelRunner
from llmbus.workers.models.llama import DecoderConfig

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (transformers config class, its arguments, from_pretrained overrides that switch windows off)
FAMILIES = {
    # Llama with every optional bias: the row-parallel o_proj/down_proj biases are added after the reduce.
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, vocab_size=509, attention_bias=True, mlp_bias=True),
              None),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, vocab_size=512, sliding_window=10),
                dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, vocab_size=509), None),
    # Windowed layers that max_window_layers cannot describe: only layer_types says which.
    "qwen2_layer_types": ("Qwen2Config",
                          dict(num_hidden_layers=3, vocab_size=512, use_sliding_window=True, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                          dict(use_sliding_window=False, layer_types=["full_attention"] * 3)),
}


@dataclass
class Family:
    name: str
    path: str
    prompts: list[list[int]]
    reference: Reference
    unwindowed: Reference | None  # the same weights with every window switched off, for windowed families
    runner: ModelRunner


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    import transformers

    config_class, arguments, full_attention = FAMILIES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPE, **arguments)
    model = transformers.AutoModelForCausalLM.from_config(config)
    widen_weights(model)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    prompts = make_prompts(config.vocab_size)
    unwindowed = reference(path, prompts, check_margins=False, **full_attention) if full_attention else None
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
    runner.warmup()
    return Family(request.param, path, prompts, reference(path, prompts), unwindowed, runner)


def _assert_matches(ref: Reference, prompts, results: dict[str, tuple[list[int], list[float]]]) -> None:
    for i, prompt in enumerate(prompts):
        tokens, logprobs = results[f"r{i}"]
        assert tokens == ref.tokens[i], f"prompt {i} (length {len(prompt)})"
        torch.testing.assert_close(torch.tensor(logprobs), ref.greedy_logprobs(i), rtol=0, atol=1e-4)


def test_windows_are_read_as_transformers_reads_them(family):
    import transformers

    with open(os.path.join(family.path, "config.json")) as f:
        windows = DecoderConfig.from_hf(json.load(f)).sliding_windows
    model = transformers.AutoModelForCausalLM.from_pretrained(family.path)
    # Qwen2 keeps a window per attention module; Mistral reads config.sliding_window in every layer.
    expected = tuple(getattr(layer.self_attn, "sliding_window", getattr(model.config, "sliding_window", None))
                     for layer in model.model.layers)
    assert windows == expected
    if family.unwindowed is None:
        assert set(windows) == {None}
        return
    assert max(PROMPT_LENGTHS) + MAX_NEW_TOKENS > 3 * max(w for w in windows if w is not None)
    assert family.unwindowed.tokens != family.reference.tokens, "the window does not change transformers' output"


def test_greedy_and_logprobs_match_transformers(family):
    results = drive(family.runner, mixed_requests(family.prompts))
    _assert_matches(family.reference, family.prompts,
                    {rid: (r.tokens, r.logprobs) for rid, r in results.items()})
    # One prompt at a time too: a lone sequence runs without padding in its group.
    solo = {f"r{i}": drive(family.runner, [Request(rid=f"r{i}", prompt=p)])[f"r{i}"]
            for i, p in enumerate(family.prompts)}
    _assert_matches(family.reference, family.prompts, {rid: (r.tokens, r.logprobs) for rid, r in solo.items()})


def test_tensor_parallel_2_matches_transformers(family, tmp_path):
    # Two ranks for the families whose split differs: Llama's every optional bias (o_proj's and down_proj's added
    # after the reduce) and Qwen2's q/k/v biases split with the heads, beside windowed and full layers. qwen2 is
    # the same Qwen2 model and biases without windows, and mistral's window is qwen2_layer_types' windowed layers'
    # (each rank's heads windowed alike); their TP=1 runs read their configs (as test_family_gguf skips likewise).
    if family.name in ("qwen2", "mistral"):
        pytest.skip("TP=2 splits it as qwen2_layer_types (Qwen2's biases, a sliding window on the ranks' heads)")
    results = drive_tensor_parallel(family.path, {"mixed": mixed_requests(family.prompts)}, str(tmp_path))
    _assert_matches(family.reference, family.prompts, results["mixed"])


@pytest.mark.parametrize("arguments", [
    dict(),
    dict(use_sliding_window=False, sliding_window=4096, max_window_layers=1),  # most Qwen2 hub configs
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=3),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=28),
    dict(use_sliding_window=True, max_window_layers=2),  # no sliding_window key: Qwen2Config's default
])
def test_qwen2_legacy_window_keys_follow_transformers(arguments):
    # Configs written before layer_types existed: the window comes from use_sliding_window and
    # max_window_layers, as Qwen2Config derives layer_types from them.
    import transformers

    config = transformers.Qwen2Config(num_hidden_layers=5, **arguments)
    expected = tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)
    hf = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 5, "num_attention_heads": 2, **arguments}
    assert DecoderConfig.from_hf(hf).sliding_windows == expected


@pytest.mark.parametrize("arguments", [dict(sliding_window=None), dict(sliding_window=64), dict()])
def test_mistral_window_keys_follow_transformers(arguments):
    # null is full attention; a config.json without the key gets MistralConfig's default window.
    import transformers

    expected = transformers.MistralConfig(**arguments).sliding_window
    hf = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, **arguments}
    assert DecoderConfig.from_hf(hf).sliding_windows == (expected, expected)
