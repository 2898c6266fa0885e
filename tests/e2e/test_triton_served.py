"""`llmbus up --attention-backend triton` served end to end on CPU, its kernels run by Triton's interpreter
(TRITON_INTERPRET=1): the tiny demo Llama, a Mistral with a sliding window and a Qwen2 with windowed and
full layers, in float32, equal to transformers' greedy output.

Each server takes prompts in chunks of 32 tokens (``--max-batch-prefill-tokens``), answers three requests
at once, one of which starts with a prompt already in the prefix cache, so the kernels see decode rows,
chunks over cached blocks and mixed steps through the whole stack. The windows (16 tokens) are shorter than
the prompts. Small on purpose: the interpreter runs every kernel program in Python.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llmbus.testing import Server
from llmbus.testing.greedy import MIN_MARGIN
from llmbus.testing.http import get, metrics, post
from llmbus.testing.runner_driver import widen_weights
from llmbus.testing.tiny_prompts import generate, ids_of

pytest.importorskip("triton", reason="the Triton backend needs triton (its interpreter runs the kernels on CPU)")
pytest.importorskip("llmbus.workers.attention.triton", reason="no Triton backend in this tree")

MAX_NEW = 6
LONG = ("Once upon a time, in a land far away, there lived a curious engineer who built small machines "
        "that counted the stars, sorted the rain and sang to the wind every single morning")
PROMPTS = [LONG, LONG + " until the day the wind sang back", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
FAMILIES = {  # transformers config class and what it adds to the demo model's shape; None: the demo model
    "llama": None,
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tiny_model_dir, tmp_path_factory):
    """The demo model, or a model of another family with its shape and tokenizer and wide random weights."""
    if FAMILIES[request.param] is None:
        return tiny_model_dir
    import transformers

    class_name, extra = FAMILIES[request.param]
    demo = transformers.AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    shape = {k: demo[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "num_hidden_layers", "vocab_size", "max_position_embeddings", "bos_token_id",
                                  "eos_token_id", "pad_token_id", "head_dim")}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**shape, **extra))
    widen_weights(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, path / name)
    return path


def reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of the prompts' token ids (as the server tokenized them: it may
    read a tokenizer another way for another model type, and this test is about attention)."""
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


def test_triton_backend_served_equals_transformers(model_dir):
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--attention-backend", "triton",
            "--block-size", "16", "--num-blocks", "64", "--max-batch-prefill-tokens", "32",
            "--max-input-tokens", "128", "--max-total-tokens", "256"]
    with Server(args, env={"TRITON_INTERPRET": "1"}) as server:
        info = get(f"{server.url}/info")[1]
        assert (info["attention_backend"], info["dtype"], info["devices"]) == ("triton", "float32", ["cpu"])
        prompt_ids = [[t["id"] for t in post(f"{server.url}/tokenize", {"inputs": p})[2]] for p in PROMPTS]
        assert min(len(ids) for ids in prompt_ids[:2]) > 32, "the long prompts take two chunks and outgrow windows"
        expected = reference(model_dir, prompt_ids)
        # the long prompt alone first: its blocks stay in the prefix cache for the second one
        first = ids_of(generate(server, PROMPTS[0], MAX_NEW)[0])
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda p: ids_of(generate(server, p, MAX_NEW)[0]), PROMPTS))
        assert metrics(server.url)["llmbus_prefix_cache_hit_tokens_total"] >= 32
    for got, want in zip([first, *together], [expected[0], *expected]):
        assert got == want[:len(got)] and got, (got, want)  # a shorter answer ended on EOS
