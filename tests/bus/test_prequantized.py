"""What a model folder says about the quantization it was published in (GPTQ, AWQ), where each tool writes it,
and the one-line refusals of what llmbus does not read."""

import json

import pytest

from llmbus.bus.prequantized import (CheckpointQuantization, UnsupportedQuantization, checkpoint_quantization,
                                     quantize_problem)


def folder(tmp_path, config: dict | None = None, **beside: dict):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **(config or {})}))
    for name, content in beside.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


@pytest.mark.parametrize("config, beside, expected", [
    ({}, {}, None),
    # transformers' quantization_config; GPTQ's original format stores each zero point minus one
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}}, {},
     CheckpointQuantization("gptq", 4, 128, 1)),
    ({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                              "checkpoint_format": "gptq_v2"}}, {},
     CheckpointQuantization("gptq", 8, None, 0)),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                              "version": "gemm"}}, {},
     CheckpointQuantization("awq", 4, 128, 0)),
    # older uploads: AutoGPTQ's quantize_config.json (AutoAWQ's too, with zero_point), AutoAWQ's quant_config.json
    ({}, {"quantize_config": {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}},
     CheckpointQuantization("gptq", 4, 128, 1)),
    ({}, {"quantize_config": {"bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM"}},
     CheckpointQuantization("awq", 4, 64, 0)),
    ({}, {"quant_config": {"w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}},
     CheckpointQuantization("awq", 4, 128, 0)),
    # FP8: transformers' (Qwen3's, DeepSeek's uploads), Meta's, llm-compressor's
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, {},
     CheckpointQuantization("fp8", 8, scale_name="weight_scale_inv", scale_block=(128, 128))),
    # older AutoFP8 uploads: fp8 without blocks (per-tensor scales; blocks default to transformers' 128 x 128)
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, {},
     CheckpointQuantization("fp8", 8, scale_name="weight_scale_inv", scale_block=(128, 128))),
    # compressed-tensors' group strategy: a scale per row and group of inputs
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}}, {},
     CheckpointQuantization("compressed-tensors", 8, scale_block=(1, 128))),
    ({"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}}, {},
     CheckpointQuantization("fp8", 8)),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}, "targets": ["Linear"]}}}},
     {}, CheckpointQuantization("compressed-tensors", 8)),
    # gpt-oss's experts (the transformers fallback reads them)
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}, {},
     CheckpointQuantization("mxfp4", 4, 32)),
])
def test_where_each_tool_says_it(tmp_path, config, beside, expected):
    assert checkpoint_quantization(folder(tmp_path, config, **beside)) == expected


@pytest.mark.parametrize("section, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes': llmbus reads GPTQ"),
    ({"quant_method": "hqq"}, "quant_method 'hqq': llmbus reads GPTQ, AWQ, FP8 and MXFP4"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 weights in 'e5m2' are not read"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "FP8 block size [128] is not two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int"}}}}, "compressed-tensors format 'pack-quantized'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit GPTQ weights are not read"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "GPTQ checkpoint_format 'marlin' is not read"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "packed for Marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, "words other than int32"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*mlp.*": {}}}, "bits per module"),
    ({"quant_method": "gptq", "group_size": 128}, "names no integer bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ's 'gemv' layout is not read"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "without zero points"),
])
def test_what_is_not_read_is_named(tmp_path, section, message):
    with pytest.raises(UnsupportedQuantization, match="the checkpoint's config.json") as refused:
        checkpoint_quantization(folder(tmp_path, {"quantization_config": section}))
    assert message in str(refused.value) and "\n" not in str(refused.value)


GPTQ = CheckpointQuantization("gptq", 4, 128, 1)


@pytest.mark.parametrize("published, flag, problem", [
    (None, None, None), (GPTQ, None, None), (GPTQ, "gptq", None), (None, "int8", None),
    (GPTQ, "awq", "--quantize awq was given, but the checkpoint is quantized with gptq"),
    (GPTQ, "int4", "--quantize int4 quantizes float weights, and this checkpoint is already quantized with gptq"),
    (None, "gptq", "--quantize gptq reads a checkpoint published in gptq's format, and this one has float weights"),
])
def test_quantize_flag_against_the_checkpoint(published, flag, problem):
    found = quantize_problem(published, flag)
    assert (found is None) if problem is None else found.startswith(problem), found
