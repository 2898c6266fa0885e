"""ModelRunner against transformers: token-exact greedy decoding, logprobs, tensor parallelism, seeds.

The checkpoints are tiny random Llamas saved with ``save_pretrained``. Random weights give near-tied
logits, so the weights are re-initialised with a wide normal (std 0.3) and every compared position
asserts that the reference's top-1/top-2 logit margin exceeds 1e-3: a match is then meaningful, not a
coin flip between two almost equal logits, and a mismatch is a real bug. The harness (a hand-driven
scheduler, the reference, the TP=2 run) is ``llmbus.testing.runner_driver``; other model families are in
``test_model_families.py``.
"""

from __future__ import annotations

import shutil

from dataclasses import dataclass

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import (BLOCK_SIZE, NUM_BLOCKS, Reference, Request, drive, drive_tensor_parallel,
                                          make_prompts, mixed_requests, reference, save_tiny_llama, widen_weights)
from llmbus.workers.kv_cache import PagedKVCache, num_blocks_for_bytes
from llmbus.workers.model_runner import ModelRunner
from llmbus.workers.sampling import apply_warpers, sample, seeded_uniform


@dataclass
class Checkpoint:
    path: str
    tied: bool
    prompts: list[list[int]]
    reference: Reference


@pytest.fixture(scope="module", params=["untied", "tied"])
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    tied = request.param == "tied"
    # An odd vocabulary on the untied model makes the TP=2 vocab shards uneven (padding path).
    vocab_size = 512 if tied else 509
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_llama(path, tied=tied, vocab_size=vocab_size)
    prompts = make_prompts(vocab_size)
    return Checkpoint(path, tied, prompts, reference(path, prompts))


@pytest.fixture(scope="module")
def runner(checkpoint):
    model_runner = ModelRunner(checkpoint.path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                               max_batch_prefill_tokens=512)
    model_runner.warmup()  # uses the pool as scratch: the tests below also check that this is harmless
    return model_runner


# -- greedy exactness ----------------------------------------------------------------------------


def test_greedy_one_at_a_time_matches_transformers(checkpoint, runner):
    prompts, ref = checkpoint.prompts, checkpoint.reference
    for i, prompt in enumerate(prompts):
        result = drive(runner, [Request(rid=f"solo{i}", prompt=prompt)])[f"solo{i}"]
        assert result.tokens == ref.tokens[i], f"prompt {i} (length {len(prompt)})"


def test_greedy_continuous_batching_matches_transformers(checkpoint, runner):
    prompts, ref = checkpoint.prompts, checkpoint.reference
    results = drive(runner, mixed_requests(prompts))
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == ref.tokens[i], f"prompt {i} (length {len(prompts[i])})"


def test_greedy_logprobs_match_transformers_log_softmax(checkpoint, runner):
    prompts, ref = checkpoint.prompts, checkpoint.reference
    results = drive(runner, mixed_requests(prompts))
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.tensor(results[f"r{i}"].logprobs), ref.greedy_logprobs(i),
                                   rtol=0, atol=1e-4)


def test_fused_decode_layer_and_torch_layers_both_match_transformers(checkpoint, runner, monkeypatch):
    """On CPU in float32 small decode-only steps run through the fused C layer (fused_decode.py); the
    same requests through the torch layers give the same tokens, and both equal transformers'."""
    fused = runner.model.fused_decode
    if fused is None:
        pytest.skip("no C compiler: the fused decode layer is optional")
    prompts, ref = checkpoint.prompts, checkpoint.reference
    ran = []
    monkeypatch.setattr(fused, "run", lambda *args, run=fused.run: ran.append(run(*args)) or ran[-1])
    for name, layers in (("fused", fused), ("torch", None)):
        runner.model.fused_decode = layers
        try:
            results = drive(runner, mixed_requests(prompts))
        finally:
            runner.model.fused_decode = fused
        for i in range(len(prompts)):
            assert results[f"r{i}"].tokens == ref.tokens[i], f"{name}: prompt {i}"
    # Decode-only steps took it; steps with prompts too where it takes any batch (the backend's prompt rows).
    assert sum(ran) >= 5 and all(ran) == fused.takes_large_batches


