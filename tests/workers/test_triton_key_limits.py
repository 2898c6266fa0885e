"""The Triton backend's per-token key limits (``build_metadata``'s ``key_limits``: Gemma 3's image rows attend
their whole image both ways), run on the CPU by Triton's interpreter, against a dense float32 reference of the
rule itself: a query at position ``q`` with limit ``L`` sees the keys ``k <= L``, and in a sliding window only
those with ``k > q - window`` (the window starts from the query's own position, whatever its limit).

Steps mix a chunk that holds a whole image (its span crossing the chunk's query tiles, so a tile's keys end at
its rows' largest limit, past its last row), a chunk that starts inside an image whose first part is cached
and ends after it, plain prompts and decodes, over a full layer and one whose window is shorter than an image;
GQA; the step's keys written by the attention launch (``forward``) or first, rotated
(``forward_rotary``); keys split between programs (flash-decoding). Without limits the kernel attends causally
as before, and limits equal to the positions change no bit.

The interpreter runs each program in Python: two KV heads, head dim 16, tens of tokens."""

import pytest
import torch

from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers import gpu_ops
from llmbus.workers.attention.triton import TritonAttentionBackend, load_kernels
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.models.rotary import RotaryEmbedding

triton_kernels = interpreted_triton_kernels()

NUM_KV_HEADS, PER_KV, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 16, 4, 32
NUM_HEADS = NUM_KV_HEADS * PER_KV
WINDOWS = [None, 3]  # layer 1's window is shorter than either image
SCALE = HEAD_DIM ** -0.5
CPU = torch.device("cpu")

# Each sequence's images, as inclusive spans of positions.
IMAGES = {"img": [(12, 19)], "mid": [(3, 11)], "split": [(14, 18)]}
# Steps: each sequence (in order) with (tokens cached before, new tokens). "img" prompts 24 tokens, its image
# across its two query tiles of 16; "mid"'s first step caches the start of its image (as a prefix hit would: the
# image's end is not in that step, so those rows are causal there), its second computes the rest and goes past
# it; the last step is decodes alone (its keys split between programs).
SCHEDULE = [
    {"img": (0, 24), "mid": (0, 6), "a": (0, 5)},
    {"a": (5, 1), "mid": (6, 10), "img": (24, 1), "b": (0, 3)},
    {"a": (6, 1), "mid": (16, 1), "img": (25, 1)},
]


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        assert load_kernels() is triton_kernels
        yield


@pytest.fixture
def launches(monkeypatch):
    """Each launch's (whether it wrote the step's keys itself, whether it had limits, its key splits)."""
    seen = []
    paged_attention, key_splits = triton_kernels.paged_attention, triton_kernels.key_splits

    def spied(*args, **kwargs):
        seen.append([kwargs.get("new_kv") is not None, kwargs.get("key_limits") is not None])
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_attention", spied)
    monkeypatch.setattr(triton_kernels, "key_splits", lambda *a: seen[-1].append(key_splits(*a)) or seen[-1][2])
    return seen


def _limit(name: str, position: int, step_end: int) -> int:
    """The last position a token attends: its image's last, where that image ends in the step; else its own."""
    for start, end in IMAGES.get(name, ()):
        if start <= position <= end < step_end:
            return end
    return position


def _dense(query, keys, values, position, limit, window):
    """One token's heads ``[Hq, D]`` over its sequence's keys and values ``[S, Hkv, D]``, in float32, by the
    rule: key k is seen where ``k <= limit`` and, in a window, ``k > position - window``."""
    k = torch.arange(keys.shape[0])
    seen = k <= limit
    if window is not None:
        seen &= k > position - window
    keys, values = (t[seen].float().repeat_interleave(PER_KV, dim=1) for t in (keys, values))  # [S', Hq, D]
    weights = (torch.einsum("hd,khd->hk", query.float(), keys) * SCALE).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, values)


