"""GPTQ, AWQ and FP8 checkpoints (``llmbus.testing.prequantized`` writes them as AutoGPTQ/GPTQModel, AutoAWQ and
the FP8 writers do):
every packed projection reads back as its grid's exact numbers, whole and in tensor-parallel slices, and as
llmbus's int4/int8 form with its own values where that form holds it; a tiny Llama served from each is
token-exact with transformers in float32 on the same numbers, through preemption and a prefix hit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from llmbus.bus.prequantized import checkpoint_quantization
from llmbus.testing.families import (TINY_SHAPE, assert_matches_reference, family_runner, make_prompts, reference,
                                     run_family, save_tiny_family)
from llmbus.testing.prequantized import FLOAT8_WRITERS, write_float8, write_prequantized
from llmbus.workers import quant
from llmbus.workers.loader import CheckpointReader
from llmbus.workers.prequantized_checkpoint import Float8CheckpointReader, PackedCheckpointReader

# name: (method, write_prequantized's arguments, the form read_quantized gives every projection)
FORMATS = {
    "gptq-4bit-g32": ("gptq", dict(), quant.Int4Weight),
    "gptq-v2-per-row": ("gptq", dict(group_size=None, checkpoint_format="gptq_v2"), quant.Int4Weight),
    "gptq-8bit-symmetric": ("gptq", dict(bits=8, symmetric=True), quant.Int8Weight),
    "gptq-8bit": ("gptq", dict(bits=8), None),  # zero points other than 128: no int8 form holds them
    "gptq-act-order": ("gptq", dict(act_order=True), None),  # groups are not runs of inputs
    "awq-g64": ("awq", dict(group_size=64), quant.Int4Weight),
}
PROJECTIONS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
               "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_family(str(path), "LlamaConfig")
    return path


def published(float_llama, tmp_path, name):
    method, arguments, _ = FORMATS[name]
    out, grid_out = tmp_path / name, tmp_path / f"{name}-grid"
    write_prequantized(str(float_llama), str(out), str(grid_out), method, **arguments)
    return out, grid_out


@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_projections_read_as_their_grid(name, float_llama, tmp_path):
    out, grid_out = published(float_llama, tmp_path, name)
    grid = load_file(str(grid_out / "model.safetensors"))
    form = FORMATS[name][2]
    with PackedCheckpointReader(CheckpointReader(str(out)), checkpoint_quantization(out)) as reader:
        assert "model.layers.0.self_attn.q_proj.weight" in reader.names()
        assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in reader.names())
        method, arguments, _ = FORMATS[name]
        assert reader.qtype(PROJECTIONS[0]) == f"{method} int{arguments.get('bits', 4)}"
        assert reader.qtype("model.norm.weight") == "safetensors" and reader.read_quantized("model.norm.weight") is None
        for projection in PROJECTIONS:
            expected = grid[projection].float()
            assert reader.shape(projection) == list(expected.shape)
            assert torch.equal(reader.read(projection), expected)
            assert torch.equal(reader.read_rows(projection, 8, 40), expected[8:40])  # a column-parallel shard
            assert torch.equal(reader.read_cols(projection, 32, 64), expected[:, 32:64])  # a row-parallel one
            # cuts inside a packed word and inside a group
            assert torch.equal(reader.read_rows(projection, 3, 37), expected[3:37])
            assert torch.equal(reader.read_cols(projection, 5, 50), expected[:, 5:50])
            kept = reader.read_quantized(projection, rows=(8, 40))
            if form is None:
                assert kept is None
                continue
            assert isinstance(kept, form) and kept.group == quant.INT4_GROUP
            assert torch.equal(kept.dequantize(), expected[8:40])
            assert torch.equal(reader.read_quantized(projection, cols=(32, 64)).dequantize(), expected[:, 32:64])
            assert torch.equal(reader.read_quantized(projection, rows=(3, 37), cols=(32, 50)).dequantize(),
                               expected[3:37, 32:50])


@pytest.mark.parametrize("name", ["gptq-act-order", "awq-g64"])
def test_served_from_the_packed_checkpoint_equals_transformers(name, float_llama, tmp_path):
    out, grid_out = published(float_llama, tmp_path, name)
    prompts = make_prompts(TINY_SHAPE["vocab_size"])
    runner = family_runner(str(out))
    assert f"14 {FORMATS[name][0]} int4 -> float32" in runner.model.weight_summary
    assert_matches_reference(reference(str(grid_out), prompts), prompts, run_family(runner, prompts))


@pytest.mark.parametrize("name, kept", [("gptq-4bit-g32", "14 gptq int4 -> int4 (kept)"),
                                        ("gptq-8bit-symmetric", "14 gptq int8 -> int8"),
                                        ("gptq-act-order", "14 gptq int4 -> bfloat16")])
def test_bfloat16_keeps_the_checkpoints_values(name, kept, float_llama, tmp_path):
    """With bfloat16 the CPU's kernels compute with the checkpoint's own 4-bit (8-bit) values, where llmbus's
    form holds them; act-order's groups are expanded instead."""
    out, _ = published(float_llama, tmp_path, name)
    runner = family_runner(str(out), dtype=torch.bfloat16)
    if not quant.tiled_forms():
        pytest.skip("no tiled kernel on this CPU: bfloat16 computes in torch's bf16")
    assert kept in runner.model.weight_summary, runner.model.weight_summary
    results = run_family(runner, make_prompts(TINY_SHAPE["vocab_size"]))
    assert all(len(tokens) > 0 for tokens, _ in results.values())


