"""Mixtral and Qwen3-MoE served end to end (`llmbus up`, real processes) on CPU in float32, equal to
transformers' greedy output: decode steps go through the fused C layer's routed experts
(decode_layer.c's ``routed_experts``), prompts through the torch block (``models/moe.py``).

Random experts with the demo model's shape and tokenizer; three requests at once, one of them starting with a
prompt already in the prefix cache, and prompts taken in chunks, so the experts see decode rows beside
prompt chunks and rows that route to different experts in one step.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llmbus.testing import Server
from llmbus.testing.greedy import MIN_MARGIN
from llmbus.testing.http import metrics, post
from llmbus.testing.runner_driver import widen_weights
from llmbus.testing.tiny_prompts import generate, ids_of

MAX_NEW = 6
LONG = ("Once upon a time, in a land far away, there lived a curious engineer who built small machines "
        "that counted the stars, sorted the rain and sang to the wind every single morning")
PROMPTS = [LONG, LONG + " until the day the wind sang back", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
EXPERTS = 4
FAMILIES = {  # transformers config class and what it adds to the demo model's shape
    "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=False,
                                         mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tiny_model_dir, tmp_path_factory):
    import transformers

    class_name, extra = FAMILIES[request.param]
    demo = transformers.AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    shape = {k: demo[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                                  "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
                                  "pad_token_id", "head_dim")}
    width = {"intermediate_size": demo["intermediate_size"]}
    if request.param == "qwen3_moe":
        width["moe_intermediate_size"] = demo["intermediate_size"] // 2
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**shape, **width,
                                                                                            **extra))
    widen_weights(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, path / name)
    return path


def reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of the prompts' token ids, each step's margin decisive."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
        for scores in gen.scores:
            top2 = torch.topk(scores[0].float(), 2).values
            assert top2[0] - top2[1] > MIN_MARGIN, "reference margin not decisive: pick another seed"
        out.append(gen.sequences[0, ids.shape[1]:].tolist())
    return out


def test_moe_served_equals_transformers(model_dir):
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--block-size", "16", "--num-blocks", "64",
            "--max-batch-prefill-tokens", "32", "--max-input-tokens", "128", "--max-total-tokens", "256"]
    with Server(args) as server:
        assert server.log_lines("fused_decode=True"), "the decode steps do not go through the fused layer"
        prompt_ids = [[t["id"] for t in post(f"{server.url}/tokenize", {"inputs": p})[2]] for p in PROMPTS]
        expected = reference(model_dir, prompt_ids)
        first = ids_of(generate(server, PROMPTS[0], MAX_NEW)[0])
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda p: ids_of(generate(server, p, MAX_NEW)[0]), PROMPTS))
        assert metrics(server.url)["llmbus_prefix_cache_hit_tokens_total"] >= 32
    for got, want in zip([first, *together], [expected[0], *expected]):
        assert got == want[:len(got)] and got, (got, want)  # a shorter answer ended on EOS
