"""Key limits (``AttentionBackend.build_metadata``'s ``key_limits``: Gemma 3's image placeholders attend their
whole image) on the CPU's backends: the portable one and the C kernel's rows (``prompt_rows``), against dense
attention over the same keys with transformers' rule: a query at position q with limit L sees key k iff k <= L
and, in a windowed layer, k > q - window. The steps hold a whole image, a chunk that starts inside one (a prefix
hit) and ends past it, plain prompts and decodes; one layer's window is shorter than an image."""

import pytest
import torch

from llmbus.workers.attention import CPUKernelBackend, TorchSDPABackend
from llmbus.workers.attention.decode_kernel import decode_attention_kernel
from llmbus.workers.kv_cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 4
WINDOWS = [3, None]  # layer 0 windowed (shorter than an image), layer 1 full


def dense(query, keys, values, positions, limits, window, scale):
    """One sequence's queries ``[n, Hq, D]`` at ``positions`` over its keys ``[ctx, Hkv, D]``."""
    key_pos = torch.arange(keys.shape[0])
    visible = key_pos[None, :] <= limits[:, None]
    if window is not None:
        visible &= key_pos[None, :] > positions[:, None] - window
    keys = keys.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
    values = values.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


# (cached tokens, new tokens, the image spans [first, stop) of the sequence)
STEP = [(0, 14, [(3, 9)]),  # a prompt holding a whole image
        (8, 10, [(6, 13)]),  # a chunk that starts inside an image (its first two placeholders cached)
        (0, 5, []),  # a plain prompt
        (11, 1, []),  # decodes
        (6, 1, [(1, 4)])]


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_kernel_rows"])
def test_image_rows_see_their_whole_image_and_the_window_starts_at_each_row(backend):
    if backend == "cpu_kernel_rows":
        if decode_attention_kernel() is None:
            pytest.skip("no C compiler: the kernel is optional")
        attention = CPUKernelBackend(WINDOWS, prompt_rows=True)
    else:
        attention = TorchSDPABackend(WINDOWS)
    cache = PagedKVCache(num_layers=2, num_blocks=64, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", compute_dtype=torch.float32)
    torch.manual_seed(0)
    tables = [list(range(8 * i + 7, 8 * i - 1, -1)) for i in range(len(STEP))]  # non-contiguous, reversed
    total = [c + n for c, n, _ in STEP]
    keys = [torch.randn(t, NUM_KV_HEADS, HEAD_DIM) for t in total]
    values = [torch.randn(t, NUM_KV_HEADS, HEAD_DIM) for t in total]
    queries = [torch.randn(n, NUM_HEADS, HEAD_DIM) for _, n, _ in STEP]
    limits = []
    for cached, n, spans in STEP:
        for position in range(cached, cached + n):
            limits.append(next((stop - 1 for first, stop in spans if first <= position < stop), position))
    for layer in range(2):  # the cached keys, as earlier steps left them
        for (cached, _, _), table, k, v in zip(STEP, tables, keys, values):
            slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached)],
                                 dtype=torch.long)
            if cached:
                cache.write(layer, slots, k[:cached], v[:cached])
    meta = attention.build_metadata(query_lens=[n for _, n, _ in STEP], num_computed=[c for c, _, _ in STEP],
                                    block_tables=tables, kv_cache=cache, device=torch.device("cpu"),
                                    key_limits=limits)
    new_keys = torch.cat([k[c:] for (c, _, _), k in zip(STEP, keys)])
    new_values = torch.cat([v[c:] for (c, _, _), v in zip(STEP, values)])
    limits_t = torch.tensor(limits)
    for layer, window in enumerate(WINDOWS):
        out = attention.forward(layer, torch.cat(queries), new_keys, new_values, cache, meta, 0.125)
        row = 0
        for (cached, n, _), q, k, v in zip(STEP, queries, keys, values):
            positions = torch.arange(cached, cached + n)
            expected = dense(q, k, v, positions, limits_t[row:row + n], window, 0.125)
            torch.testing.assert_close(out[row:row + n], expected, rtol=1e-5, atol=1e-5)
            row += n
