"""TGI's --rope-scaling/--rope-factor through `llmbus up`: a Llama trained (here: configured) for 48 positions
serves prompts of 65 and 74 tokens under linear scaling by 2, its answers equal to transformers' greedy output
on the config the override writes (bus/model_files.py's ``with_rope_override``), alone and three at once."""

from __future__ import annotations

import json
import os

from llmbus.bus.model_files import with_rope_override
from llmbus.testing import Server
from llmbus.testing.http import get, post
from llmbus.testing.served_families import (PROMPTS, alone_then_together, assert_answers_match, family_folder,
                                            greedy_reference)

MAX_NEW = 6
OVERRIDE = ("linear", 2.0)


def test_rope_scaled_model_serves_past_its_trained_length(tiny_model_dir, tmp_path):
    model_dir = family_folder(tiny_model_dir, tmp_path / "llama48", "LlamaConfig", dict(max_position_embeddings=48))
    reference_dir = tmp_path / "overridden"
    reference_dir.mkdir()
    os.symlink(model_dir / "model.safetensors", reference_dir / "model.safetensors")
    config = with_rope_override(json.loads((model_dir / "config.json").read_text()), OVERRIDE)
    (reference_dir / "config.json").write_text(json.dumps(config))
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--rope-scaling", OVERRIDE[0],
            "--rope-factor", str(OVERRIDE[1]), "--max-input-tokens", "90", "--max-total-tokens", "96",
            "--max-batch-prefill-tokens", "32"]
    with Server(args) as server:
        assert get(f"{server.url}/info")[1]["max_total_tokens"] == 96
        prompt_ids = [[t["id"] for t in post(f"{server.url}/tokenize", {"inputs": p})[2]] for p in PROMPTS]
        assert min(len(ids) for ids in prompt_ids[:2]) > 48, "the long prompts run past the trained length"
        expected = greedy_reference(reference_dir, prompt_ids, MAX_NEW)
        answers = alone_then_together(server, MAX_NEW)
    assert_answers_match(answers, expected)
