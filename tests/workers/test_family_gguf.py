"""GGUF files of the native families (written with the ``gguf`` package's writer in llama.cpp's layout:
Qwen3's QK-norm, Qwen3-MoE's stacked experts and router, Phi-3's fused projections, Gemma 2's and 3's norms
stored plus one) load through the same path as a Llama one: the folder made from the file has the config
transformers derives from it, our reader's tensors equal transformers' reading of the file, and the native
model's greedy tokens and logprobs equal transformers' own reading of the file, at TP=1 (and TP=2 for
Qwen3 and Qwen3-MoE), on the mixed batch of ``llmbus.testing.families``.

Each tiny model takes the shapes transformers' GGUF reader can read back: it does not read a qwen3 file's
head width (Qwen3Config's 128 stays), a qwen3moe file's expert width (Qwen3MoeConfig's 768 stays), nor Gemma
3's local RoPE base, window pattern or query scale (Gemma3TextConfig's defaults stay; six layers give one
global layer, and the file's window of 8 tokens is shorter than the prompts)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from llmbus.supervisor.gguf_model import materialize
from llmbus.testing.families import (assert_matches_reference, family_runner, make_prompts, reference, run_family,
                                     run_family_tensor_parallel, save_tiny_family)
from llmbus.testing.gguf_files import transformers_reads_cached, write_gguf
from llmbus.workers.gguf_checkpoint import GGUFCheckpointReader

# family: (config class, GGUF architecture, model_type transformers reads, tiny model's arguments)
FAMILIES = {
    "qwen3": ("Qwen3Config", "qwen3", "qwen3", dict(head_dim=128)),
    "qwen3moe": ("Qwen3MoeConfig", "qwen3moe", "qwen3_moe",
                 dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, head_dim=32)),
    "phi3": ("Phi3Config", "phi3", "phi3", dict(pad_token_id=0)),  # else Phi3Config's 32000, past the vocabulary
    "gemma3": ("Gemma3TextConfig", "gemma3", "gemma3_text", dict(num_hidden_layers=6, sliding_window=8)),
    "gemma2": ("Gemma2Config", "gemma2", "gemma2", dict(sliding_window=8)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_gguf(request, tiny_model_dir, tmp_path_factory):
    """(family, the folder made from the file, the file, prompts, transformers' model and reference)."""
    import transformers

    family = request.param
    config_class, architecture, model_type, arguments = FAMILIES[family]
    hf_dir = tmp_path_factory.mktemp(f"{family}-hf")
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_tiny_family(str(hf_dir), config_class, vocab_size=vocab_size, **arguments)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the writer puts the tokenizer in the file
        shutil.copy(tiny_model_dir / name, hf_dir / name)
    gguf_path = write_gguf(hf_dir, tmp_path_factory.mktemp(f"{family}-gguf") / f"tiny-{family}.gguf", "F32",
                           architecture=architecture)
    with transformers_reads_cached():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                                  dtype=torch.float32)
    assert model.config.model_type == model_type
    # A GGUF-loaded model refuses save_pretrained: its weights and config as a plain folder instead.
    transformers_dir = tmp_path_factory.mktemp(f"{family}-as-transformers-reads-it")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (transformers_dir / "config.json").write_text(json.dumps(config))
    weights = {name: t.contiguous() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}  # Gemma 3's is tied
    save_file(weights, str(transformers_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = make_prompts(vocab_size)
    folder = materialize(gguf_path, cache_root=tmp_path_factory.mktemp("gguf-cache"))
    return family, str(folder), gguf_path, prompts, model, reference(str(transformers_dir), prompts)


def test_config_is_what_transformers_reads(family_gguf):
    family, folder, _, _, model, _ = family_gguf
    ours = json.loads(open(f"{folder}/config.json").read())
    theirs = json.loads(json.dumps(model.config.to_dict()))  # as config.json has it (string keys)
    theirs.pop("quantization_config"), theirs.pop("architectures")
    ours.pop("architectures")
    # _name_or_path: the folder transformers read the file from
    assert ({k: v for k, v in ours.items() if k not in ("dtype", "_name_or_path")}
            == {k: v for k, v in theirs.items() if k not in ("dtype", "_name_or_path")})


def test_reader_tensors_are_what_transformers_reads(family_gguf):
    """Every tensor transformers loads from the file, read by our reader under the name the native model
    loads: Qwen3-MoE's experts from transformers' fused ``[experts, 2 * width, hidden]`` gate/up stack."""
    family, _, gguf_path, _, model, _ = family_gguf
    with GGUFCheckpointReader(gguf_path) as reader:
        for name, theirs in model.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                for e, fused in enumerate(theirs):
                    gate, up = fused.chunk(2)
                    assert torch.equal(reader.read(f"{prefix}{e}.gate_proj.weight"), gate)
                    assert torch.equal(reader.read(f"{prefix}{e}.up_proj.weight"), up)
            elif name.endswith("mlp.experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                for e, down in enumerate(theirs):
                    assert torch.equal(reader.read(f"{prefix}{e}.down_proj.weight"), down)
            elif name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            else:
                assert torch.equal(reader.read(name), theirs), name


def test_gguf_serves_as_transformers_reads_it(family_gguf):
    family, folder, _, prompts, _, ref = family_gguf
    runner = family_runner(folder)
    if family in ("qwen3", "qwen3moe", "gemma3"):
        assert runner.model.layers[0].attention.q_norm is not None
    assert_matches_reference(ref, prompts, run_family(runner, prompts))


def test_gguf_tensor_parallel_2(family_gguf, tmp_path):
    family, folder, _, prompts, _, ref = family_gguf
    if family not in ("qwen3", "qwen3moe"):
        pytest.skip("TP=2 of the dense families' GGUF reading is the same slicing as Qwen3's")
    assert_matches_reference(ref, prompts, run_family_tensor_parallel(folder, prompts, str(tmp_path)))


# family: (config class, GGUF architecture, tiny model's arguments) where the file says what transformers'
# reading leaves at the config class's default: served as llama.cpp reads it, so compared with the checkpoint
# the file was written from
FILE_OVER_DEFAULTS = {
    "qwen3moe-expert-width": ("Qwen3MoeConfig", "qwen3moe",
                              # llama.cpp always renormalizes the top-k (as Qwen3-MoE's own configs ask)
                              dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=32,
                                   norm_topk_prob=True, seed=1)),  # seed 0: margins too thin
    "phi3-partial-rotary": ("Phi3Config", "phi3",  # seed 0: margins too thin
                            dict(pad_token_id=0, partial_rotary_factor=0.5, seed=1)),
    # and the query scale llama.cpp takes from the head width (Gemma3TextConfig's default: 256)
    # the soft caps the file says (transformers' reading keeps Gemma2Config's 50 and 30)
    "gemma2-caps-and-scale": ("Gemma2Config", "gemma2", dict(
        sliding_window=8, head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0)),
    "gemma3-linear-rope": ("Gemma3TextConfig", "gemma3", dict(
        num_hidden_layers=6, sliding_window=8, head_dim=32, query_pre_attn_scalar=32,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


@pytest.mark.parametrize("case", list(FILE_OVER_DEFAULTS))
def test_gguf_serves_what_transformers_reading_drops(case, tiny_model_dir, tmp_path):
    config_class, architecture, arguments = FILE_OVER_DEFAULTS[case]
    hf_dir = tmp_path / "hf"
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_tiny_family(str(hf_dir), config_class, vocab_size=vocab_size, **arguments)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, hf_dir / name)
    gguf_path = write_gguf(hf_dir, tmp_path / f"{case}.gguf", "F32", architecture=architecture)
    folder = materialize(gguf_path, cache_root=tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    if architecture == "qwen3moe":
        assert config["moe_intermediate_size"] == 96
    elif architecture == "phi3":
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    elif architecture == "gemma2":
        assert (config["query_pre_attn_scalar"], config["attn_logit_softcapping"],
                config["final_logit_softcapping"]) == (32, 20.0, 15.0)
    else:
        assert config["rope_parameters"]["full_attention"]["factor"] == 8.0
        assert "factor" not in config["rope_parameters"]["sliding_attention"]
        assert config["query_pre_attn_scalar"] == 32
    prompts = make_prompts(vocab_size)
    assert_matches_reference(reference(str(hf_dir), prompts), prompts, run_family(family_runner(str(folder)), prompts))


def test_layouts_without_a_reference_are_refused(tiny_model_dir, tmp_path):
    """llama.cpp's Mixtral (a llama file with stacked experts) and Phi-3's LongRoPE factors: transformers'
    reader does not read them, so they are refused in one line, before anything starts."""
    from llmbus.workers.gguf_checkpoint import GGUFError

    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    cases = {"llama": ("Qwen3Config", {"blk.0.ffn_gate_exps.weight": np.zeros((4, 128, 64), np.float32)},
                       "routed experts"),
             "phi3": ("Phi3Config", {"rope_factors_long.weight": np.ones(8, np.float32)}, "longrope")}
    for architecture, (config_class, extra, message) in cases.items():
        hf_dir = tmp_path / architecture
        save_tiny_family(str(hf_dir), config_class, vocab_size=vocab_size, head_dim=16, pad_token_id=0)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / name, hf_dir / name)
        gguf_path = write_gguf(hf_dir, tmp_path / f"{architecture}.gguf", "F32", architecture=architecture,
                               extra_tensors=extra)
        with pytest.raises(GGUFError, match=message):
            materialize(gguf_path, cache_root=tmp_path / "cache")


@pytest.mark.parametrize("kind", ("Q8_0", "Q4_1"))
def test_stacked_experts_read_one_expert_at_a_time_quantized(kind, tiny_model_dir, tmp_path):
    """A quantized qwen3moe file's stacked experts: each expert's matrix, its TP row and column slices and its
    kept raw blocks are that expert's part of the whole stack as the ``gguf`` package dequantizes it."""
    import gguf

    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_tiny_family(str(tmp_path / "hf"), "Qwen3MoeConfig", vocab_size=vocab_size, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=96, head_dim=32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / "hf" / name)
    path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", kind, architecture="qwen3moe")
    stacks = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors
              if t.name.startswith("blk.1.ffn_") and t.name.endswith("_exps.weight")}
    with GGUFCheckpointReader(path) as reader:
        for e in range(4):
            down = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
            gate = f"model.layers.1.mlp.experts.{e}.gate_proj.weight"
            expected_down = torch.from_numpy(stacks["blk.1.ffn_down_exps.weight"][e].astype(np.float32))
            expected_gate = torch.from_numpy(stacks["blk.1.ffn_gate_exps.weight"][e].astype(np.float32))
            assert reader.shape(down) == [64, 96] and reader.qtype(down) == kind
            assert torch.equal(reader.read(down), expected_down)
            assert torch.equal(reader.read_cols(down, 32, 96), expected_down[:, 32:96])
            assert torch.equal(reader.read_rows(gate, 48, 96), expected_gate[48:96])
            kept = reader.read_quantized(down, cols=(32, 96))
            assert kept.shape == (64, 64)
            torch.testing.assert_close(kept.dequantize(), expected_down[:, 32:96], rtol=0, atol=1e-6)
            kept = reader.read_quantized(gate, rows=(48, 96))
            torch.testing.assert_close(kept.dequantize(), expected_gate[48:96], rtol=0, atol=1e-6)
