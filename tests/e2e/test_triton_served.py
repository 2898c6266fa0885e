"""`llmbus up --attention-backend triton` served end to end on CPU, its kernels run by Triton's interpreter
(TRITON_INTERPRET=1): a Qwen2 with windowed and full layers (and the biases of its QKV projection), on the
tiny demo model's shape and tokenizer, in float32, equal to transformers' greedy output. The demo Llama and a
Mistral are left out: their layers are Qwen2's full and windowed layers less the biases (the kernels see the
same steps; the families' own configs are read against transformers in tests/workers/test_model_families.py),
and a served family costs 25-30 s of the suite's interpreter time.

Each server takes prompts in chunks of 32 tokens (``--max-batch-prefill-tokens``), answers three requests
at once, one of which starts with a prompt already in the prefix cache, so the kernels see decode rows,
chunks over cached blocks and mixed steps through the whole stack. The windows (16 tokens) are shorter than
the prompts. Small on purpose: the interpreter runs every kernel program in Python.
"""

from __future__ import annotations

import pytest

from llmbus.testing import Server
from llmbus.testing.http import get, metrics, post
from llmbus.testing.served_families import (PROMPTS, alone_then_together, assert_answers_match, family_folder,
                                            greedy_reference)

pytest.importorskip("triton", reason="the Triton backend needs triton (its interpreter runs the kernels on CPU)")
pytest.importorskip("llmbus.workers.attention.triton", reason="no Triton backend in this tree")

MAX_NEW = 6
FAMILIES = {  # transformers config class and what it adds to the demo model's shape
    # layers 0-1 full, 2-3 windowed: both kinds of attention in one served model
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tiny_model_dir, tmp_path_factory):
    """A model of another family with the demo model's shape and tokenizer and wide random weights."""
    return family_folder(tiny_model_dir, tmp_path_factory.mktemp(request.param), *FAMILIES[request.param])


def test_triton_backend_served_equals_transformers(model_dir):
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--attention-backend", "triton",
            "--block-size", "16", "--num-blocks", "64", "--max-batch-prefill-tokens", "32",
            "--max-input-tokens", "128", "--max-total-tokens", "256"]
    with Server(args, env={"TRITON_INTERPRET": "1"}) as server:
        info = get(f"{server.url}/info")[1]
        assert (info["attention_backend"], info["dtype"], info["devices"]) == ("triton", "float32", ["cpu"])
        prompt_ids = [[t["id"] for t in post(f"{server.url}/tokenize", {"inputs": p})[2]] for p in PROMPTS]
        assert min(len(ids) for ids in prompt_ids[:2]) > 32, "the long prompts take two chunks and outgrow windows"
        expected = greedy_reference(model_dir, prompt_ids, MAX_NEW)
        answers = alone_then_together(server, MAX_NEW)
        assert metrics(server.url)["llmbus_prefix_cache_hit_tokens_total"] >= 32
    assert_answers_match(answers, expected)
