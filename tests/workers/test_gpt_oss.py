"""gpt-oss served natively (``workers/models/gpt_oss.py``): attention with biases and per-head sinks, alternating
sliding and full layers, YaRN, and routed experts with biases and gpt-oss's clamped SwiGLU, read from float
weights and from MXFP4 blocks as gpt-oss publishes them. Token- and logprob-exact against transformers in
float32 at TP=1 (speculative rows too) and TP=2 (each expert's width and the sinks split over the ranks) on the
families' mixed batch with a chunked prefill, a preemption and a prefix hit; in bfloat16 on CPU with the MXFP4
experts kept as stored (as close to float32 as their values expanded to bfloat16); from a GGUF file in
llama.cpp's layout (gate and up experts apart, MXFP4 blocks in ggml's order, YaRN in the metadata); and served
through ``llmbus up`` from an MXFP4 checkpoint and from that GGUF."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.bus.prequantized import checkpoint_quantization
from llmbus.supervisor.gguf_model import materialize
from llmbus.testing.families import (assert_matches_reference, assert_speculation_matches_reference, family_runner,
                                     make_prompts, reference, run_family, run_family_tensor_parallel)
from llmbus.testing.gguf_files import write_gguf
from llmbus.testing.prequantized import write_mxfp4
from llmbus.testing.runner_driver import widen_weights
from llmbus.workers import quant
from llmbus.workers.gguf_checkpoint import GGUFCheckpointReader
from llmbus.workers.loader import CheckpointReader
from llmbus.workers.models.gpt_oss import GptOssReader
from llmbus.workers.prequantized_checkpoint import Mxfp4CheckpointReader
from llmbus.workers.seq_input import SeqInput

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


def teacher_forced(runner, prompts: list[list[int]], ref) -> torch.Tensor:
    """``runner``'s log-probabilities of ``ref``'s greedy tokens, each prompt with its tokens in one prefill
    (``prompt_logprobs``): ``[prompts, new tokens]``, on the same token paths whatever ``runner`` would choose."""
    rows = []
    for i, prompt in enumerate(prompts):
        tokens = prompt + ref.tokens[i]
        blocks = list(range(-(-len(tokens) // runner.block_size)))
        step = runner.step([SeqInput(rid="forced", token_ids=tokens, num_computed=0, block_table=blocks, sample=False,
                                     sampling=SamplingParams(), prompt_len=len(tokens), prompt_logprobs=True)])
        runner.drop(["forced"])
        rows.append(torch.tensor(step.prompt_logprobs[0][1][-len(ref.tokens[i]):]))
    return torch.stack(rows)


def test_bfloat16_keeps_the_mxfp4_experts(gpt_oss):
    """bfloat16 on CPU: every expert computes from its MXFP4 codes and scales (integer_products.c, against
    activations quantized to 16 bits), and the model stays as close to float32 as the same values expanded to
    bfloat16 do: on transformers' float32 greedy paths, the mean distance of its log-probabilities from
    transformers' is within 1.25 times the expanded model's (plus 0.01). (Greedy tokens may part where this
    tiny random model's top two are near-tied; int8 activations, llama.cpp's, measured 1.9 times.)"""
    _, path, prompts, _, held_ref = gpt_oss
    if not quant.tiled_forms():
        pytest.skip("no tiled kernel on this CPU: bfloat16 computes in torch's bf16")
    kept_runner = family_runner(path, dtype=torch.bfloat16)
    assert kept_runner.model.weight_summary.startswith("36 mxfp4 -> mxfp4 (kept)"), kept_runner.model.weight_summary
    expanded_runner = family_runner(str(Path(path).parent / "held"), dtype=torch.bfloat16)
    assert "mxfp4" not in expanded_runner.model.weight_summary
    truth = torch.stack([held_ref.greedy_logprobs(i) for i in range(len(prompts))])
    kept_gap = (teacher_forced(kept_runner, prompts, held_ref) - truth).abs().mean().item()
    expanded_gap = (teacher_forced(expanded_runner, prompts, held_ref) - truth).abs().mean().item()
    assert 0 < kept_gap <= 1.25 * expanded_gap + 0.01, (kept_gap, expanded_gap)


def test_tensor_parallel_2_matches_transformers(gpt_oss, tmp_path):
    _, path, prompts, _, held = gpt_oss
    assert_matches_reference(held, prompts, run_family_tensor_parallel(path, prompts, str(tmp_path)))


def test_served_from_mxfp4_end_to_end(tiny_model_dir, tmp_path):
    """``llmbus up`` on an MXFP4 gpt-oss with the demo tokenizer: transformers' greedy tokens (its own reading
    of the blocks), the startup log's weights line and /info's quantize."""
    import transformers


    special = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    save_tiny_gpt_oss(str(tmp_path / "float"), 4096, **special)
    folder = tmp_path / "mxfp4"
    write_mxfp4(str(tmp_path / "float"), str(folder), str(tmp_path / "held"))
    transformers.GenerationConfig(**special).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    server, info = assert_served_greedy(str(folder), folder, model)
    assert "path=native" in server.stderr.text and "mxfp4 -> float32" in server.stderr.text
    assert info[0] == 200 and info[1]["quantize"] == "mxfp4", info


def assert_served_greedy(model_id: str, tokenizer_dir, model, env: dict | None = None):
    """``llmbus up --model-id model_id`` in float32 answers a prompt with ``model``'s (transformers') greedy
    tokens, up to the EOS it stops at; (the stopped server, its /info)."""
    import transformers

    from llmbus.testing import Server
    from llmbus.testing.http import get, post

    prompt = "The quick brown fox jumps over the lazy dog"
    ids = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=None, pad_token_id=None)[0, ids.shape[1]:].tolist()
    server = Server(["--model-id", model_id, "--dtype", "float32", "--max-total-tokens", "256",
                     "--max-input-tokens", "128", "--num-blocks", "64"], env=env)
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
    return server, info


@pytest.fixture(scope="module")
def gpt_oss_gguf(tiny_model_dir, tmp_path_factory):
    """(the folder llmbus makes of a gpt-oss GGUF with MXFP4 experts, the file, the float checkpoint holding the
    values the file's blocks hold, prompts, that checkpoint's reference)."""
    import json

    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_tiny_gpt_oss(str(root / "float"), vocab_size)
    write_mxfp4(str(root / "float"), str(root / "mxfp4"), str(root / "held"))  # values on MXFP4's grid
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, root / "held" / name)
    gguf_path = write_gguf(root / "held", root / "tiny-gpt-oss.gguf", "F32", architecture="gpt-oss",
                           expert_type="MXFP4")
    folder = materialize(gguf_path, cache_root=root / "cache")
    prompts = make_prompts(vocab_size)
    return str(folder), gguf_path, str(root / "held"), prompts, reference(str(root / "held"), prompts)


def test_gguf_reads_as_the_checkpoint_it_was_written_from(gpt_oss_gguf):
    """The folder made of the file has the checkpoint's widths, windows and YaRN; every tensor the native model
    loads (each expert's gate, up and down and their biases, the router, the sinks) reads as the checkpoint's,
    the MXFP4 experts through their blocks exactly, and kept in bfloat16 as ``quant.Mxfp4Weight``."""
    import json

    folder, gguf_path, held, *_ = gpt_oss_gguf
    ours, theirs = (json.loads(open(f"{path}/config.json").read()) for path in (folder, held))
    for key in ("model_type", "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                "sliding_window", "layer_types", "num_key_value_heads"):
        assert ours[key] == theirs[key], key
    for key in ("rope_type", "factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings",
                "rope_theta"):
        assert ours["rope_parameters"][key] == theirs["rope_parameters"][key], key
    with GGUFCheckpointReader(gguf_path) as gguf_reader, CheckpointReader(held) as base:
        file, checkpoint = GptOssReader(gguf_reader), GptOssReader(base)
        layer = "model.layers.1."
        names = [f"{layer}mlp.experts.{e}.{part}.{kind}" for e in range(4)
                 for part in ("gate_proj", "up_proj", "down_proj") for kind in ("weight", "bias")]
        names += [f"{layer}{n}" for n in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks",
                                          "self_attn.o_proj.bias", "self_attn.q_proj.bias",
                                          "post_attention_layernorm.weight")]
        for name in names:
            assert torch.equal(file.read(name), checkpoint.read(name)), name
        assert gguf_reader.qtype(f"{layer}mlp.experts.2.up_proj.weight") == "MXFP4"
        kept = file.read_quantized(f"{layer}mlp.experts.2.down_proj.weight", cols=(32, 64))
        assert isinstance(kept, quant.Mxfp4Weight)
        assert torch.equal(kept.dequantize(), checkpoint.read(f"{layer}mlp.experts.2.down_proj.weight")[:, 32:])


def test_gguf_serves_as_the_checkpoint_it_was_written_from(gpt_oss_gguf):
    folder, _, _, prompts, ref = gpt_oss_gguf
    runner = family_runner(folder)
    assert type(runner.model).__name__ == "GptOssForCausalLM"
    assert "MXFP4 -> float32" in runner.model.weight_summary
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    if quant.tiled_forms():
        kept = family_runner(folder, dtype=torch.bfloat16)
        assert kept.model.weight_summary.startswith("36 MXFP4 -> mxfp4 (kept)"), kept.model.weight_summary


def test_served_from_a_gguf_end_to_end(gpt_oss_gguf, tmp_path):
    """``llmbus up --model-id FILE.gguf`` on the gpt-oss file: the greedy tokens of the checkpoint it was
    written from, through the tokenizer and config the file carries; the startup log names the model and how
    its experts are read."""
    import transformers

    _, gguf_path, held, _, _ = gpt_oss_gguf
    model = transformers.AutoModelForCausalLM.from_pretrained(held, dtype=torch.float32).eval()
    server, _ = assert_served_greedy(str(gguf_path), held, model, env={"LLMBUS_CACHE": str(tmp_path / "cache")})
    assert "model_type=gpt_oss path=native" in server.stderr.text and "MXFP4 -> float32" in server.stderr.text
