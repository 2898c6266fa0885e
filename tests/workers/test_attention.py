"""The two attention paths agree: batched matmuls for small queries (decodes, short prompt chunks) and
SDPA for longer ones, over the same paged cache, with ragged query lengths, GQA and a sliding window."""

import pytest
import torch

from llmbus.workers.attention import torch_sdpa as attention
from llmbus.workers.attention import TorchSDPABackend
from llmbus.workers.kv_cache import PagedKVCache


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 8, 1], [8, 2], [5]])
def test_small_query_matmul_path_equals_sdpa(monkeypatch, window, query_lens):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 16, 4
    cache = PagedKVCache(num_layers=1, num_blocks=64, block_size=block_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=torch.float32, device="cpu")
    cache.key.normal_()
    cache.value.normal_()
    num_computed = [13, 0, 21][:len(query_lens)]
    tables, next_block = [], 0
    for computed, n in zip(num_computed, query_lens):
        count = -(-(computed + n) // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim)
    k = torch.randn(total, num_kv_heads, head_dim)
    v = torch.randn(total, num_kv_heads, head_dim)

    def attend(small_query_max: int) -> torch.Tensor:
        monkeypatch.setattr(attention, "SMALL_QUERY_MAX", small_query_max)
        backend = TorchSDPABackend([window])
        meta = backend.build_metadata(query_lens=query_lens, num_computed=num_computed, block_tables=tables,
                                      kv_cache=cache, device=torch.device("cpu"))
        return backend.forward(0, q, k, v, cache, meta, scale=head_dim ** -0.5)

    via_matmul = attend(8)
    via_sdpa = attend(0)  # nothing counts as small: SDPA for every group, decodes included
    torch.testing.assert_close(via_matmul, via_sdpa, rtol=1e-5, atol=1e-5)
