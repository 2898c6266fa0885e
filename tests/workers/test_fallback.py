"""The transformers fallback (``workers/models/hf_fallback.py``) against transformers itself.

Model types without a native implementation run through transformers' modeling code with a registered
paged attention function. Tiny GPT-2 (learned absolute positions) and GPT-NeoX (partial rotary)
checkpoints go through ``ModelRunner`` in a continuous batch and must give transformers' greedy tokens
and log-probabilities; so do Gemma 2 (soft-capped attention scores) and gpt-oss (attention sinks, alternating
sliding windows, a mixture of experts), whose attention shapings the backends apply, and gpt-oss's MXFP4
checkpoints, read as transformers reads them. (Both are native too: test_family_dense.py, test_gpt_oss.py;
here they run on the fallback, as a model released after this llmbus would.) One GPT-2 serves through the
whole ``llmbus up`` stack.

As in ``test_model_runner.py``, weights are re-initialised with a wide normal and every compared
reference step must have a top-1/top-2 logit margin above ``MIN_MARGIN``, so a match is meaningful.
"""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llmbus.testing import Server
from llmbus.testing.http import post
from llmbus.testing.prequantized import write_mxfp4
from llmbus.testing.runner_driver import Request, drive
from llmbus.workers.model_runner import ModelRunner
from llmbus.workers.models.hf_fallback import HFFallbackForCausalLM

BLOCK_SIZE = 4  # small, so sequences span many non-contiguous blocks
NUM_BLOCKS = 96
MAX_NEW_TOKENS = 10
MIN_MARGIN = 1e-3
WEIGHT_STD = 0.3
VOCAB_SIZE = 500
# (prompt length, arrival step, prefill chunk): the 37-token prompt's first chunk runs alone (a step that
# samples nothing), its second beside three fresh prompts (a 1-token one in the decode group), and the
# 23-token prompt arrives while the others decode.
WORKLOAD = ((37, 0, 16), (1, 1, None), (4, 1, None), (9, 1, None), (23, 3, None))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny_config(family: str, vocab_size: int, **special_tokens):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=vocab_size,
                                       **special_tokens)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, max_position_embeddings=256, rotary_pct=0.5,
                                          vocab_size=vocab_size, **special_tokens)
    if family == "gemma2":
        # A cap of 2 bends these scores (Gemma 2's own 50 would leave random weights' scores almost straight);
        # untied and without the final cap, random weights do not just repeat the last token.
        return transformers.Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                         max_position_embeddings=256, sliding_window=8, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=None, query_pre_attn_scalar=16,
                                         tie_word_embeddings=False, vocab_size=vocab_size, **special_tokens)
    if family == "gpt_oss":
        return transformers.GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"],
                                         vocab_size=vocab_size, **special_tokens)
    raise ValueError(family)


def _save_tiny(path, config) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, WEIGHT_STD)
            elif name.endswith(".sinks"):  # wide enough to take a visible share of each row's softmax
                param.normal_(0.0, 2.0)
    model.save_pretrained(path)


def _greedy(model, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' float32 greedy continuation of ``prompt`` (EOS ignored) and the log_softmax of each
    chosen token; every step's top-1/top-2 margin must be decisive."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0].float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "reference margins too thin to compare tokens"
    tokens = out.sequences[0, len(prompt):]
    return tokens.tolist(), torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox"])
def batched(request, tmp_path_factory):
    """A tiny checkpoint of the family, transformers' greedy references, and the same prompts run through
    ModelRunner as one continuous batch."""
    import transformers

    path = str(tmp_path_factory.mktemp(request.param))
    _save_tiny(path, _tiny_config(request.param, VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None))
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n, _, _ in WORKLOAD]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = [_greedy(model, prompt) for prompt in prompts]
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=300)
    runner.warmup()  # uses the pool as scratch: the batch below also checks that this is harmless
    requests = [Request(rid=f"r{i}", prompt=p, arrival_step=arrival, prefill_chunk=chunk,
                        max_new_tokens=MAX_NEW_TOKENS)
                for i, (p, (_, arrival, chunk)) in enumerate(zip(prompts, WORKLOAD))]
    results = drive(runner, requests)
    return path, runner, references, [results[f"r{i}"] for i in range(len(prompts))]


def test_other_model_types_take_the_fallback_with_their_shapes(batched):
    _, runner, _, _ = batched
    model = runner.model
    assert isinstance(model, HFFallbackForCausalLM)
    assert (model.num_layers, model.num_local_kv_heads, model.config.head_dim) == (2, 4, 16)
    assert model.max_position_embeddings == runner.max_position_embeddings == 256  # n_positions for GPT-2
    assert model.config.vocab_size == VOCAB_SIZE


def test_greedy_continuous_batching_matches_transformers(batched):
    _, _, references, results = batched
    for i, ((expected, _), result) in enumerate(zip(references, results)):
        assert result.tokens == expected, f"prompt {i} (length {len(result.prompt)})"