def test_quantize_may_name_the_checkpoints_method_only(float_llama, tmp_path):
    out, _ = published(float_llama, tmp_path, "gptq-4bit-g32")
    assert "14 gptq int4 -> float32" in family_runner(str(out), quantize="gptq").model.weight_summary
    for other, message in (("int8", "already quantized with gptq"), ("awq", "quantized with gptq")):
        with pytest.raises(ValueError, match=message):
            family_runner(str(out), quantize=other)


@pytest.mark.parametrize("writer", list(FLOAT8_WRITERS))
def test_float8_checkpoints_read_scaled_and_serve_as_transformers(writer, float_llama, tmp_path):
    """transformers' fp8 (block scales, here blocks that do not divide the shapes), Meta's fbgemm_fp8 (a scale
    per row) and compressed-tensors (one per tensor, with activation scales beside): each weight reads as
    ``w8 * scale`` in float32, whole and in shards, and the model equals transformers on those numbers."""
    out, grid_out = tmp_path / writer, tmp_path / f"{writer}-grid"
    write_float8(str(float_llama), str(out), str(grid_out), writer, block=(48, 40))
    grid = load_file(str(grid_out / "model.safetensors"))
    with Float8CheckpointReader(CheckpointReader(str(out)), checkpoint_quantization(out)) as reader:
        assert not any("scale" in name for name in reader.names())
        assert reader.qtype(PROJECTIONS[0]) == "float8 e4m3" and reader.qtype("lm_head.weight") == "safetensors"
        for projection in PROJECTIONS:
            expected = grid[projection].float()
            assert torch.equal(reader.read(projection), expected)
            assert torch.equal(reader.read_rows(projection, 8, 40), expected[8:40])
            assert torch.equal(reader.read_cols(projection, 32, 64), expected[:, 32:64])
    prompts = make_prompts(TINY_SHAPE["vocab_size"])
    runner = family_runner(str(out))
    assert "14 float8 e4m3 -> float32" in runner.model.weight_summary
    assert_matches_reference(reference(str(grid_out), prompts), prompts, run_family(runner, prompts))


def test_float8_scales_by_either_name_and_none_is_refused(float_llama, tmp_path):
    """Older AutoFP8 uploads say quant_method fp8 and keep one weight_scale per tensor (transformers' own writer
    names it weight_scale_inv): either is read. A float8 weight with no scale beside it is refused by name,
    never read unscaled."""
    import json

    from safetensors.torch import save_file

    out, grid_out = tmp_path / "autofp8", tmp_path / "grid"
    write_float8(str(float_llama), str(out), str(grid_out), "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (out / "config.json").write_text(json.dumps(config))
    grid = load_file(str(grid_out / "model.safetensors"))
    with Float8CheckpointReader(CheckpointReader(str(out)), checkpoint_quantization(out)) as reader:
        assert torch.equal(reader.read(PROJECTIONS[0]), grid[PROJECTIONS[0]].float())
    state = load_file(str(out / "model.safetensors"))
    del state[PROJECTIONS[0].removesuffix(".weight") + ".weight_scale"]
    save_file(state, str(out / "model.safetensors"))
    with Float8CheckpointReader(CheckpointReader(str(out)), checkpoint_quantization(out)) as reader:
        with pytest.raises(ValueError, match="stored as float8 without a weight_scale"):
            reader.read(PROJECTIONS[0])
