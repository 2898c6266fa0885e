"""The Triton backend's kernels, run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``), attend as
the portable backend does over the same steps: whole prompts and prompt chunks over cached blocks, a prefix
hit, decodes, speculative rows and mixed steps of all of them; GQA ratios 1, 4 and 8; a sliding window
(which skips whole tiles of keys on the long sequence); block sizes 16 and 64; float32, bfloat16, float16 and
a float16 pool under float32 attention; scattered block tables and contexts that end mid-block. Both backends
write the same bytes into pools of the same layout.

The interpreter runs each program in Python, so the shapes stay small: two KV heads, tens of tokens."""

import os
import subprocess
import sys

import pytest
import torch

from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers.attention.torch_sdpa import TorchSDPABackend
from llmbus.workers.attention.triton import TritonAttentionBackend, load_kernels, triton_importable
from llmbus.workers.kv_cache import PagedKVCache


triton_kernels = interpreted_triton_kernels()

NUM_KV_HEADS, WINDOW = 2, 7
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        assert triton_kernels.interpreted()
        assert load_kernels() is triton_kernels
        yield


def _cache(dtype, pool_dtype, block_size, head_dim) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=24, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                        head_dim=head_dim, dtype=pool_dtype, device="cpu", compute_dtype=dtype)


def _schedule(block_size: int):
    """Steps, each the sequences (in order) with (tokens cached before, new tokens). ``long`` is prompted in
    two chunks, the second over the first's cached blocks, and grows past one tile of keys plus the window;
    ``hit`` starts with ``long``'s first block already cached (a prefix hit); the 3- and 4-token queries
    are speculative rows (the next token and guesses, causal among themselves)."""
    return [
        {"a": (0, 9), "long": (0, 40)},
        {"a": (9, 1), "long": (40, 30)},
        {"a": (10, 1), "long": (70, 1), "hit": (block_size, 5)},
        {"hit": (block_size + 5, 1), "a": (11, 4), "long": (71, 3)},
        {"a": (15, 1), "long": (74, 1), "hit": (block_size + 6, 1)},
        {"long": (75, 1), "hit": (block_size + 7, 3)},
    ]


