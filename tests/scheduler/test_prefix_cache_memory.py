"""Issue #36: the prefix cache's bookkeeping stays bounded by what it caches, however many requests reuse it."""

from __future__ import annotations

from llmbus.scheduler.kv_blocks import KVBlockManager


def test_reused_prefix_does_not_grow_the_lru():
    kv = KVBlockManager(num_blocks=4096, block_size=4)  # a pool that never fills: nothing is evicted
    prompts = [[100 * p + t for t in range(8)] for p in range(5)]
    for prompt in prompts:
        blocks = kv.allocate(2)
        kv.insert(prompt, blocks, releasing=True)
        kv.release(blocks)
    for i in range(20_000):  # every request hits a cached prefix, then releases it
        hit = kv.match(prompts[i % len(prompts)], 2)
        assert len(hit) == 2
        kv.acquire(hit)
        kv.release(hit)
    assert kv.num_cached == 10
    assert len(kv._lru) <= 2 * 10 + 64, len(kv._lru)
    # what eviction reads is intact: the least recently released prompt's leaf goes first, then its parent
    kv.allocate(kv.num_free + 2)
    assert kv.match(prompts[(20_000 - 5) % 5], 2) == [], "the least recently used prefix was evicted"
    assert all(len(kv.match(p, 2)) == 2 for p in prompts[1:])