def test_logprobs_match_transformers_log_softmax(batched):
    _, _, references, results = batched
    for (_, expected), result in zip(references, results):
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, rtol=0, atol=1e-4)


def test_tensor_parallelism_is_refused_clearly(batched):
    path = batched[0]
    with pytest.raises(ValueError, match=r"runs through the transformers fallback, which does not support "
                                         r"tensor parallelism; use --gpus 1"):
        ModelRunner(path, rank=0, world_size=2, num_blocks=8)


@pytest.mark.parametrize("family,softcaps,sinks", [("gemma2", (2.0, 2.0), False), ("gpt_oss", (None, None), True)])
def test_soft_caps_and_sinks_match_transformers(family, softcaps, sinks, tmp_path, monkeypatch):
    """The probe finds each layer's soft cap or sinks and hands them to the attention backend, which applies
    them to every kind of row: a chunked prompt, prompts beside decodes, a preempted and recomputed sequence."""
    import transformers

    from llmbus.workers import loader

    monkeypatch.setattr(loader, "native_builders", dict)

    _save_tiny(str(tmp_path), _tiny_config(family, VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                                           pad_token_id=None))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n, _, _ in WORKLOAD]
    references = [_greedy(model, prompt) for prompt in prompts]
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=300)
    assert isinstance(runner.model, HFFallbackForCausalLM)
    backend = runner.model.attention_backend
    assert backend.softcaps == softcaps and backend.windows == (8, None)
    assert [s is not None for s in backend.sinks] == [sinks, sinks]
    if sinks:
        torch.testing.assert_close(backend.layer_sinks(1), model.model.layers[1].self_attn.sinks, rtol=0, atol=0)
    requests = [Request(rid=f"r{i}", prompt=p, arrival_step=arrival, prefill_chunk=chunk,
                        max_new_tokens=MAX_NEW_TOKENS)
                for i, (p, (_, arrival, chunk)) in enumerate(zip(prompts, WORKLOAD))]
    requests[4].preempt_after = 3
    results = drive(runner, requests)
    assert results["r4"].preemptions == 1
    for i, (expected, logprobs) in enumerate(references):
        assert results[f"r{i}"].tokens == expected, f"prompt {i} (length {len(prompts[i])})"
        torch.testing.assert_close(torch.tensor(results[f"r{i}"].logprobs), logprobs, rtol=0, atol=1e-4)


def _mxfp4_reference(path):
    """transformers' own reading of an MXFP4 checkpoint: its experts expanded at load."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_experts_are_read_as_transformers_reads_them(tmp_path, monkeypatch):
    """gpt-oss's published form on the fallback: transformers expands the experts' MXFP4 blocks to the model's
    dtype. The written blocks hold exactly the values the reference copy holds (so the layout is transformers'),
    and the served tokens are transformers' on the same checkpoint. A native model's MXFP4 checkpoint other than
    gpt-oss's is refused."""
    import transformers

    from llmbus.workers import loader

    _save_tiny(str(tmp_path / "float"), _tiny_config("gpt_oss", VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                                                     pad_token_id=None))
    write_mxfp4(str(tmp_path / "float"), str(tmp_path / "mxfp4"), str(tmp_path / "held"))
    model = _mxfp4_reference(tmp_path / "mxfp4")
    held = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "held"), dtype=torch.float32)
    experts, held_experts = model.model.layers[1].mlp.experts, held.model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(experts, name), getattr(held_experts, name)), name
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (19, 3)]
    with monkeypatch.context() as patch:
        patch.setattr(loader, "native_builders", dict)
        runner = ModelRunner(str(tmp_path / "mxfp4"), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    served = runner.model.model.model.layers[1].mlp.experts
    assert torch.equal(served.down_proj, experts.down_proj)
    results = drive(runner, [Request(rid=f"r{i}", prompt=p, max_new_tokens=MAX_NEW_TOKENS)
                             for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].tokens == _greedy(model, prompt)[0]

    native = tmp_path / "llama-mxfp4"
    native.mkdir()
    (native / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="a mxfp4 checkpoint is read for gpt-oss's experts"):
        ModelRunner(str(native), num_blocks=8)


def test_sliding_window_layers_match_transformers(tmp_path):
    import transformers

    config = transformers.Starcoder2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                           sliding_window=8, vocab_size=VOCAB_SIZE, bos_token_id=None,
                                           eos_token_id=None, pad_token_id=None)
    _save_tiny(str(tmp_path), config)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (13, 5)]  # past the window, and within
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    results = drive(runner, [Request(rid=f"w{i}", prompt=p, max_new_tokens=MAX_NEW_TOKENS, prefill_chunk=6)
                             for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[f"w{i}"].tokens == _greedy(model, prompt)[0]


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
     "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]},
], ids=["dynamic", "longrope"])
def test_length_picked_rope_rotates_each_token_as_for_its_sequence_alone(rope, tmp_path):
    """transformers' dynamic NTK and LongRoPE modules pick their base or factors by the longest position of a
    call, which on a packed step is a neighbour's: each token is rotated as generate rotates it for its sequence
    alone, a prompt token by the prompt's length (here in chunks, beside decodes, preempted and resumed) and a
    generated one by its position. (A dynamic module keeps the longest length it has seen: each reference is a
    fresh model's.)"""
    import transformers

    config = transformers.Olmo2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=16,
                                      vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                      rope_parameters=rope)
    _save_tiny(str(tmp_path), config)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (37, 3, 9, 23)]
    expected = [_greedy(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
                        .eval(), prompt)[0] for prompt in prompts]
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    assert runner.rope_split_tokens == 16 and runner.rope_split_by_length == (rope["rope_type"] == "dynamic")
    requests = [Request(rid=f"r{i}", prompt=p, max_new_tokens=MAX_NEW_TOKENS, arrival_step=i, prefill_chunk=8)
                for i, p in enumerate(prompts)]
    requests[3].preempt_after = 4
    results = drive(runner, requests)
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].tokens == expected[i], f"prompt {i} (length {len(prompt)})"
    assert results["r3"].preemptions == 1