def _tables(block_size: int) -> dict[str, list[int]]:
    """Scattered tables: each sequence's blocks drawn from a shuffled pool, ``hit`` sharing ``long``'s first."""
    blocks = torch.randperm(24, generator=torch.Generator().manual_seed(block_size)).tolist()
    per_seq = -(-80 // block_size)
    tables = {name: blocks[i * per_seq:(i + 1) * per_seq] for i, name in enumerate(("a", "long", "hit"))}
    tables["hit"][0] = tables["long"][0]
    return tables


CASES = {
    # name: (compute dtype, pool dtype, block size, query heads per KV head, head dim, tolerance)
    "f32-gqa1-b16-d64": (torch.float32, torch.float32, 16, 1, 64, 1e-5),
    "f32-gqa4-b64-d16": (torch.float32, torch.float32, 64, 4, 16, 1e-5),  # the tiny test Llama's heads
    "f32-gqa8-b16-d128": (torch.float32, torch.float32, 16, 8, 128, 1e-5),
    "bf16-gqa4-b16-d128": (torch.bfloat16, torch.bfloat16, 16, 4, 128, 3e-2),
    "bf16-gqa8-b64-d64": (torch.bfloat16, torch.bfloat16, 64, 8, 64, 3e-2),
    "f16-gqa1-b64-d32": (torch.float16, torch.float16, 64, 1, 32, 3e-3),
    # a float32 model's narrower pool (--kv-cache-dtype float16); a head dim that is no power of two
    "f32-f16pool-gqa4-b16-d80": (torch.float32, torch.float16, 16, 4, 80, 1e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_equals_portable(case):
    dtype, pool_dtype, block_size, per_kv, head_dim, tolerance = CASES[case]
    num_heads = NUM_KV_HEADS * per_kv
    triton_backend, portable = TritonAttentionBackend([None, WINDOW]), TorchSDPABackend([None, WINDOW])
    caches = [_cache(dtype, pool_dtype, block_size, head_dim) for _ in range(2)]
    tables = _tables(block_size)
    generator = torch.Generator().manual_seed(0)
    for step in _schedule(block_size):
        names = list(step)
        args = dict(query_lens=[step[n][1] for n in names], num_computed=[step[n][0] for n in names],
                    block_tables=[tables[n][:-(-sum(step[n]) // block_size)] for n in names], device=CPU)
        metas = [b.build_metadata(kv_cache=c, **args) for b, c in zip((triton_backend, portable), caches)]
        tokens = sum(args["query_lens"])
        assert metas[0].positions.tolist() == metas[1].positions.tolist()
        for layer in range(2):
            q = torch.randn(tokens, num_heads, head_dim, generator=generator).to(dtype)
            k, v = (torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=generator).to(dtype) for _ in range(2))
            outs = [b.forward(layer, q, k, v, c, m, scale=head_dim ** -0.5)
                    for b, c, m in zip((triton_backend, portable), caches, metas)]
            assert outs[0].dtype == dtype and outs[0].shape == q.shape
            torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(caches[0].key, caches[1].key) and torch.equal(caches[0].value, caches[1].value)


# The writes inside the launch depend on the step's dtype (a pool of another has them written first), the block
# size (the slots' blocks and offsets) and the query heads per KV head (the lanes that write). These cases write in
# the launch in each dtype (float32, bfloat16, float16), at both block sizes and at GQA 1, 4 and 8, and write first
# to a narrower pool: each of the other three is a combination of those (two launches a layer, interpreted), and
# their attention is still compared with the portable backend's above.
NEW_KV_CASES = ["f32-gqa8-b16-d128", "bf16-gqa4-b16-d128", "f16-gqa1-b64-d32", "f32-f16pool-gqa4-b16-d80"]


@pytest.mark.parametrize("case", NEW_KV_CASES)
def test_writing_the_new_keys_inside_the_launch_equals_writing_them_first(case, monkeypatch):
    """``forward`` writes the step's keys and values in its attention launch, the step's own keys read from
    the step's tensors (views of one QKV row, as a layer gives them): bit for bit the output and the pool of
    writing them first (``PagedKVCache.write``) and then attending over the pool in tiles of as many keys
    (NEW_KV's are ``NEW_KV_BLOCK_N``); prompt chunks over cached blocks, speculative rows, split decodes and
    the window's layer alike. A pool of another dtype than the step's has them written first."""
    dtype, pool_dtype, block_size, per_kv, head_dim, _ = CASES[case]
    num_heads = NUM_KV_HEADS * per_kv
    monkeypatch.setattr(triton_kernels, "BLOCK_N", triton_kernels.NEW_KV_BLOCK_N)  # the reference's tiles
    backend = TritonAttentionBackend([None, WINDOW])
    launches = []
    real = triton_kernels.paged_attention
    monkeypatch.setattr(triton_kernels, "paged_attention",
                        lambda *a, **kw: launches.append(kw.get("new_kv") is not None) or real(*a, **kw))
    one_launch, written_first = (_cache(dtype, pool_dtype, block_size, head_dim) for _ in range(2))
    tables = _tables(block_size)
    generator = torch.Generator().manual_seed(1)
    for step in _schedule(block_size):
        names = list(step)
        meta = backend.build_metadata(query_lens=[step[n][1] for n in names],
                                      num_computed=[step[n][0] for n in names],
                                      block_tables=[tables[n][:-(-sum(step[n]) // block_size)] for n in names],
                                      kv_cache=one_launch, device=CPU)
        tokens = meta.positions.shape[0]
        for layer in range(2):
            qkv = torch.randn(tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
            q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
            out = backend.forward(layer, q, k, v, one_launch, meta, scale=head_dim ** -0.5)
            written_first.write(layer, meta.slot_mapping, k, v)
            expected = backend._attend(layer, q, written_first, meta, head_dim ** -0.5)
            assert torch.equal(out, expected), (step, layer)
        assert torch.equal(one_launch.key, written_first.key) and torch.equal(one_launch.value, written_first.value)
    assert launches and all(launches[::2]) == (dtype == pool_dtype)  # forward's launches: one each, or written first


def test_one_launch_per_step_and_its_programs(monkeypatch):
    """A step of every row kind is one launch per layer, one program per tile of a sequence's query tokens
    under each KV head; a decode-only step takes one token per program."""
    backend = TritonAttentionBackend([None])
    cache = _cache(torch.float32, torch.float32, 16, 16)
    kernels = backend.kernels
    launches = []
    real = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **kw: launches.append(a[5]) or real(*a, **kw))
    meta = backend.build_metadata(query_lens=[1, 20, 3], num_computed=[5, 0, 7], block_tables=[[0], [1, 2], [3]],
                                  kv_cache=cache, device=CPU)
    step = meta.groups[0]
    assert step.block_q == 16
    assert step.programs.tolist() == [[0, 1, 1, 2], [0, 1, 17, 21]]
    q = torch.randn(24, 4, 16)
    k = v = torch.randn(24, NUM_KV_HEADS, 16)
    backend.forward(0, q, k, v, cache, meta, 0.25)
    assert launches == [16]
    decodes = backend.build_metadata(query_lens=[1, 1], num_computed=[5, 20], block_tables=[[0], [1, 2]],
                                     kv_cache=cache, device=CPU)
    assert decodes.groups[0].block_q == 1 and decodes.groups[0].programs.tolist() == [[0, 1], [0, 1]]


def test_available_only_where_it_runs(monkeypatch):
    """Available under the interpreter, on CPU too (the fixture set it); not on CPU without it; never without
    triton, and then made only with a clear error; ``llmbus.workers.attention`` imports without triton."""
    assert TritonAttentionBackend.available(CPU)
    assert TritonAttentionBackend.name == "triton" and not TritonAttentionBackend.gives_kernel_rows
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not TritonAttentionBackend.available(CPU)
    monkeypatch.setitem(sys.modules, "triton", None)
    triton_importable.cache_clear()
    try:
        assert not TritonAttentionBackend.available(torch.device("cuda"))
        with pytest.raises(RuntimeError, match="pip install triton"):
            TritonAttentionBackend()
    finally:
        triton_importable.cache_clear()
    code = ("import sys; sys.modules['triton'] = None; import torch, llmbus.workers.attention; "
            "from llmbus.workers.attention.triton import TritonAttentionBackend as B; "
            "assert not B.available(torch.device('cpu')); assert 'llmbus.workers.attention.triton_kernels' "
            "not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_decode_steps_that_leave_the_device_idle_split_their_keys():
    """Flash-decoding's split, sized from the step's shape alone (a CUDA graph of a batch size keeps it):
    about two programs per multiprocessor (the interpreter counts 8), powers of two up to MAX_SPLITS, and
    none for steps with prompt tiles or enough programs already. Every decode-only step of the schedules
    above with few sequences ran split (the comparisons with the portable backend cover the merge)."""
    assert triton_kernels.key_splits(1, 2, 1, CPU) == 8
    assert triton_kernels.key_splits(3, 2, 1, CPU) == 2
    assert triton_kernels.key_splits(64, 8, 1, CPU) == 1
    assert triton_kernels.key_splits(1, 2, 16, CPU) == 1
    assert triton_kernels.key_splits(1, 1, 1, CPU) == triton_kernels.MAX_SPLITS
