"""The Triton backend's fused RoPE and K/V write (``triton_kernels.rotary_kv_write``, reached through
``TritonAttentionBackend.forward_rotary``), run on the CPU by Triton's interpreter, stores exactly what the
separate path stores: the rotary kernel (``gpu_ops.apply_rotary``, which takes it under the interpreter as on
a GPU) and then ``PagedKVCache.write``. Bit for bit: the rotated queries, every slot of the pool (the scattered
slots written, the spare block a padded row writes to, and every other slot left as it was), in float32,
bfloat16 and a float16 pool under float32, with GQA."""

import pytest
import torch

from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers import gpu_ops
from llmbus.workers.attention.base import AttentionBackend
from llmbus.workers.attention.triton import TritonAttentionBackend, load_kernels
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.models.rotary import RotaryEmbedding

triton_kernels = interpreted_triton_kernels()

NUM_HEADS, NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, LAYER = 4, 2, 6, 4, 1
SPARE_SLOT = NUM_BLOCKS * BLOCK_SIZE + 2  # in the pool's spare block, where padded decode rows write
CPU = torch.device("cpu")
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]
DTYPE_IDS = ["float32", "bfloat16", "float16-pool"]


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        assert load_kernels() is triton_kernels
        yield


def _filled_cache(dtype, pool_dtype, head_dim) -> PagedKVCache:
    """A pool whose every slot holds its own value, so a write to a wrong slot shows."""
    cache = PagedKVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                         head_dim=head_dim, dtype=pool_dtype, device="cpu", compute_dtype=dtype)
    cache.key.copy_(torch.randn(cache.key.shape))
    cache.value.copy_(torch.randn(cache.value.shape))
    return cache


def _clone(cache: PagedKVCache) -> PagedKVCache:
    twin = PagedKVCache(num_layers=cache.num_layers, num_blocks=cache.num_blocks, block_size=cache.block_size,
                        num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=cache.key.dtype,
                        device="cpu", compute_dtype=cache.compute_dtype)
    twin.key.copy_(cache.key)
    twin.value.copy_(cache.value)
    return twin


def _layer_inputs(tokens: int, head_dim: int, dtype, positions: torch.Tensor):
    """``qk`` and ``value`` as the attention layer passes them, views of one fused QKV output (rows strided
    past their heads); cos and signed sin of real positions."""
    qkv = (torch.randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim) * 2).to(dtype)
    qk_width = (NUM_HEADS + NUM_KV_HEADS) * head_dim
    qk = qkv[:, :qk_width].view(tokens, -1, head_dim)
    value = qkv[:, qk_width:].view(tokens, NUM_KV_HEADS, head_dim)
    rotary = RotaryEmbedding(head_dim, 10000.0, {"rope_type": "default"}, 4096, CPU)
    cos, sin = rotary.cos_sin(positions, dtype)
    return qk, value, cos, sin


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_fused_write_stores_what_rotary_and_the_write_store(dtype, pool_dtype, head_dim):
    torch.manual_seed(head_dim)
    slots = torch.tensor([5, 0, 13, SPARE_SLOT, 22, 7])  # scattered, one in the spare block
    qk, value, cos, sin = _layer_inputs(len(slots), head_dim, dtype, torch.tensor([5, 0, 1800, 3, 2047, 7]))
    cache = _filled_cache(dtype, pool_dtype, head_dim)
    before, expected = _clone(cache), _clone(cache)

    rotated = gpu_ops.apply_rotary(qk, cos, sin)
    expected.write(LAYER, slots, rotated[:, NUM_HEADS:], value)
    query = triton_kernels.rotary_kv_write(qk, value, cos, sin, NUM_HEADS, slots, *cache.layer_slots(LAYER))

    assert query.dtype == dtype and query.shape == (len(slots), NUM_HEADS, head_dim)
    assert torch.equal(query, rotated[:, :NUM_HEADS])
    assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)
    # what the reference wrote is the new K/V, and nothing else moved
    untouched = torch.ones((NUM_BLOCKS + 1) * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    for pool, old in ((cache.key_slots, before.key_slots), (cache.value_slots, before.value_slots)):
        assert torch.equal(pool[0], old[0])
        assert torch.equal(pool[LAYER][:, untouched], old[LAYER][:, untouched])
    assert not torch.equal(cache.key_slots[LAYER][:, slots], before.key_slots[LAYER][:, slots])
    assert torch.equal(cache.value_slots[LAYER][:, slots], value.transpose(0, 1).to(pool_dtype))


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_the_backend_attends_as_it_did_with_rotary_then_forward(dtype, pool_dtype):
    """``forward_rotary`` of the Triton backend (one kernel, then attention) against the base class's
    (rotate, then ``forward``: the write's copies, then attention) over a step with a prompt chunk over cached
    blocks and a decode: the same output and pool, bit for bit."""
    torch.manual_seed(3)
    backend = TritonAttentionBackend([None, None])
    head_dim = 16
    cache = _filled_cache(dtype, pool_dtype, head_dim)
    expected = _clone(cache)
    meta = backend.build_metadata(query_lens=[5, 1], num_computed=[3, 9], block_tables=[[4, 1], [2, 0, 5]],
                                  kv_cache=cache, device=CPU)
    qk, value, cos, sin = _layer_inputs(6, head_dim, dtype, meta.positions)
    fused = []
    real = backend.kernels.rotary_kv_write
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend.kernels, "rotary_kv_write", lambda *a: fused.append(1) or real(*a))
        got = backend.forward_rotary(LAYER, qk, value, cos, sin, NUM_HEADS, cache, meta, 0.25)
        assert fused == [1]
        want = AttentionBackend.forward_rotary(backend, LAYER, qk, value, cos, sin, NUM_HEADS, expected, meta, 0.25)
        assert torch.equal(got, want)
        assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)
        # partial rotation (a narrower cos) takes the base class's path: rotate the first half, then forward
        half = head_dim // 2
        partial = backend.forward_rotary(LAYER, qk, value, cos[..., :half], sin[..., :half], NUM_HEADS, cache,
                                         meta, 0.25)
        assert fused == [1]
    rotated = gpu_ops.apply_rotary(qk, cos[..., :half], sin[..., :half])
    assert torch.equal(partial, backend.forward(LAYER, rotated[:, :NUM_HEADS], rotated[:, NUM_HEADS:], value,
                                                expected, meta, 0.25))
    assert torch.equal(cache.key, expected.key) and torch.equal(cache.value, expected.value)
