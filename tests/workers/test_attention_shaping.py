"""Soft-capped scores (Gemma 2) and attention sinks (gpt-oss) in every backend, against transformers' own eager
attention functions for those models: over steps of prompts, prompt chunks over cached blocks and decodes
beside them, with GQA and a sliding window, per layer (a capped layer, a layer with sinks and a window, a plain
one), in float32, bfloat16 and a float16 pool under float32 attention. The CPU backend is checked with its C
kernel on decodes and, with ``prompt_rows``, on every row; its AVX2 (head dim 64) and portable (head dim 40)
loops both. The Triton backend runs the same steps in Triton's interpreter (``test_triton_attention``'s way)."""

from __future__ import annotations

import types

import pytest
import torch

from llmbus.workers.attention import CPUKernelBackend, TorchSDPABackend
from llmbus.workers.attention.decode_kernel import decode_attention_kernel
from llmbus.workers.kv_cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS = 4, 2
SOFTCAP, WINDOW = 3.0, 5
KERNEL = decode_attention_kernel()
# Each step: the sequences in order with their query lengths. "b" is prompted in two chunks; "c" joins while
# the others decode; the 3-token rows are speculative.
SCHEDULE = ([{"a": 7, "b": 6}, {"a": 1, "b": 11}, {"a": 1, "b": 1, "c": 9}] + [{"a": 1, "b": 1, "c": 1}] * 4
            + [{"a": 3, "b": 1, "c": 1}, {"c": 1, "b": 1}])


def _layers(num_heads: int = NUM_HEADS):
    """(windows, softcaps, sinks) of three layers: capped; sinks and a window; plain."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(5)) * 2
    return [None, WINDOW, None], [SOFTCAP, None, None], [None, sinks, None]


def _reference(layer: int, query, keys, values, positions, scale, layers) -> torch.Tensor:
    """transformers' eager attention of the model whose shaping ``layer`` has, for one sequence: ``query [q,
    Hq, D]`` at ``positions`` over all of its ``keys``/``values [ctx, Hkv, D]``."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    windows, softcaps, sinks = layers
    key_pos = torch.arange(keys.shape[0])
    visible = key_pos[None, :] <= positions[:, None]
    if windows[layer] is not None:
        visible &= key_pos[None, :] > positions[:, None] - windows[layer]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=NUM_HEADS // NUM_KV_HEADS, training=False,
                                   sinks=sinks[layer])
    q, k, v = (t.float().transpose(0, 1)[None] for t in (query, keys, values))
    if sinks[layer] is not None:
        out, _ = gpt_oss_eager(module, q, k, v, mask, scaling=scale)
    else:
        out, _ = gemma2_eager(module, q, k, v, mask, scaling=scale, softcap=softcaps[layer])
    return out[0]


def _cache(dtype, block_size, head_dim) -> PagedKVCache:
    return PagedKVCache(num_layers=3, num_blocks=64, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                        head_dim=head_dim, dtype=dtype, device="cpu",
                        compute_dtype=torch.float32 if dtype == torch.float16 else dtype)