def _attend_schedule(schedule, path: str, limits: str, seed: int = 0):
    """Run ``schedule`` through the backend over both layers (``path``: ``forward`` or ``forward_rotary``) with
    ``limits`` (``images``: by ``IMAGES``; ``positions``: each token's own; ``none``: no key_limits), and yield
    each (step, layer)'s output and the dense reference over every key the sequences hold so far."""
    backend = TritonAttentionBackend(WINDOWS)
    cache = PagedKVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", compute_dtype=torch.float32)
    names = sorted({name for step in schedule for name in step})
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    per_seq = NUM_BLOCKS // len(names)
    tables = {name: blocks[i * per_seq:(i + 1) * per_seq] for i, name in enumerate(names)}
    history = {(name, layer): (torch.empty(0, NUM_KV_HEADS, HEAD_DIM),) * 2 for name in names for layer in (0, 1)}
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, {"rope_type": "default"}, 4096, CPU)
    generator = torch.Generator().manual_seed(seed)
    for step in schedule:
        rows = [(name, computed + i, computed + new) for name, (computed, new) in step.items() for i in range(new)]
        key_limits = {"images": [_limit(name, position, end) for name, position, end in rows],
                      "positions": [position for _, position, _ in rows], "none": None}[limits]
        meta = backend.build_metadata(
            query_lens=[new for _, new in step.values()], num_computed=[computed for computed, _ in step.values()],
            block_tables=[tables[name][:-(-sum(step[name]) // BLOCK_SIZE)] for name in step], kv_cache=cache,
            device=CPU, key_limits=key_limits)
        assert meta.positions.tolist() == [position for _, position, _ in rows]
        for layer in (0, 1):
            qkv = torch.randn(len(rows), NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
            q, k, v = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
            if path == "forward":
                out = backend.forward(layer, q, k, v, cache, meta, SCALE)
            else:
                cos, sin = rotary.cos_sin(meta.positions, torch.float32)
                out = backend.forward_rotary(layer, qkv[:, :NUM_HEADS + NUM_KV_HEADS], v, cos, sin, NUM_HEADS,
                                             cache, meta, SCALE)
                q, k = gpu_ops.apply_rotary(qkv[:, :NUM_HEADS + NUM_KV_HEADS], cos, sin).split(
                    [NUM_HEADS, NUM_KV_HEADS], dim=1)
            first = 0
            for name, (computed, new) in step.items():
                keys, values = history[name, layer]
                history[name, layer] = keys, values = (torch.cat((keys, k[first:first + new])),
                                                       torch.cat((values, v[first:first + new])))
                assert keys.shape[0] == computed + new
                first += new
            expected = torch.stack([
                _dense(q[row], *history[name, layer], position,
                       position if key_limits is None else key_limits[row], WINDOWS[layer])
                for row, (name, position, _) in enumerate(rows)])
            yield (step, layer), out, expected


@pytest.mark.parametrize("path", ["forward", "forward_rotary"])
def test_image_rows_attend_their_whole_image(path, launches):
    outputs = 0
    for where, out, expected in _attend_schedule(SCHEDULE, path, "images"):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        outputs += 1
    assert outputs == 2 * len(SCHEDULE)
    # every launch had the limits; forward's wrote the step's keys itself, forward_rotary's found them written;
    # the decodes' step split its keys
    assert all(new_kv == (path == "forward") and limited for new_kv, limited, _ in launches), launches
    assert [splits > 1 for _, _, splits in launches] == [False] * 4 + [True] * 2


def test_split_keys_with_limits_past_the_rows(launches, monkeypatch):
    """Flash-decoding's split with rows whose limits lie past them: a prompt taken a token a program (as
    decodes are) over tiles of 16 keys, as if the device had 16 multiprocessors, so that an image row's keys
    (up to its image's end, past 16) are split between programs. (Split decodes of both paths are in the
    schedule above; a split reads the keys as an unsplit launch does.)"""
    monkeypatch.setattr(triton_kernels, "query_tile", lambda max_query_len: 1)
    monkeypatch.setattr(triton_kernels, "INTERPRETER_PROCESSORS", 16)
    monkeypatch.setattr(triton_kernels, "BLOCK_N", 16)
    monkeypatch.setattr(triton_kernels, "NEW_KV_BLOCK_N", 16)
    schedule = [{"split": (0, 12)}, {"split": (12, 8)}]
    for where, out, expected in _attend_schedule(schedule, "forward", "images", seed=1):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    assert [splits for _, _, splits in launches] == [1, 1, 2, 2]


def test_without_limits_the_rows_attend_causally_as_before(launches):
    """No key_limits: the kernel without LIMITS, causal; limits that are the rows' own positions take the other
    kernel to the same bits."""
    causal = list(_attend_schedule(SCHEDULE, "forward", "none"))
    assert not any(limited for _, limited, _ in launches)
    for where, out, expected in causal:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    for (where, out, _), (_, same, _) in zip(causal, _attend_schedule(SCHEDULE, "forward", "positions")):
        assert torch.equal(out, same), where
    assert all(limited for _, limited, _ in launches[len(causal):])


def test_limits_for_every_token():
    backend = TritonAttentionBackend(WINDOWS)
    cache = PagedKVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.float32, device="cpu", compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="key_limits has 2 values for a step of 3 tokens"):
        backend.build_metadata(query_lens=[2, 1], num_computed=[0, 4], block_tables=[[0], [1, 2]], kv_cache=cache,
                               device=CPU, key_limits=[1, 1])
    meta = backend.build_metadata(query_lens=[2, 1], num_computed=[0, 4], block_tables=[[0], [1, 2]],
                                  kv_cache=cache, device=CPU, key_limits=[1, 1, 4])
    limits = meta.groups[0].key_limits
    assert limits.dtype == torch.int64 and limits.tolist() == [1, 1, 4]
