"""How a GPU rank sizes its KV pool, checked without a GPU: the arithmetic is a pure function, and the
warmup that measures its inputs runs on CPU with torch's CUDA memory functions patched."""

from __future__ import annotations

import pytest
import torch

from llmbus.workers.kv_cache import bytes_per_block
from llmbus.workers.memory_budget import CUDA_KV_HEADROOM, WarmupOutOfMemory, cuda_kv_blocks
from llmbus.workers.model_runner import ModelRunner

GIB, MIB = 1 << 30, 1 << 20


def test_the_arithmetic():
    common = dict(free_bytes=40 * GIB, total_bytes=80 * GIB, memory_fraction=1.0, block_bytes=GIB // 64)
    # Without activations or sampling: the headroom's share of what is free, less the padding block.
    assert cuda_kv_blocks(**common, activation_peak=0, sampling_bytes=0) == int(40 * GIB * CUDA_KV_HEADROOM) // (
        GIB // 64) - 1
    # The largest step's activations and sampling's buffers come off the budget ...
    budget = int(40 * GIB * CUDA_KV_HEADROOM) - 3 * GIB - GIB // 2
    assert cuda_kv_blocks(**common, activation_peak=3 * GIB, sampling_bytes=GIB // 2) == budget // (GIB // 64) - 1
    # ... a draft model's pool has as many blocks as the target's, each block costing both ...
    with_draft = cuda_kv_blocks(**common, activation_peak=3 * GIB, sampling_bytes=GIB // 2,
                                draft_block_bytes=GIB // 256)
    assert with_draft == budget // (GIB // 64 + GIB // 256) - 1
    assert (with_draft + 1) * (GIB // 64 + GIB // 256) <= budget, "both pools, padding blocks included, fit"
    # ... and the fraction leaves the rest of the device's memory to others.
    assert cuda_kv_blocks(**{**common, "memory_fraction": 0.75}, activation_peak=0, sampling_bytes=0) == int(
        20 * GIB * CUDA_KV_HEADROOM) // (GIB // 64) - 1
    assert cuda_kv_blocks(**common, activation_peak=40 * GIB, sampling_bytes=0) == 0, "never negative"


@pytest.fixture
def cuda_memory(monkeypatch):
    """torch.cuda's memory functions, answering from ``state``: ``peaks`` are the successive
    max_memory_allocated readings (the warmup reads sampling's, then the forward pass's)."""
    # a small device, so that the pools the tests allocate (on CPU) stay small
    state = {"allocated": 100 * MIB, "peaks": [], "free": 200 * MIB, "total": GIB, "resets": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peaks"].pop(0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: state.__setitem__("resets", state["resets"] + 1))
    return state


def _deferred(tiny_model_dir, **kwargs) -> ModelRunner:
    """A runner whose pool is left to warmup, as on CUDA without --num-blocks (built on CPU)."""
    runner = ModelRunner(str(tiny_model_dir), num_blocks=4, max_batch_prefill_tokens=32, **kwargs)
    runner.kv_cache, runner.num_blocks = None, 0
    return runner


def test_warmup_sizes_the_pool_from_the_measured_peaks_and_the_draft_s_share(tiny_model_dir, cuda_memory):
    target, draft = _deferred(tiny_model_dir), _deferred(tiny_model_dir)
    target.attach_draft(draft)
    target.cuda_memory_fraction = 0.9
    # the warmup's 32 tokens in 2 blocks of 16 (CPU), and the scratch pool's padding block
    scratch_bytes = bytes_per_block(**target._kv_layout) * 3
    sampling, activations = 20 * MIB, 40 * MIB
    cuda_memory["peaks"] = [100 * MIB + sampling, 100 * MIB + scratch_bytes + activations]
    target.warmup()
    assert cuda_memory["peaks"] == [] and cuda_memory["resets"] == 2, "both peaks measured from a reset"
    expected = cuda_kv_blocks(free_bytes=200 * MIB, total_bytes=GIB, memory_fraction=0.9,
                              activation_peak=activations, sampling_bytes=sampling,
                              block_bytes=bytes_per_block(**target._kv_layout),
                              draft_block_bytes=bytes_per_block(**draft._kv_layout))
    assert target.num_blocks == expected > 0
    assert target.kv_cache.num_blocks == draft.kv_cache.num_blocks == draft.num_blocks == expected
    # the draft's share: without it the target's pool would be twice the size (same model, same blocks)
    alone = _deferred(tiny_model_dir)
    cuda_memory["peaks"] = [100 * MIB + sampling, 100 * MIB + scratch_bytes + activations]
    alone.cuda_memory_fraction = 0.9
    alone.warmup()
    assert alone.num_blocks == cuda_kv_blocks(free_bytes=200 * MIB, total_bytes=GIB, memory_fraction=0.9,
                                              activation_peak=activations, sampling_bytes=sampling,
                                              block_bytes=bytes_per_block(**target._kv_layout))
    assert alone.num_blocks >= 2 * expected


def test_no_room_left_is_a_startup_error_that_names_the_draft(tiny_model_dir, cuda_memory):
    target = _deferred(tiny_model_dir)
    target.attach_draft(_deferred(tiny_model_dir))
    cuda_memory["free"] = 150 * MIB  # the fraction's reserve, the activations and sampling take it all
    cuda_memory["peaks"] = [100 * MIB + 16 * MIB, 100 * MIB + 40 * MIB]
    target.cuda_memory_fraction = 0.9
    with pytest.raises(WarmupOutOfMemory, match="no GPU memory left for the KV cache after warmup: .* sampling "
                                                "16777216 bytes, a draft model's pool"):
        target.warmup()


def test_cuda_warmup_runs_a_chunk_at_full_context(tiny_model_dir, monkeypatch):
    runner = ModelRunner(str(tiny_model_dir), num_blocks=4, block_size=16, max_batch_prefill_tokens=40)
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # only the batch is built: no GPU needed
    seqs = runner._warmup_batch()
    context = runner.max_position_embeddings
    first = seqs[0]
    assert first.num_computed + len(first.token_ids) == context, "the chunk ends at the model's last position"
    assert len(first.block_table) * 16 >= context
    # everything before the chunk reads one shared scratch block; the chunk writes blocks of its own
    shared = first.num_computed // 16
    assert set(first.block_table[:shared]) == {0}
    written = first.block_table[shared:]
    assert len(set(written)) == len(written) and 0 not in written
    assert sum(len(s.token_ids) for s in seqs) == 40
    # the batch is one the model runs (here on CPU): the scratch pool holds its distinct blocks
    monkeypatch.setattr(runner, "device", torch.device("cpu"))
    blocks = max(max(s.block_table) for s in seqs) + 1
    assert blocks <= 2 + 40 // 16 + len(seqs)
    with torch.inference_mode():
        logits = runner._forward(seqs, runner._new_cache(blocks))
    assert logits.shape[0] == len(seqs) and torch.isfinite(logits).all()


def test_cpu_warmup_batch_is_unchanged(tiny_model_dir):
    runner = ModelRunner(str(tiny_model_dir), num_blocks=64, block_size=16, max_batch_prefill_tokens=4096)
    seqs = runner._warmup_batch()
    assert all(s.num_computed == 0 for s in seqs)
    assert [b for s in seqs for b in s.block_table] == list(range(sum(len(s.block_table) for s in seqs)))
    assert sum(len(s.token_ids) for s in seqs) == 256  # CPU_WARMUP_TOKENS
