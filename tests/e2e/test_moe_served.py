"""Mixtral and Qwen3-MoE served end to end (`llmbus up`, real processes) on CPU in float32, equal to
transformers' greedy output: decode steps go through the fused C layer's routed experts
(decode_layer.c's ``routed_experts``), prompts through the torch block (``models/moe.py``).

Random experts on the demo model's shape and tokenizer; three requests at once, one of them starting with a
prompt already in the prefix cache, and prompts taken in chunks, so the experts see decode rows beside
prompt chunks and rows that route to different experts in one step.
"""

from __future__ import annotations

import pytest

from llmbus.testing import Server
from llmbus.testing.http import metrics, post
from llmbus.testing.served_families import (PROMPTS, alone_then_together, assert_answers_match, family_folder,
                                            greedy_reference)

MAX_NEW = 6
EXPERTS = 4
FAMILIES = {  # transformers config class and what it adds to the demo model's shape
    "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=176,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tiny_model_dir, tmp_path_factory):
    return family_folder(tiny_model_dir, tmp_path_factory.mktemp(request.param), *FAMILIES[request.param])


def test_moe_served_equals_transformers(model_dir):
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--block-size", "16", "--num-blocks", "64",
            "--max-batch-prefill-tokens", "32", "--max-input-tokens", "128", "--max-total-tokens", "256"]
    with Server(args) as server:
        assert server.log_lines("fused_decode=True"), "the decode steps do not go through the fused layer"
        prompt_ids = [[t["id"] for t in post(f"{server.url}/tokenize", {"inputs": p})[2]] for p in PROMPTS]
        expected = greedy_reference(model_dir, prompt_ids, MAX_NEW)
        answers = alone_then_together(server, MAX_NEW)
        assert metrics(server.url)["llmbus_prefix_cache_hit_tokens_total"] >= 32
    assert_answers_match(answers, expected)