def test_bfloat16_checkpoint_in_float32_decodes_through_bfloat16_copies(tmp_path):
    """A bfloat16 checkpoint served in float32: the fused layer's GEMVs stream bfloat16 copies of its
    weights (half the bytes), and every token and logprob equals those of the same run on the float32
    weights alone and transformers' float32 greedy output."""
    import transformers

    from llmbus.workers.fused_decode import FusedDecodeLayers

    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    widen_weights(model)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path))
    prompts = make_prompts(512)
    ref = reference(str(tmp_path), prompts)
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512)
    copied = runner.model.fused_decode
    if copied is None or not copied._head.bf16:
        pytest.skip("no C compiler, or no SIMD bfloat16 reads: the fused layer streams float32 weights")
    assert all(getattr(layer, name).bf16 for layer in copied._layers for name in ("qkv", "o_proj", "gate_up", "down"))
    plain = FusedDecodeLayers.for_model(runner.model, bf16_budget=0)
    assert not plain._head.bf16 and not plain._layers[0].qkv.bf16
    results = {}
    for name, layers in (("copies", copied), ("float32", plain)):
        runner.model.fused_decode = layers
        results[name] = drive(runner, mixed_requests(prompts))
    for i in range(len(prompts)):
        assert results["copies"][f"r{i}"].tokens == ref.tokens[i], f"prompt {i}"
        assert results["copies"][f"r{i}"].logprobs == results["float32"][f"r{i}"].logprobs, f"prompt {i}"


def test_fused_decode_layer_takes_large_batches_through_gemm_and_matches_transformers(checkpoint, runner,
                                                                                     monkeypatch):
    """Past MAX_ROWS decode rows (float32, where gemm.c runs) the fused layer computes its projections as
    GEMMs: four copies of every prompt decode together, 20 rows a step, each equal to transformers'."""
    from llmbus.workers.kernels.bindings import MAX_ROWS

    fused = runner.model.fused_decode
    if fused is None or not fused._large_batches:
        pytest.skip("no C compiler, or gemm.c does not run on this CPU: large batches take the torch layers")
    prompts, ref = checkpoint.prompts, checkpoint.reference
    fused_rows = []

    def run(hidden, *args, run=fused.run):
        took = run(hidden, *args)
        fused_rows.extend([hidden.shape[0]] if took else [])
        return took

    monkeypatch.setattr(fused, "run", run)
    requests = [Request(rid=f"c{copy}-{i}", prompt=prompt) for copy in range(4) for i, prompt in enumerate(prompts)]
    results = drive(runner, requests)
    for copy in range(4):
        for i in range(len(prompts)):
            assert results[f"c{copy}-{i}"].tokens == ref.tokens[i], f"copy {copy}, prompt {i}"
    # decode-only steps of every request (prompt steps, as rows, took it too: the larger ones)
    assert len(requests) > MAX_ROWS and len(requests) in fused_rows and max(fused_rows) > len(requests)


def test_fused_decode_layer_reads_int8_weights_as_the_torch_path_computes_them(checkpoint):
    """--quantize int8 with float32 activations where quant_kernels.c does not run: the fused layer
    streams the int8 rows and their group scales; the torch path multiplies by the dequantized copy.
    Same tokens (no transformers reference: the weights are not the checkpoint's)."""
    runner = ModelRunner(checkpoint.path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512,
                         quantize="int8")
    fused = runner.model.fused_decode
    if fused is None:
        pytest.skip("int8 runs on quant_kernels.c here (or no C compiler): the fused layer does not take it")
    ran = []
    fused.run = lambda *args, run=fused.run: ran.append(run(*args)) or ran[-1]
    results = {}
    for name, layers in (("fused", fused), ("torch", None)):
        runner.model.fused_decode = layers
        results[name] = drive(runner, mixed_requests(checkpoint.prompts))
    assert {r: v.tokens for r, v in results["fused"].items()} == {r: v.tokens for r, v in results["torch"].items()}
    assert all(len(v.tokens) > 1 for v in results["fused"].values()) and sum(ran) >= 5


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_narrower_kv_cache_agrees_across_paths(checkpoint, kv_dtype):
    """--kv-cache-dtype float16 (or bfloat16) on a float32 model: the pool stores the narrower type and every
    path (the fused C layer, torch layers with the C decode kernel, the portable backend; bfloat16 takes the
    portable one throughout) writes and reads it alike, so their tokens agree; they also follow
    transformers' float32 greedy tokens where the margins are decisive, as these tiny models' are."""
    from llmbus.workers.attention import TorchSDPABackend

    runner = ModelRunner(checkpoint.path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512,
                         kv_cache_dtype=kv_dtype)
    runner.warmup()
    assert runner.kv_cache.key.dtype == kv_dtype and runner.kv_cache.compute_dtype == torch.float32
    fused, kernel_backend = runner.model.fused_decode, runner.model.attention_backend
    paths = {"fused": (fused, kernel_backend), "kernel": (None, kernel_backend),
             "portable": (None, TorchSDPABackend(kernel_backend.windows))}
    results = {}
    for name, (layers, backend) in paths.items():
        runner.model.fused_decode, runner.model.attention_backend = layers, backend
        results[name] = {r: v.tokens for r, v in drive(runner, mixed_requests(checkpoint.prompts)).items()}
    assert results["fused"] == results["kernel"] == results["portable"]
    assert [results["portable"][f"r{i}"] for i in range(len(checkpoint.prompts))] == checkpoint.reference.tokens


