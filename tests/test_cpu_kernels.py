"""The C decode-attention kernel (workers/decode_attention.c) against a float32 reference written with
torch ops: the attended output, the new K/V it writes into the mirror and the pool, GQA groups, sliding
windows (a first visible key per sequence), both dtypes, and head dims that take the AVX-512 path (64,
128) or the portable one (8). Also: where the kernel cannot be built, attention falls back to torch."""

import pytest
import torch

from llmbus.workers import cpu_kernels

KERNEL = cpu_kernels.decode_attention_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is optional")


def reference(query, keys, values, lens, starts, scale, round_probs):
    """``query [B, Hq, D]`` over ``keys``/``values [Hkv, B, capacity, D]`` -> float32 ``[B, Hq, D]``."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, capacity = keys.shape[0], keys.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.einsum("hbgd,hbjd->hbgj", q, keys.float()) * scale
    position = torch.arange(capacity)[None, :]
    visible = (position < lens[:, None]) & (position >= starts[:, None])
    probs = scores.masked_fill(~visible[None, :, None, :], float("-inf")).softmax(-1)
    if round_probs:  # bf16: probabilities meet V in bf16, as on torch's path
        probs = probs.to(torch.bfloat16).float()
    out = torch.einsum("hbgj,hbjd->hbgd", probs, values.float())
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 12, 4), (128, 4, 4), (8, 6, 2)])
def test_kernel_attends_and_writes_as_reference(dtype, head_dim, num_heads, num_kv_heads):
    torch.manual_seed(0)
    batch, capacity, pool_size = 9, 80, 300
    keys = torch.randn(num_kv_heads, batch, capacity, head_dim).to(dtype)
    values = torch.randn(num_kv_heads, batch, capacity, head_dim).to(dtype)
    lens = torch.tensor([1, 2, 17, 31, 32, 33, 50, 64, 80])
    starts = torch.tensor([0, 1, 0, 5, 16, 0, 33, 40, 0])  # windows: the first visible key of each
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim).to(dtype)  # strided rows, as in the model
    query, new_key = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    new_value = qkv[:, num_heads + num_kv_heads:]
    pool_key, pool_value = torch.zeros(num_kv_heads, pool_size, head_dim, dtype=dtype), torch.zeros(
        num_kv_heads, pool_size, head_dim, dtype=dtype)
    slots = torch.randperm(pool_size)[:batch]

    mirror_key, mirror_value = KERNEL.layout(keys.clone(), values.clone())
    out = KERNEL(query, new_key, new_value, mirror_key, mirror_value, lens, starts, head_dim ** -0.5,
                 pool=(pool_key, pool_value, slots))

    rows = torch.arange(batch)
    keys[:, rows, lens - 1], values[:, rows, lens - 1] = new_key.transpose(0, 1), new_value.transpose(0, 1)
    expected_key, expected_value = KERNEL.layout(keys, values)
    assert torch.equal(mirror_key, expected_key) and torch.equal(mirror_value, expected_value)
    assert torch.equal(pool_key[:, slots], new_key.transpose(0, 1))
    assert torch.equal(pool_value[:, slots], new_value.transpose(0, 1))
    assert out.dtype == dtype and out.shape == (batch, num_heads, head_dim)
    expected = reference(query, keys, values, lens, starts, head_dim ** -0.5, dtype == torch.bfloat16)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_kernel_refuses_shapes_it_cannot_take():
    query = torch.randn(2, 5, 8)
    key = torch.randn(2, 2, 8)
    mirror = torch.zeros(2, 2, 16, 8)
    with pytest.raises(ValueError, match="5 heads over 2 KV heads"):
        KERNEL(query, key, key.clone(), mirror, mirror.clone(), torch.tensor([1, 1]), torch.tensor([0, 0]), 1.0)


def test_disabled_kernel_leaves_attention_to_torch(monkeypatch):
    from llmbus.workers.attention import make_attention_backend

    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    cpu_kernels.decode_attention_kernel.cache_clear()
    try:
        assert cpu_kernels.decode_attention_kernel() is None
        assert make_attention_backend(torch.device("cpu")).decode_kernel is None
    finally:
        monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
        cpu_kernels.decode_attention_kernel.cache_clear()
    assert make_attention_backend(torch.device("cpu")).decode_kernel is not None


def test_failed_build_is_a_warning_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "cache"))
    cpu_kernels.decode_attention_kernel.cache_clear()
    try:
        assert cpu_kernels.decode_attention_kernel() is None
    finally:
        cpu_kernels.decode_attention_kernel.cache_clear()
