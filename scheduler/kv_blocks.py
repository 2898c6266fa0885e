"""KV block accounting: a pool of block ids with reference counts, and the prefix cache over it.

A block's reference count is the number of running requests whose block table holds it, plus one if
the prefix cache keeps it. A block with count 0 is on the free list. Requests share a block only through
the prefix cache, so a block held by two requests is always a cached one.

The prefix cache is a radix tree over block-sized token chunks (one node per full block, as in TGI's
``RadixAllocator`` and SGLang's radix cache): the path from the root spells a token prefix, and each
node names the block holding that chunk's K/V. A node nobody but the cache holds is *evictable*; when
the free list runs short, evictable leaves go in least-recently-released order. Chunks are looked up by
hash and then compared token by token, so a hash collision can only cost a miss, never wrong K/V.

While a request runs, only blocks it holds are inserted below a path it holds, which keeps one
invariant: every ancestor of a node some request holds is held by that request too. Hence every
evictable node has only evictable descendants, the evictable count is simply the number of cached
blocks with reference count 1, and all of them can be freed by repeatedly evicting leaves.

Each LoRA adapter has a tree of its own (``namespace``): the same tokens have other K/V under another
adapter's projections, so a prefix is only shared between requests of the same adapter (as vLLM keys its
block hashes by the LoRA id).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence


def chunk_hash(tokens: tuple[int, ...]) -> int:
    return hash(tokens)


class _Node:
    __slots__ = ("tokens", "block", "parent", "children", "last_use")

    def __init__(self, tokens: tuple[int, ...], block: int, parent: "_Node | None"):
        self.tokens = tokens
        self.block = block
        self.parent = parent
        self.children: dict[int, list[_Node]] = {}  # chunk hash -> nodes (a list: hashes may collide)
        self.last_use = 0

    def child(self, key: int, tokens: tuple[int, ...]) -> "_Node | None":
        for node in self.children.get(key, ()):
            if node.tokens == tokens:
                return node
        return None


class KVBlockManager:
    """Block ids ``0..num_blocks-1`` handed to requests, with an optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 hash_fn: Callable[[tuple[int, ...]], int] = chunk_hash):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._hash = hash_fn
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self.refcount = [0] * num_blocks
        self._roots: dict[str, _Node] = {}  # namespace ("": the base model, else a LoRA adapter) -> its tree
        self._node_of_block: dict[int, _Node] = {}
        self._num_evictable = 0
        self._clock = itertools.count(1)
        self._lru: list[tuple[int, int, _Node]] = []  # (last_use, tiebreak, node); stale entries skipped on pop
        self._tiebreak = itertools.count()

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def lru_entries(self) -> int:
        """Entries of the prefix cache's LRU heap, stale ones included: bounded by release() (issue #36)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks only the prefix cache keeps: free for the taking, after eviction."""
        return self._num_evictable

    @property
    def num_available(self) -> int:
        return len(self._free) + self._num_evictable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ requests' blocks

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks for one request, evicting cached ones if needed; None if there are not
        that many available (nothing changes then)."""
        if count > self.num_available:
            return None
        if count > len(self._free):
            self._evict(count - len(self._free))
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks that ``match`` returned."""
        for b in blocks:
            if self.refcount[b] == 1:  # only the cache held it
                self._num_evictable -= 1
            self.refcount[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one request's references; blocks nobody holds go back to the free list or, if cached,
        become evictable."""
        tick = next(self._clock)
        for b in blocks:
            count = self.refcount[b] - 1
            if count < 0:
                raise AssertionError(f"block {b} released more often than taken")
            self.refcount[b] = count
            node = self._node_of_block.get(b)
            if node is None:
                if count == 0:
                    self._free.append(b)
            elif count == 1:
                self._num_evictable += 1
                node.last_use = tick
                if not node.children:
                    heapq.heappush(self._lru, (tick, next(self._tiebreak), node))
        # A leaf released again leaves its older entry behind, and only eviction pops entries: with a pool that
        # rarely fills, the heap grew by one entry per released leaf for good (issue #36). Keeping the live
        # ones whenever it is twice the cache's size bounds it at one pass per as many releases.
        if len(self._lru) > 2 * len(self._node_of_block) + 64:
            self._lru = [entry for entry in self._lru if self._live(entry)]
            heapq.heapify(self._lru)

    def _live(self, entry: tuple[int, int, _Node]) -> bool:
        """Whether an LRU entry still names an evictable leaf as of its latest release (else it is stale)."""
        last_use, _, node = entry
        return (self._node_of_block.get(node.block) is node and not node.children
                and self.refcount[node.block] == 1 and node.last_use == last_use)

    # ------------------------------------------------------------------ prefix cache

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), -1, None)
        return root

    def match(self, tokens: Sequence[int], max_blocks: int, namespace: str = "") -> list[int]:
        """Blocks caching the longest prefix of ``tokens`` made of whole chunks, at most ``max_blocks``, in
        ``namespace``'s tree. Nothing is taken: pass the result to ``acquire`` to use it."""
        if not self.prefix_caching:
            return []
        blocks, node, bs = [], self._root(namespace), self.block_size
        for i in range(min(max_blocks, len(tokens) // bs)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            node = node.child(self._hash(chunk), chunk)
            if node is None:
                break
            blocks.append(node.block)
        return blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], releasing: bool, namespace: str = "") -> None:
        """Cache the full chunks of ``tokens`` whose K/V are in ``blocks`` (a request's table), in
        ``namespace``'s tree.

        Where a chunk is cached already in another block, a running request stops there (see the module
        docstring); one about to ``release`` its blocks goes on below the other block, and its own copy
        is simply freed by the release.
        """
        if not self.prefix_caching:
            return
        node, bs = self._root(namespace), self.block_size
        for i in range(min(len(tokens) // bs, len(blocks))):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = self._hash(chunk)
            existing = node.child(key, chunk)
            if existing is not None:
                if existing.block != blocks[i] and not releasing:
                    return
                node = existing
                continue
            block = blocks[i]
            if block in self._node_of_block:  # the request's block caches another path already
                return
            new = _Node(chunk, block, node)
            node.children.setdefault(key, []).append(new)
            self._node_of_block[block] = new
            self.refcount[block] += 1
            node = new

    def _evict(self, count: int) -> None:
        """Free ``count`` cached blocks, least recently released leaves first."""
        freed = 0
        while freed < count:
            entry = heapq.heappop(self._lru)
            if not self._live(entry):
                continue
            node = entry[2]
            block = node.block
            parent = node.parent
            siblings = parent.children[self._hash(node.tokens)]
            siblings.remove(node)
            if not siblings:
                del parent.children[self._hash(node.tokens)]
            del self._node_of_block[block]
            self.refcount[block] = 0
            self._num_evictable -= 1
            self._free.append(block)
            freed += 1
            if parent.parent is not None and not parent.children and self.refcount[parent.block] == 1:
                heapq.heappush(self._lru, (parent.last_use, next(self._tiebreak), parent))

    def clear_cache(self) -> None:
        """Evict every cached block nobody holds."""
        if self._num_evictable:
            self._evict(self._num_evictable)

    # ------------------------------------------------------------------ checks (tests)

    def check(self, holders: Sequence[Sequence[int]]) -> None:
        """Assert the accounting against the block tables of every running request."""
        held = [0] * self.num_blocks
        for table in holders:
            assert len(set(table)) == len(table), f"a block table lists a block twice: {table}"
            for b in table:
                held[b] += 1
        for b, node in self._node_of_block.items():
            assert node.block == b
        expected = [held[b] + (b in self._node_of_block) for b in range(self.num_blocks)]
        for b in range(self.num_blocks):
            assert self.refcount[b] == expected[b], f"block {b}: count {self.refcount[b]}, held {expected[b]}x"
            if held[b] > 1 and b not in self._node_of_block:
                raise AssertionError(f"block {b} is held by two requests without being cached")
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if expected[b] == 0}, "free list out of step"
        evictable = [n for n in self._node_of_block.values() if self.refcount[n.block] == 1]
        assert len(evictable) == self._num_evictable, "evictable count out of step"
        for node in evictable:  # the invariant that makes every evictable block reachable by eviction
            stack = [c for cs in node.children.values() for c in cs]
            while stack:
                child = stack.pop()
                assert self.refcount[child.block] == 1, "a held node below an evictable one"
                stack.extend(c for cs in child.children.values() for c in cs)