# -- tensor parallelism --------------------------------------------------------------------------


def test_tensor_parallel_2_matches_single_rank(checkpoint, runner, tmp_path):
    prompts, ref = checkpoint.prompts, checkpoint.reference
    tp_results = drive_tensor_parallel(checkpoint.path, {"mixed": mixed_requests(prompts)}, str(tmp_path))["mixed"]
    single = drive(runner, mixed_requests(prompts))
    for i in range(len(prompts)):
        tp_tokens, tp_logprobs = tp_results[f"r{i}"]
        assert tp_tokens == single[f"r{i}"].tokens == ref.tokens[i]
        torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(single[f"r{i}"].logprobs),
                                   rtol=0, atol=1e-4)


def test_tensor_parallel_rejects_indivisible_heads(checkpoint):
    with pytest.raises(ValueError, match="divisible by 3"):
        ModelRunner(checkpoint.path, rank=0, world_size=3, num_blocks=8)


# -- RoPE scaling --------------------------------------------------------------------------------

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    # Prompts stay below the trained length (24) and decoding goes past it: there transformers rescales per
    # decoded position, as the runner does (prompts past it: test_dynamic_ntk_rotates_a_prompt_by_its_length).
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    # older configs leave the original length out: transformers takes max_position_embeddings
    "llama3_without_original_length": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0},
    # Qwen2.5's and Qwen3's long-context setting; DeepSeek's attention factor from mscale / mscale_all_dim
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 12, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant, tmp_path):
    import json

    import transformers

    from llmbus.bus.model_files import rope_positions

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=24, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={**ROPE_VARIANTS[variant], "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(config)
    widen_weights(model)
    model.save_pretrained(str(tmp_path))
    prompts = [p for p in make_prompts(512) if 1 < len(p) < 24]
    ref = reference(str(tmp_path), prompts)
    rope_runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=64)
    # what the ranks embed is the launcher's limit (yarn: 16 x 4 = 64 past the config's 24)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert rope_runner.max_position_embeddings == rope_positions(saved, None)
    assert variant != "yarn" or rope_runner.max_position_embeddings == 64
    results = drive(rope_runner, [Request(rid=f"p{i}", prompt=p, arrival_step=i) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert results[f"p{i}"].tokens == ref.tokens[i], f"prompt {i} (length {len(prompts[i])})"


def test_dynamic_ntk_horizons_in_a_step_of_one_token_a_sequence():
    """A step whose every sequence has one row carries no start mask (the CPU backend's decode metadata), yet
    may hold a 1-token chunk of a long prompt: each row is its own sequence's."""
    from llmbus.workers.models.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 8, torch.device("cpu"))
    positions, horizons = torch.tensor([3, 10]), torch.tensor([20, 5])
    cos, sin = rotary.cos_sin(positions, torch.float32, None, horizons)
    for row, reach in enumerate((20, 10)):  # the prompt's last position, else the row's own
        alone = rotary.cos_sin(torch.tensor([positions[row]]), torch.float32, None, torch.tensor([reach]))
        assert torch.equal(cos[row], alone[0][0]) and torch.equal(sin[row], alone[1][0])
    assert not torch.equal(cos[0], rotary.cos_sin(torch.tensor([3]), torch.float32)[0][0])
    # LongRoPE's horizon alike: a 1-token chunk of a prompt past the original length takes the long factors
    longrope = RotaryEmbedding(16, 10000.0, {"rope_type": "longrope", "original_max_position_embeddings": 8,
                                             "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}, 32,
                               torch.device("cpu"))
    unmarked = longrope.cos_sin(torch.tensor([3]), torch.float32, None, torch.tensor([20]))
    marked = longrope.cos_sin(torch.tensor([3]), torch.float32, torch.tensor([True]), torch.tensor([20]))
    assert torch.equal(unmarked[0], marked[0]) and not torch.equal(unmarked[0], longrope.cos_sin(
        torch.tensor([3]), torch.float32)[0])


def test_dynamic_ntk_rotates_a_prompt_by_its_length_as_transformers_prefills_it(tmp_path):
    """transformers computes a prompt in one prefill, its dynamic NTK base chosen by the prompt's length, and each
    generated token with its own position's: prompts past the trained length (16) give its tokens in chunks,
    preempted and resumed (the recomputed prompt by its length, the generated tokens by their positions), beside
    prompts within it. (transformers' rotary keeps the longest length it has seen, so each prompt's reference is
    a fresh model's.)"""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=16, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(config)
    widen_weights(model)
    model.save_pretrained(str(tmp_path))
    prompts = [p for p in make_prompts(512) if len(p) > 1] + [make_prompts(512)[-1][:31]]  # 3, 7, 19, 40, 31
    expected = [reference(str(tmp_path), [prompt]).tokens[0] for prompt in prompts]
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=64)
    assert runner.rope_split_tokens == 16 and runner.rope_split_by_length  # the prefix cache keeps lengths apart
    requests = [Request(rid=f"p{i}", prompt=p, arrival_step=i, prefill_chunk=8) for i, p in enumerate(prompts)]
    requests[2].preempt_after, requests[2].resume_cached_blocks = 3, 1
    requests[3].preempt_after = 6
    results = drive(runner, requests)
    for i, prompt in enumerate(prompts):
        assert results[f"p{i}"].tokens == expected[i], f"prompt {i} (length {len(prompt)})"
    assert results["p2"].preemptions == results["p3"].preemptions == 1


@pytest.mark.parametrize("override", [("linear", 2.0), ("dynamic", 2.0)])
def test_rope_override_runs_as_transformers_on_the_overridden_config(override, tmp_path):
    """TGI's --rope-scaling/--rope-factor on a checkpoint without RoPE scaling: the runner equals transformers
    on the config ``with_rope_override`` writes, and embeds the factor's positions."""
    import json
    import os

    import transformers

    from llmbus.bus.model_files import with_rope_override

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=24, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    widen_weights(model)
    plain, overridden = tmp_path / "plain", tmp_path / "overridden"
    model.save_pretrained(str(plain))
    overridden.mkdir()
    os.symlink(plain / "model.safetensors", overridden / "model.safetensors")
    written = with_rope_override(json.loads((plain / "config.json").read_text()), override)
    (overridden / "config.json").write_text(json.dumps(written))
    # (dynamic: prompts within the trained length, decoding past it, as test_rope_scaling_matches_transformers)
    prompts = [p for p in make_prompts(512) if 1 < len(p) < 24]
    ref = reference(str(overridden), prompts)
    requests = lambda: [Request(rid=f"p{i}", prompt=p, arrival_step=i) for i, p in enumerate(prompts)]  # noqa: E731
    runner = ModelRunner(str(plain), block_size=BLOCK_SIZE, num_blocks=64, rope_scaling=override)
    assert runner.max_position_embeddings == 48
    results = drive(runner, requests())
    for i in range(len(prompts)):
        assert results[f"p{i}"].tokens == ref.tokens[i], f"prompt {i} (length {len(prompts[i])})"
    unscaled = drive(ModelRunner(str(plain), block_size=BLOCK_SIZE, num_blocks=64), requests())
    assert [r.tokens for r in results.values()] != [r.tokens for r in unscaled.values()], "the override changed nothing"


def test_a_tied_config_with_a_head_of_its_own_computes_with_that_head(tmp_path):
    """tie_word_embeddings, yet the checkpoint holds an lm_head.weight: transformers 5 computes with the file's
    head, and so does the runner where it differs from the embedding; an equal copy is tied, held once."""
    from safetensors.torch import load_file, save_file

    from llmbus.testing.families import save_tiny_family

    save_tiny_family(str(tmp_path / "tied"), "LlamaConfig", tie_word_embeddings=True)
    state = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert "lm_head.weight" not in state
    for name, head in (("own", torch.randn_like(state["model.embed_tokens.weight"]) * 0.3),
                       ("copy", state["model.embed_tokens.weight"].clone())):
        shutil.copytree(tmp_path / "tied", tmp_path / name)
        save_file({**state, "lm_head.weight": head}, str(tmp_path / name / "model.safetensors"))
    prompts = [p for p in make_prompts(509) if len(p) < 24]
    ref = reference(str(tmp_path / "own"), prompts)
    runner = ModelRunner(str(tmp_path / "own"), block_size=BLOCK_SIZE, num_blocks=64)
    results = drive(runner, [Request(rid=f"p{i}", prompt=p, arrival_step=i) for i, p in enumerate(prompts)])
    assert [results[f"p{i}"].tokens for i in range(len(prompts))] == ref.tokens
    assert runner.model.plain_head_weight is None  # a head apart from the embedding
    copy = ModelRunner(str(tmp_path / "copy"), block_size=BLOCK_SIZE, num_blocks=64)
    assert copy.model.plain_head_weight is copy.model.embedding.weight


def test_legacy_rope_config_keys_are_read():
    from llmbus.workers.models.llama import DecoderConfig

    config = DecoderConfig.from_hf({
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.num_kv_heads == 2 and config.head_dim == 4


# -- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_sampler_follows_the_warped_distribution(vary):
    # 4000 draws from the same logits, by 4000 seeds at one position or by one seed at 4000 positions:
    # the token frequencies must follow softmax(logits / temperature) restricted by top-k, and every
    # logprob must be the warped log-softmax of its token.
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -5.0]]).repeat(4000, 1)
    seeds = range(4000) if vary == "seed" else [2**64 - 1] * 4000
    positions = [17] * 4000 if vary == "seed" else list(range(4000))
    params = [SamplingParams(do_sample=True, temperature=0.7, top_k=4, seed=seed) for seed in seeds]
    token_ids, logprobs, _ = sample(logits, params, positions)
    warped_logprobs = torch.log_softmax(apply_warpers(logits[:1] / 0.7, params[:1]), dim=-1)[0]
    assert token_ids.max() < 4, "a token outside the top-k was sampled"
    torch.testing.assert_close(logprobs, warped_logprobs[token_ids], rtol=0, atol=1e-6)
    frequencies = torch.bincount(token_ids, minlength=6).float() / 4000
    torch.testing.assert_close(frequencies, warped_logprobs.exp(), rtol=0, atol=0.03)


