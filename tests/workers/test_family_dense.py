"""Dense families served natively beside Llama: a Llama with one K/V head (multi-query), Qwen3 (QK-norm,
in the torch layers and in the fused CPU decode layer), Phi-3/Phi-4 (the checkpoint's fused
``qkv_proj``/``gate_up_proj`` split per TP rank, LongRoPE, partial rotation), Gemma 3 text (interleaved
local/global layers with their two RoPE bases, QK-norm, (1 + weight) norms around attention and MLP, GeGLU,
scaled embeddings, soft-capped logits), Gemma 2 (Gemma 3's decoder without QK-norm, one RoPE, and its
attention scores soft-capped in the attention backend). Each is token- and logprob-exact against transformers in
float32 at TP=1 and TP=2 on a mixed batch with a chunked prefill, a preemption and a prefix hit (the multi-query Llama's
one K/V head replicated on both ranks); Qwen3 also under ``--quantize int8`` against transformers on the
re-quantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmbus.bus.model_files import config_max_positions, read_config
from llmbus.testing.families import (assert_matches_reference, assert_speculation_matches_reference, family_runner,
                                     make_prompts, parametrized_family, reference, requantized_copy, run_family,
                                     run_family_tensor_parallel, save_tiny_family, tiny_family)
from llmbus.testing.runner_driver import Request, drive
from llmbus.workers.kernels import bindings


def _longrope(rotary_dim: int, original: int) -> dict:
    half = rotary_dim // 2
    return dict(original_max_position_embeddings=original, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[2.0 ** i for i in range(half)]))


FAMILIES = {
    # One K/V head for four query heads (multi-query attention, as Gemma's small models and Falcon have):
    # batch-1 steps have fewer (kv head, row) pairs than threads, whose attention scratch is one slot a thread.
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # heads wider than hidden / heads, as Qwen3's configs have
    # The mixed batch stays within original_max_position_embeddings: short factors, and the attention
    # factor sqrt(1 + ln 4 / ln 64) from max_position_embeddings / original = 4.
    "phi3": ("Phi3Config", _longrope(16, 64)),
    # Local, global, local layers (the window of 8 well inside the longer prompts), linear scaling on the
    # global layers' RoPE, soft-capped logits, query_pre_attn_scalar unlike head_dim.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    # Gemma 2's own layer order (local first), a score cap low enough to bend these scores (its own is 50), and
    # untied embeddings (tied ones make random weights repeat the last token)
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0, tie_word_embeddings=False)),
}
# Partial rotation (half of each 16-wide head) and an original length of 16 that prompts and generations
# cross, so long factors are used.
PHI3_PARTIAL = dict(**_longrope(8, 16), partial_rotary_factor=0.5)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return parametrized_family(request, tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def runner(family):
    return family_runner(family[1])


def test_matches_transformers_through_fused_and_torch_layers(family, runner):
    name, _, prompts, ref = family
    if name in ("qwen3", "gemma3"):
        assert runner.model.layers[0].attention.q_norm is not None
    if name == "phi3":
        assert runner.model.rotary.rope_type == "longrope" and runner.model.rotary.attention_factor > 1
    if name in ("gemma3", "gemma2"):
        assert runner.model.config.sliding_windows == (8, None, 8) and runner.model.fused_decode is None
    if name == "gemma2":
        assert runner.model.layers[0].attention.q_norm is None
        assert runner.model.attention_backend.softcaps == (2.0, 2.0, 2.0)
    fused = runner.model.fused_decode
    runner.model.fused_decode = None
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    if fused is None:  # Gemma's layer is not decode_layer.c's; the others' is, where the library builds
        assert name in ("gemma3", "gemma2") or bindings.library() is None
        return
    ran = []
    fused.run = lambda *args, run=fused.run: ran.append(run(*args)) or ran[-1]
    runner.model.fused_decode = fused
    assert_matches_reference(ref, prompts, run_family(runner, prompts))
    assert sum(ran) >= 5, "the fused layer took no step"


def test_speculative_rows_match_transformers(family, runner):
    _, _, prompts, ref = family
    assert_speculation_matches_reference(runner, prompts, ref)


def test_tensor_parallel_2_matches_transformers(family, tmp_path):
    """The multi-query Llama's one K/V head is on both ranks (replicated), each rank's query heads reading it."""
    name, path, prompts, ref = family
    assert_matches_reference(ref, prompts, run_family_tensor_parallel(path, prompts, str(tmp_path)))


def test_key_value_heads_are_replicated_where_ranks_outnumber_them(tmp_path):
    """Two K/V heads over four ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1, each beside the query
    heads that read it (rank r's two of the eight); three K/V heads over two ranks neither split nor
    replicate evenly, and the load says so."""
    import torch
    import transformers
    from llmbus.workers.loader import CheckpointReader, read_config
    from llmbus.workers.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    hf_config, reader = read_config(str(tmp_path)), CheckpointReader(str(tmp_path))
    head_dim = 8
    for rank in range(4):
        model = LlamaForCausalLM.from_checkpoint(hf_config, reader, rank=rank, world_size=4, dtype=torch.float32,
                                                 device=torch.device("cpu"))
        assert model.num_local_kv_heads == 1
        qkv = model.layers[0].attention.qkv(torch.eye(64)).T  # the fused projection's rows, however packed
        queries, keys, values = qkv.split((2 * head_dim, head_dim, head_dim))
        kv_rows = slice(rank // 2 * head_dim, (rank // 2 + 1) * head_dim)
        assert torch.equal(queries, reader.read("model.layers.0.self_attn.q_proj.weight")[rank * 16:(rank + 1) * 16])
        assert torch.equal(keys, reader.read("model.layers.0.self_attn.k_proj.weight")[kv_rows])
        assert torch.equal(values, reader.read("model.layers.0.self_attn.v_proj.weight")[kv_rows])
    with pytest.raises(ValueError, match=r"key/value heads \(3\) to divide it or be divisible by it"):
        LlamaForCausalLM.from_checkpoint({**hf_config, "num_key_value_heads": 3, "num_attention_heads": 6}, reader,
                                         rank=0, world_size=2, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)  # int8 on Qwen3 here, on the MoEs in test_family_moe
def test_qwen3_int8_matches_transformers_on_requantized_weights(family, tmp_path):
    _, path, prompts, _ = family
    requantized = requantized_copy(path, str(tmp_path / "int8"), "int8")
    runner = family_runner(path, quantize="int8")
    assert "int8" in runner.model.weight_summary
    assert_matches_reference(reference(requantized, prompts), prompts, run_family(runner, prompts),
                             logprob_atol=1e-3)


def test_phi3_long_factors_and_partial_rotation_match_transformers(tmp_path):
    """One sequence at a time, unchunked, as transformers' generate runs: prompts longer than the original
    length take the long factors from their first token and match to the end; shorter ones match until
    their generation crosses it. There transformers' Phi-3 drops its cache and recomputes the whole sequence
    with the long factors; we keep the keys computed so far (see models/rotary.py)."""
    path = str(tmp_path / "partial")
    config = save_tiny_family(path, "Phi3Config", seed=1, **PHI3_PARTIAL)  # seed 0 has a near tie
    original = config.rope_parameters["original_max_position_embeddings"]
    prompts = make_prompts(config.vocab_size)
    ref = reference(path, prompts)
    runner = family_runner(path)
    assert runner.model.rotary.rotary_dim == 8 and runner.model.fused_decode is None
    long_prompts = 0
    for i, prompt in enumerate(prompts):
        result = drive(runner, [Request(rid="solo", prompt=prompt)])["solo"]
        # token j comes from position len(prompt) - 1 + j; the first past the original length switches
        compared = len(result.tokens) if len(prompt) > original else original + 1 - len(prompt)
        long_prompts += len(prompt) > original
        assert result.tokens[:compared] == ref.tokens[i][:compared], f"prompt {i} (length {len(prompt)})"
    assert long_prompts >= 2


def test_multimodal_gemma3_serves_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (model_type gemma3, language_model.* weights beside a
    vision tower): its text model serves text prompts as transformers' multimodal model answers them."""
    text = {key: value for key, value in FAMILIES["gemma3"][1].items()}
    text.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                vocab_size=509, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    path, prompts, ref = tiny_family(str(tmp_path / "gemma3"), "Gemma3Config", text_config=text,
                                     vision_config=vision, mm_tokens_per_image=4, image_token_index=506,
                                     boi_token_index=507, eoi_token_index=508)
    runner = family_runner(path)
    assert runner.model.config.model_type == "gemma3_text"
    # the context the server offers comes from the text config too (config.json has none at its top)
    assert config_max_positions(read_config(Path(path) / "config.json")) == runner.max_position_embeddings == 256
    assert_matches_reference(ref, prompts, run_family(runner, prompts))



def test_gemma3_configs_before_layer_types_read_as_transformers_reads_them():
    """Hub configs written before transformers 5: rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the local ones, sliding_window_pattern instead of layer_types."""
    import transformers

    from llmbus.workers.models.gemma3 import Gemma3ForCausalLM

    old = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=5, num_attention_heads=2,
               num_key_value_heads=1, head_dim=4, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=16,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=2, query_pre_attn_scalar=4)
    expected = transformers.Gemma3TextConfig(**old)
    ours = Gemma3ForCausalLM.make_config({"model_type": "gemma3_text", **old})
    assert ours.sliding_windows == tuple(expected.sliding_window if kind == "sliding_attention" else None
                                         for kind in expected.layer_types)
    rope = expected.rope_parameters
    assert ours.local_rope_theta == rope["sliding_attention"]["rope_theta"]
    assert ours.rope_theta == rope["full_attention"]["rope_theta"]
    assert ours.rope_scaling == {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch_sdpa"])
def test_longrope_sequences_side_by_side_rotate_as_alone(backend, tmp_path):
    """LongRoPE chooses a sequence's factors by its last position in the step. Two sequences side by side whose
    positions continue each other (A's prompt at 0..5, then B decoding at 6; A decoding at 5, B at 6) stay two:
    with an original length of 6, A's rows take the short factors as they do alone, and A's logits equal its
    step alone."""
    import torch

    from llmbus.bus.messages import SamplingParams
    from llmbus.workers.model_runner import ModelRunner, SeqInput

    save_tiny_family(str(tmp_path), "Phi3Config", **_longrope(16, 6))
    runner = ModelRunner(str(tmp_path), block_size=4, num_blocks=16, attention_backend=backend)

    def seq(rid, tokens, computed, table):
        return SeqInput(rid=rid, token_ids=tokens, num_computed=computed, block_table=table, sample=True,
                        sampling=SamplingParams())

    a_prompt, b_prompt = list(range(3, 9)), list(range(20, 26))
    with torch.inference_mode():
        runner._forward([seq("b", b_prompt, 0, [4, 5])], runner.kv_cache)
        alone = runner._forward([seq("a", a_prompt, 0, [0, 1])], runner.kv_cache).clone()
        beside = runner._forward([seq("a", a_prompt, 0, [0, 1]), seq("b", [30], 6, [4, 5])], runner.kv_cache)
        torch.testing.assert_close(beside[0], alone[0])
        a_decode = seq("a", [40], 5, [0, 1])  # overwrites A's last prompt token's K/V with this token's
        alone = runner._forward([a_decode], runner.kv_cache).clone()
        beside = runner._forward([a_decode, seq("b", [30], 6, [4, 5])], runner.kv_cache)
        torch.testing.assert_close(beside[0], alone[0])


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch_sdpa"])
def test_longrope_prompt_longer_than_the_original_length_rotates_alike_in_chunks(backend, tmp_path):
    """transformers prefills a prompt in one go, so a prompt past the original length takes the long factors from
    its first token; chunked (a prefill budget smaller than the prompt), its first chunks, which end within the
    original length, must take them too: the logits after the last chunk equal those of the prompt in one step,
    and so do a decode's after them. A prompt within the original length is unchanged by its chunking."""
    import torch

    from llmbus.bus.messages import SamplingParams
    from llmbus.workers.model_runner import ModelRunner, SeqInput

    save_tiny_family(str(tmp_path), "Phi3Config", **_longrope(16, 6))
    runner = ModelRunner(str(tmp_path), block_size=4, num_blocks=16, attention_backend=backend)
    assert runner.rope_split_tokens == 6  # what WorkerReady tells the scheduler's prefix cache

    def seq(tokens, computed, table, prompt_len):
        return SeqInput(rid="p", token_ids=tokens, num_computed=computed, block_table=table, sample=True,
                        sampling=SamplingParams(), prompt_len=prompt_len)

    for prompt in (list(range(3, 12)), list(range(3, 8))):  # 9 tokens past the original 6; 5 within it
        table = [0, 1, 2]
        with torch.inference_mode():
            whole = runner._forward([seq(prompt, 0, table, len(prompt))], runner.kv_cache).clone()
            decode_whole = runner._forward([seq([40], len(prompt), table, len(prompt))], runner.kv_cache).clone()
            # (the chunks write the same slots again: nothing of the whole prompt's K/V is read)
            for start in range(0, len(prompt), 4):
                chunked = runner._forward([seq(prompt[start:start + 4], start, table, len(prompt))], runner.kv_cache)
            chunked = chunked.clone()
            decode_chunked = runner._forward([seq([40], len(prompt), table, len(prompt))], runner.kv_cache)
        # On AVX2 the 9-token step multiplies through gemm.c and its 4-token chunks through the GEMV: rounding
        # moves logits of ~8 by up to 2.4e-5; a chunk rotated with the short factors moves them by ~1e-1.
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-4, msg=f"prompt of {len(prompt)}")
        torch.testing.assert_close(decode_chunked, decode_whole, rtol=1e-5, atol=1e-4,
                                   msg=f"decode after a prompt of {len(prompt)}")
