"""Decode attention that keeps its gathered K/V between steps (the mirror) attends exactly as gathering
every step does: across steps that outgrow the mirror's room, sequences joining and leaving, a reordered
batch, a prompt chunk beside the decodes, and a forgotten mirror; with torch's matmuls reading the mirror
and with the C kernel (cpu_kernels.py) where it builds."""

import pytest
import torch

from llmbus.workers import attention
from llmbus.workers.attention import TorchSDPABackend
from llmbus.workers.cpu_kernels import decode_attention_kernel
from llmbus.workers.kv_cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4


def _cache() -> PagedKVCache:
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=2, num_blocks=200, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    cache.key.normal_()
    cache.value.normal_()
    return cache


@pytest.mark.parametrize("kernel", [None, decode_attention_kernel()], ids=["torch", "c-kernel"])
def test_mirrored_decode_equals_gathered(monkeypatch, kernel):
    monkeypatch.setattr(attention, "MIRROR_SLACK", 4)  # outgrown every few steps
    mirrored_cache, gathered_cache = _cache(), _cache()
    mirrored, gathered = TorchSDPABackend([None, 3], kernel), TorchSDPABackend([None, 3])
    lengths = {"a": 5, "b": 9, "c": 1, "d": 12}
    tables = {rid: list(range(i * 40, i * 40 + 40)) for i, rid in enumerate(lengths)}
    # Each step: the sequences (in order) and their query lengths; a 3-token query is a prompt chunk.
    schedule = ([{"a": 1, "b": 1, "c": 1}] * 7 + [{"a": 1, "b": 1, "c": 1, "d": 3}] * 2
                + [{"a": 1, "b": 1, "c": 1, "d": 1}] * 3 + [{"b": 1, "c": 1, "d": 1}] * 3
                + [{"d": 1, "b": 1, "c": 1}] * 3 + ["forget"] + [{"d": 1, "b": 1, "c": 1}] * 2)
    reused = 0
    for step in schedule:
        if step == "forget":
            mirrored.forget()
            continue
        rids = list(step)
        args = dict(query_lens=[step[r] for r in rids], num_computed=[lengths[r] for r in rids],
                    block_tables=[tables[r][:-(-(lengths[r] + step[r]) // BLOCK_SIZE)] for r in rids],
                    device=torch.device("cpu"))
        before = mirrored._mirror
        meta_m = mirrored.build_metadata(kv_cache=mirrored_cache, seq_ids=rids, **args)
        meta_g = gathered.build_metadata(kv_cache=gathered_cache, **args)
        reused += before is not None and any(g.mirror is before for g in meta_m.groups)
        total = sum(step.values())
        for layer in range(2):
            q = torch.randn(total, NUM_HEADS, HEAD_DIM)
            k, v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM), torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
            out_m = mirrored.forward(layer, q, k, v, mirrored_cache, meta_m, scale=HEAD_DIM ** -0.5)
            out_g = gathered.forward(layer, q, k, v, gathered_cache, meta_g, scale=HEAD_DIM ** -0.5)
            torch.testing.assert_close(out_m, out_g, rtol=1e-5, atol=1e-5)
        for r in rids:
            lengths[r] += step[r]
    assert reused >= 8  # the mirror really was carried over most steps
    torch.testing.assert_close(mirrored_cache.key, gathered_cache.key)