def run_schedule(backend, cache: PagedKVCache, layers, tolerance: float, schedule=SCHEDULE) -> list:
    """``schedule`` through ``backend`` over ``cache``, each layer's output compared with ``_reference`` over
    every K/V its sequences have had; the steps' metadata."""
    block_size, head_dim, activations = cache.block_size, cache.head_dim, cache.compute_dtype
    generator = torch.Generator().manual_seed(0)
    lengths = {rid: 0 for step in schedule for rid in step}
    history = {rid: [([], []) for _ in range(3)] for rid in lengths}
    tables = {rid: list(range(i * 16, i * 16 + 16))[::-1] for i, rid in enumerate(lengths)}  # scattered blocks
    scale = head_dim ** -0.5
    metas = []
    for step in schedule:
        rids = list(step)
        meta = backend.build_metadata(
            query_lens=[step[r] for r in rids], num_computed=[lengths[r] for r in rids],
            block_tables=[tables[r][:-(-(lengths[r] + step[r]) // block_size)] for r in rids], kv_cache=cache,
            device=torch.device("cpu"))
        metas.append(meta)
        total = sum(step.values())
        for layer in range(3):
            # wide queries, so that the cap bends the scores
            q = (torch.randn(total, NUM_HEADS, head_dim, generator=generator) * 3).to(activations)
            k, v = (torch.randn(total, NUM_KV_HEADS, head_dim, generator=generator).to(activations)
                    for _ in range(2))
            out = backend.forward(layer, q, k, v, cache, meta, scale=scale)
            row = 0
            for r in rids:
                n = step[r]
                keys, values = history[r][layer]
                stored = k[row:row + n].to(cache.key.dtype).to(activations)  # what the pool holds
                keys.append(stored)
                values.append(v[row:row + n].to(cache.key.dtype).to(activations))
                positions = torch.arange(lengths[r], lengths[r] + n)
                expected = _reference(layer, q[row:row + n], torch.cat(keys), torch.cat(values), positions, scale,
                                      layers)
                torch.testing.assert_close(out[row:row + n].float(), expected, rtol=tolerance, atol=tolerance,
                                           msg=lambda m, r=r, layer=layer: f"{r}, layer {layer}: {m}")
                row += n
        for r in rids:
            lengths[r] += step[r]
    return metas


def test_portable_backend_equals_transformers_eager():
    layers = _layers()
    backend = TorchSDPABackend(layers[0], softcaps=layers[1], sinks=layers[2])
    assert backend.shapes_scores and backend.layer_softcap(0) == SOFTCAP and backend.layer_sinks(2) is None
    run_schedule(backend, _cache(torch.float32, 4, 64), layers, 1e-5)


def test_plain_layers_are_not_shaped():
    """A model without caps or sinks keeps SDPA for long queries (its matmul biases only for short ones)."""
    backend = TorchSDPABackend([None, WINDOW, None])
    assert not backend.shapes_scores
    metas = run_schedule(backend, _cache(torch.float32, 4, 64), ([None, WINDOW, None], [None] * 3, [None] * 3),
                         1e-5, [{"a": 12}])
    assert metas[0].groups[0].matmul_biases == ()


@pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is optional")
@pytest.mark.parametrize("dtype,block_size,head_dim,tolerance", [
    (torch.float32, 4, 64, 1e-5), (torch.float32, 16, 40, 1e-5), (torch.float16, 16, 64, 1e-5),
    (torch.bfloat16, 16, 64, 6e-2), (torch.bfloat16, 16, 128, 6e-2), (torch.bfloat16, 16, 40, 6e-2)],
    ids=["f32-avx2", "f32-portable", "f16kv", "bf16-64", "bf16-128", "bf16-portable"])
@pytest.mark.parametrize("prompt_rows", [False, True], ids=["decodes", "prompt-rows"])
def test_cpu_kernel_equals_transformers_eager(dtype, block_size, head_dim, tolerance, prompt_rows):
    if prompt_rows and dtype == torch.bfloat16:
        pytest.skip("prompt rows are float32 steps only")
    layers = _layers()
    backend = CPUKernelBackend(layers[0], KERNEL, prompt_rows=prompt_rows, softcaps=layers[1], sinks=layers[2])
    metas = run_schedule(backend, _cache(dtype, block_size, head_dim), layers, tolerance)
    kinds = {type(g).__name__ for meta in metas for g in meta.groups}
    assert "KernelRows" in kinds  # the C kernel attended


def test_soft_caps_must_be_positive():
    with pytest.raises(ValueError, match="soft caps must be positive"):
        TorchSDPABackend([None], softcaps=[0.0])


@pytest.fixture
def interpreted_triton():
    """The Triton backend's kernels in Triton's interpreter (``test_triton_attention``'s way)."""
    from llmbus.testing.triton_interpret import interpreted_triton_kernels
    from llmbus.workers.attention.triton import load_kernels

    kernels = interpreted_triton_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        assert load_kernels() is kernels
        yield kernels


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)], ids=["f32", "bf16"])
def test_triton_backend_equals_transformers_eager(interpreted_triton, dtype, tolerance):
    """Decode rows of the steps with few sequences split their keys between programs (flash-decoding), whose
    merge adds the sinks; the other steps add them in the one program of a row."""
    from llmbus.workers.attention.triton import TritonAttentionBackend

    layers = _layers()
    backend = TritonAttentionBackend(layers[0], softcaps=layers[1], sinks=layers[2])
    assert interpreted_triton.key_splits(3, NUM_KV_HEADS, 1, torch.device("cpu")) > 1
    run_schedule(backend, _cache(dtype, 16, 64), layers, tolerance)


def test_long_queries_are_shaped_a_slice_at_a_time(monkeypatch):
    """A soft-capped or sinked group's scores are computed a few queries at a time (here two: the bound set to
    two queries' scores over the longest context), with the same results as transformers' in one piece."""
    from llmbus.workers.attention import torch_sdpa

    layers = _layers()
    longest = -(-max(sum(step.get(r, 0) for step in SCHEDULE) for r in "abc") // 4) * 4  # blocks of 4
    per_query = 4 * NUM_KV_HEADS * (NUM_HEADS // NUM_KV_HEADS) * longest
    monkeypatch.setattr(torch_sdpa, "SHAPED_SCORES_BYTES", 2 * per_query)
    backend = TorchSDPABackend(layers[0], softcaps=layers[1], sinks=layers[2])
    cache = _cache(torch.float32, 4, 64)
    run_schedule(backend, cache, layers, 1e-5)
    # one 12-token prompt (12 blocks of context at most): six slices of two queries, two products each
    meta = backend.build_metadata(query_lens=[12], num_computed=[0], block_tables=[[60, 61, 62]], kv_cache=cache,
                                  device=torch.device("cpu"))
    monkeypatch.setattr(torch_sdpa, "SHAPED_SCORES_BYTES", 2 * 4 * NUM_KV_HEADS * (NUM_HEADS // NUM_KV_HEADS) * 12)
    calls = []
    monkeypatch.setattr(torch_sdpa.torch, "bmm", lambda *a, bmm=torch.bmm, **k: calls.append(1) or bmm(*a, **k))
    q, k = torch.randn(12, NUM_HEADS, 64), torch.randn(12, NUM_KV_HEADS, 64)
    backend.forward(0, q, k, k, cache, meta, scale=0.125)
    assert len(calls) == 2 * 6
