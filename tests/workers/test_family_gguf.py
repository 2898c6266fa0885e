"""A Qwen3 GGUF file (written with the ``gguf`` package's writer, llama.cpp's tensor names, QK-norm
included) loads through the same path as a Llama one: the folder made from it names model_type qwen3,
the native model reads its tensors, and its greedy tokens and logprobs equal transformers' own reading of
the file, at TP=1 and TP=2, on the mixed batch of ``llmbus.testing.families``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from llmbus.supervisor.gguf_model import materialize
from llmbus.testing.families import (assert_matches_reference, family_runner, make_prompts, reference, run_family,
                                     run_family_tensor_parallel, save_tiny_family)
from llmbus.testing.gguf_files import transformers_reads_cached, write_gguf


@pytest.fixture(scope="module")
def qwen3_gguf(tiny_model_dir, tmp_path_factory):
    """(the folder made from the file, prompts, transformers' reference from the file)."""
    import transformers

    hf_dir = tmp_path_factory.mktemp("qwen3-hf")
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    # transformers' GGUF reader does not read the head width of a qwen3 file: Qwen3Config's default, 128
    save_tiny_family(str(hf_dir), "Qwen3Config", vocab_size=vocab_size, head_dim=128)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the writer puts the tokenizer in the file
        shutil.copy(tiny_model_dir / name, hf_dir / name)
    gguf_path = write_gguf(hf_dir, tmp_path_factory.mktemp("qwen3-gguf") / "tiny-qwen3.gguf", "F32",
                           architecture="qwen3")
    with transformers_reads_cached():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                                  dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: its weights and config as a plain folder instead.
    transformers_dir = tmp_path_factory.mktemp("qwen3-as-transformers-reads-it")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (transformers_dir / "config.json").write_text(json.dumps(config))
    weights = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(weights, str(transformers_dir / "model.safetensors"), metadata={"format": "pt"})
    assert model.config.model_type == "qwen3" and any("q_norm" in n for n, _ in model.named_parameters())
    prompts = make_prompts(vocab_size)
    folder = materialize(gguf_path, cache_root=tmp_path_factory.mktemp("gguf-cache"))
    return str(folder), prompts, reference(str(transformers_dir), prompts)


def test_qwen3_gguf_serves_as_transformers_reads_it(qwen3_gguf):
    folder, prompts, ref = qwen3_gguf
    assert json.loads(open(f"{folder}/config.json").read())["model_type"] == "qwen3"
    runner = family_runner(folder)
    assert runner.model.layers[0].attention.q_norm is not None
    assert_matches_reference(ref, prompts, run_family(runner, prompts))


def test_qwen3_gguf_tensor_parallel_2(qwen3_gguf, tmp_path):
    folder, prompts, ref = qwen3_gguf
    assert_matches_reference(ref, prompts, run_family_tensor_parallel(folder, prompts, str(tmp_path)))