def test_seeded_draws_depend_only_on_seed_and_position():
    uniforms = [seeded_uniform(seed, position) for seed in (0, 1, 2**63, 2**64 - 1) for position in range(256)]
    assert all(0.0 <= u < 1.0 for u in uniforms)
    assert len(set(uniforms)) == len(uniforms), "two (seed, position) pairs drew the same number"
    assert seeded_uniform(5, 100) == seeded_uniform(5, 100)
    assert seeded_uniform(-1, 3) == seeded_uniform(2**64 - 1, 3)  # seeds are taken modulo 2**64
    # A row's token depends on its own logits, seed and position, not on the rows beside it or their order.
    torch.manual_seed(4)
    logits = torch.randn(6, 50) * 2
    params = [SamplingParams(do_sample=True, temperature=1.3, seed=s) for s in (3, 3, 4, 5, 6, 7)]
    positions = [10, 11, 10, 12, 13, 14]
    together = sample(logits, params, positions)[0]
    for row in range(6):
        assert sample(logits[row:row + 1], params[row:row + 1], positions[row:row + 1])[0] == together[row]
    reversed_rows = sample(logits.flip(0), params[::-1], positions[::-1])[0]
    assert torch.equal(reversed_rows.flip(0), together)


def test_seeded_sampling_is_independent_of_the_batch(checkpoint, runner):
    prompts = checkpoint.prompts
    seeded = SamplingParams(do_sample=True, temperature=1.5, top_k=100, top_p=0.95, seed=1234)
    alone = drive(runner, [Request(rid="seeded", prompt=prompts[2], sampling=seeded)])["seeded"].tokens
    batch = [Request(rid="greedy", prompt=prompts[4], prefill_chunk=16),
             Request(rid="other", prompt=prompts[3],
                     sampling=SamplingParams(do_sample=True, typical_p=0.5, seed=99), arrival_step=1),
             Request(rid="seeded", prompt=prompts[2], sampling=seeded, arrival_step=2),
             Request(rid="twin", prompt=prompts[2], sampling=seeded, arrival_step=4)]
    results = drive(runner, batch)
    assert results["seeded"].tokens == alone
    assert results["twin"].tokens == alone  # same seed, other rid, other steps
    reseeded = SamplingParams(do_sample=True, temperature=1.5, top_k=100, top_p=0.95, seed=1235)
    other_seed = drive(runner, [Request(rid="reseeded", prompt=prompts[2], sampling=reseeded)])["reseeded"]
    assert other_seed.tokens != alone, "sampling ignores the seed (or is greedy)"


# -- KV pool -------------------------------------------------------------------------------------


def test_kv_pool_sizing_fits_the_budget():
    shape = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    budget = 10 * 1024 * 1024
    num_blocks = num_blocks_for_bytes(budget, **shape)
    pool = PagedKVCache(num_blocks=num_blocks, device="cpu", **shape)
    assert pool.nbytes <= budget
    assert PagedKVCache(num_blocks=num_blocks + 1, device="cpu", **shape).nbytes > budget
    assert pool.key[:, :, num_blocks].abs().sum() == 0  # the padding block is readable zeros