def test_rope_override_reaches_the_fallbacks_config(tmp_path):
    """--rope-scaling linear --rope-factor 2 on a GPT-NeoX (partial rotation): transformers' own modeling runs
    on the config ``with_rope_override`` writes, so it answers as transformers loaded with that config."""
    import transformers

    from llmbus.bus.model_files import with_rope_override

    _save_tiny(str(tmp_path), _tiny_config("gpt_neox", VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                                           pad_token_id=None))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    overridden = type(config).from_dict(with_rope_override(config.to_dict(), ("linear", 2.0)))
    assert overridden.rope_parameters["partial_rotary_factor"] == 0.5
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), config=overridden, dtype=torch.float32)
    prompt = [random.Random(3).randrange(VOCAB_SIZE) for _ in range(11)]
    runner = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, rope_scaling=("linear", 2.0))
    assert runner.max_position_embeddings == 512
    tokens = drive(runner, [Request(rid="r", prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)])["r"].tokens
    assert tokens == _greedy(model.eval(), prompt)[0]
    plain = ModelRunner(str(tmp_path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    assert drive(plain, [Request(rid="r", prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)])["r"].tokens != tokens


def test_models_whose_attention_cannot_be_paged_fail_at_load(tmp_path):
    import transformers

    # BLOOM adds ALiBi inside its own attention code, never calling the attention interface.
    config = transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"model_type 'bloom' cannot run through the transformers fallback: "
                                         r"its attention does not go through transformers' AttentionInterface"):
        ModelRunner(str(tmp_path), num_blocks=8)


# -- the whole stack ---------------------------------------------------------------------------------

E2E_PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
E2E_MAX_NEW = 12


@pytest.fixture(scope="module")
def gpt2_folder(tiny_model_dir, tmp_path_factory):
    """A tiny GPT-2 with the demo model's tokenizer (vocabulary 4096; <s>=0, </s>=1, <pad>=2)."""
    import transformers

    path = tmp_path_factory.mktemp("gpt2-served")
    special = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    _save_tiny(path, _tiny_config("gpt2", 4096, **special))
    transformers.GenerationConfig(**special).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_model_dir / name, path / name)
    return path


def test_served_end_to_end_matches_transformers(gpt2_folder):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2_folder, dtype=torch.float32).eval()
    expected = [_greedy(model, tokenizer(p).input_ids, E2E_MAX_NEW) for p in E2E_PROMPTS]

    server = Server(["--model-id", str(gpt2_folder), "--dtype", "float32", "--max-total-tokens", "256",
                     "--max-input-tokens", "128", "--max-batch-prefill-tokens", "256", "--num-blocks", "64",
                     "--block-size", "16"])
    try:
        def generate(prompt: str) -> dict:
            status, _, body = post(f"{server.url}/generate", {
                "inputs": prompt, "parameters": {"max_new_tokens": E2E_MAX_NEW, "details": True}})
            assert status == 200, body
            return body

        with ThreadPoolExecutor(len(E2E_PROMPTS)) as pool:
            bodies = list(pool.map(generate, E2E_PROMPTS))
    finally:
        code = server.stop()
    assert code == 0, server.stderr.text[-3000:]
    assert "transformers fallback" in server.stderr.text
    for prompt, body, (tokens, logprobs) in zip(E2E_PROMPTS, bodies, expected):
        got = [t["id"] for t in body["details"]["tokens"]]
        # The server stops at EOS (the reference does not): compare what it generated.
        assert got == tokens[:len(got)], prompt
        assert body["details"]["finish_reason"] == ("length" if len(got) == E2E_MAX_NEW else "eos_token")
        assert body["generated_text"] == tokenizer.decode(got, skip_special_tokens=True)
        torch.testing.assert_close(torch.tensor([t["logprob"] for t in body["details"]["tokens"]]),
                                   logprobs[:len(got)], rtol=0, atol=1e-4)
