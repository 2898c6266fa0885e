"""gpt-oss served natively (``workers/models/gpt_oss.py``): attention with biases and per-head sinks, alternating
sliding and full layers, YaRN, and routed experts with biases and gpt-oss's clamped SwiGLU, read from float
weights and from MXFP4 blocks as gpt-oss publishes them. Token- and logprob-exact against transformers in
float32 at TP=1 (speculative rows too) and TP=2 (each expert's width and the sinks split over the ranks) on the
families' mixed batch with a chunked prefill, a preemption and a prefix hit; in bfloat16 on CPU with the MXFP4
experts kept as stored (the same tokens as their expanded values); and one served through ``llmbus up`` from
an MXFP4 checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llmbus.bus.prequantized import checkpoint_quantization
from llmbus.testing.families import (assert_matches_reference, assert_speculation_matches_reference, family_runner,
                                     make_prompts, reference, run_family, run_family_tensor_parallel)
from llmbus.testing.prequantized import write_mxfp4
from llmbus.testing.runner_driver import widen_weights
from llmbus.workers import quant
from llmbus.workers.loader import CheckpointReader
from llmbus.workers.models.gpt_oss import GptOssReader
from llmbus.workers.prequantized_checkpoint import Mxfp4CheckpointReader

# Local, global, local layers (a window of 8 inside the longer prompts); four experts, two a token.
CONFIG = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size=509,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_tiny_gpt_oss(path: str, vocab_size: int = CONFIG["vocab_size"], **special) -> None:
    """A tiny gpt-oss with widened weights: its matrices and every bias (the experts' are named ``*_bias``), and
    sinks wide enough to take a visible share of each row's softmax."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**CONFIG, "vocab_size": vocab_size, **special})
    model = transformers.AutoModelForCausalLM.from_config(config)
    widen_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias"):
                param.normal_(0.0, 0.3)
            elif name.endswith(".sinks"):
                param.normal_(0.0, 2.0)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(float folder, MXFP4 folder, prompts, reference of the float weights, reference of the MXFP4 ones: the
    float copy of the values the blocks hold)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    save_tiny_gpt_oss(str(root / "float"))
    write_mxfp4(str(root / "float"), str(root / "mxfp4"), str(root / "held"))
    prompts = make_prompts(CONFIG["vocab_size"])
    return (str(root / "float"), str(root / "mxfp4"), prompts, reference(str(root / "float"), prompts),
            reference(str(root / "held"), prompts))


def test_float_weights_match_transformers(gpt_oss):
    path, _, prompts, ref, _ = gpt_oss
    runner = family_runner(path)
    model = runner.model
    assert type(model).__name__ == "GptOssForCausalLM" and model.fused_decode is None
    assert model.config.sliding_windows == (8, None, 8)
    assert [tuple(s.shape) for s in model.attention_backend.sinks] == [(4,)] * 3
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    assert_speculation_matches_reference(runner, prompts, ref)


def test_mxfp4_experts_match_transformers(gpt_oss):
    _, path, prompts, _, held = gpt_oss
    runner = family_runner(path)
    assert "mxfp4 -> float32" in runner.model.weight_summary
    assert_matches_reference(held, prompts, run_family(runner, prompts))


def test_mxfp4_experts_read_quantized_as_their_expanded_values(gpt_oss):
    """``read_quantized`` of an expert's gate, up and down projections (a rank's rows or columns) holds exactly
    the numbers ``read_rows``/``read_cols`` expand; a float checkpoint's experts have no quantized form."""
    float_path, path, *_ = gpt_oss
    with Mxfp4CheckpointReader(CheckpointReader(path), checkpoint_quantization(path)) as base:
        reader = GptOssReader(base)
        for expert in (0, 3):
            prefix = f"model.layers.1.mlp.experts.{expert}."
            for part in ("gate_proj", "up_proj"):  # [64, 64]: rows 32..64 as a second rank's shard
                kept = reader.read_quantized(prefix + part + ".weight", rows=(32, 64))
                assert isinstance(kept, quant.Mxfp4Weight) and kept.shape == (32, 64)
                assert torch.equal(kept.dequantize(), reader.read_rows(prefix + part + ".weight", 32, 64))
            kept = reader.read_quantized(prefix + "down_proj.weight", cols=(32, 64))
            assert torch.equal(kept.dequantize(), reader.read_cols(prefix + "down_proj.weight", 32, 64))
        assert reader.read_quantized("model.layers.1.mlp.experts.0.gate_proj.bias") is None
        assert reader.read_quantized("model.layers.1.self_attn.q_proj.weight") is None
    with CheckpointReader(float_path) as base:
        assert GptOssReader(base).read_quantized("model.layers.1.mlp.experts.0.gate_proj.weight") is None


def test_bfloat16_keeps_the_mxfp4_experts(gpt_oss):
    """bfloat16 on CPU: every expert computes from its MXFP4 codes and scales (quant_kernels.c's MXFP4 form, a
    quarter of bf16's bytes), giving the tokens of the same model with those values expanded to bfloat16, and
    log-probabilities within the two sums' different orders (per block, then scaled; or one long sum)."""
    _, path, prompts, _, _ = gpt_oss
    if not quant.tiled_forms():
        pytest.skip("no tiled kernel on this CPU: bfloat16 computes in torch's bf16")
    kept_runner = family_runner(path, dtype=torch.bfloat16)
    assert kept_runner.model.weight_summary.startswith("36 mxfp4 -> mxfp4 (kept)"), kept_runner.model.weight_summary
    kept = run_family(kept_runner, prompts)
    expanded_runner = family_runner(str(Path(path).parent / "held"), dtype=torch.bfloat16)
    assert "mxfp4" not in expanded_runner.model.weight_summary
    expanded = run_family(expanded_runner, prompts)
    for rid, (tokens, logprobs) in expanded.items():
        assert kept[rid][0] == tokens, rid
        torch.testing.assert_close(torch.tensor(kept[rid][1]), torch.tensor(logprobs), rtol=0, atol=5e-3)


def test_tensor_parallel_2_matches_transformers(gpt_oss, tmp_path):
    _, path, prompts, _, held = gpt_oss
    assert_matches_reference(held, prompts, run_family_tensor_parallel(path, prompts, str(tmp_path)))


def test_served_from_mxfp4_end_to_end(tiny_model_dir, tmp_path):
    """``llmbus up`` on an MXFP4 gpt-oss with the demo tokenizer: transformers' greedy tokens (its own reading
    of the blocks), the startup log's weights line and /info's quantize."""
    import transformers

    from llmbus.testing import Server
    from llmbus.testing.http import get, post

    special = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    save_tiny_gpt_oss(str(tmp_path / "float"), 4096, **special)
    folder = tmp_path / "mxfp4"
    write_mxfp4(str(tmp_path / "float"), str(folder), str(tmp_path / "held"))
    transformers.GenerationConfig(**special).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=None)[0, ids.shape[1]:].tolist()

    server = Server(["--model-id", str(folder), "--dtype", "float32", "--max-total-tokens", "256",
                     "--max-input-tokens", "128", "--num-blocks", "64"])
    try:
        status, _, body = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
            "max_new_tokens": 12, "details": True}})
        info = get(f"{server.url}/info")
    finally:
        code = server.stop()
    assert code == 0, server.stderr.text[-3000:]
    assert status == 200, body
    got = [t["id"] for t in body["details"]["tokens"]]
    assert got == expected[:len(got)] and got, (got, expected)  # the server stops at EOS; the reference does not
    assert "path=native" in server.stderr.text and "mxfp4 -> float32" in server.stderr.text
    assert info[0] == 200 and info[1]["quantize"] == "mxfp4", info
