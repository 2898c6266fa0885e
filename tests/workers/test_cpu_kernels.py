"""The C decode-attention kernel (workers/kernels/csrc/decode_attention.c) against a float32 reference written
with torch ops: the attended output over a paged pool read through block tables, the new K/V it writes into
the pool (in the kernel's layout for bf16), the writer used beside prompts, GQA groups, sliding windows (a
first visible key per sequence), both dtypes and a float16 pool under float32 queries, and head dims that
take the AVX-512 path (64, 128) or the portable one (8). Also: where the kernel library cannot be built,
attention falls back to torch; a library whose structures or constants differ from the bindings' is
refused at load; and sampling.c's token choice."""

import ctypes

import pytest
import torch

from llmbus.workers.attention.decode_kernel import decode_attention_kernel
from llmbus.workers.kernels import bindings, build
from llmbus.workers.sampling import sampling_kernels

KERNEL = decode_attention_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is optional")


def reference(query, keys, values, lens, starts, scale, round_probs):
    """``query [B, Hq, D]`` over ``keys``/``values [Hkv, B, ctx, D]`` -> float32 ``[B, Hq, D]``."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, ctx = keys.shape[0], keys.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.einsum("hbgd,hbjd->hbgj", q, keys.float()) * scale
    position = torch.arange(ctx)[None, :]
    visible = (position < lens[:, None]) & (position >= starts[:, None])
    probs = scores.masked_fill(~visible[None, :, None, :], float("-inf")).softmax(-1)
    if round_probs:  # bf16: probabilities meet V in bf16, as on torch's path
        probs = probs.to(torch.bfloat16).float()
    out = torch.einsum("hbgj,hbjd->hbgd", probs, values.float())
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads, head_dim)


def paged_problem(dtype, head_dim, num_heads, num_kv_heads, block_size):
    """A pool of shuffled blocks holding 9 sequences' contexts, with each one's query and new K/V."""
    torch.manual_seed(0)
    lens = torch.tensor([1, 2, 17, 31, 32, 33, 50, 64, 80])
    starts = torch.tensor([0, 1, 0, 5, 16, 0, 33, 40, 0])  # windows: the first visible key of each
    batch = len(lens)
    blocks_of = [-(-int(n) // block_size) for n in lens]
    order = torch.randperm(sum(blocks_of) + 3).tolist()  # scattered, with unused blocks between
    tables, at = [], 0
    for n in blocks_of:
        tables.append(order[at:at + n])
        at += n
    width = max(blocks_of) + 2  # rows longer than needed: the kernel reads only what lens asks
    table_t = torch.full((batch, width), len(order), dtype=torch.long)
    for b, table in enumerate(tables):
        table_t[b, :len(table)] = torch.tensor(table)
    pool_key = torch.randn(num_kv_heads, len(order) + 1, block_size, head_dim).to(dtype)
    pool_value = torch.randn(num_kv_heads, len(order) + 1, block_size, head_dim).to(dtype)
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim).to(dtype)  # strided rows, as in the model
    query, new_key = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    new_value = qkv[:, num_heads + num_kv_heads:]
    slots = torch.tensor([table[(int(n) - 1) // block_size] * block_size + (int(n) - 1) % block_size
                          for table, n in zip(tables, lens)])
    return lens, starts, table_t, pool_key, pool_value, query, new_key, new_value, slots


def contexts(pool, table_t, lens):
    """Each sequence's context from a torch-layout pool, padded: ``[Hkv, B, max_len, D]``."""
    ctx = int(lens.max())
    return torch.stack([pool[:, row].flatten(1, 2)[:, :ctx] for row in table_t], dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 12, 4), (128, 4, 4), (8, 6, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_attends_the_pool_in_place_and_writes_as_reference(dtype, head_dim, num_heads, num_kv_heads,
                                                                 block_size):
    lens, starts, tables, pool_key, pool_value, query, new_key, new_value, slots = paged_problem(
        dtype, head_dim, num_heads, num_kv_heads, block_size)
    laid_key, laid_value = KERNEL.to_layout(pool_key, pool_value)
    out = KERNEL(query, laid_key, laid_value, tables, lens, starts, int(lens.max()), head_dim ** -0.5,
                 new=(new_key, new_value, slots))

    for pool, new in ((pool_key, new_key), (pool_value, new_value)):
        pool.view(pool.shape[0], -1, head_dim)[:, slots] = new.transpose(0, 1)
    expected_key, expected_value = KERNEL.to_layout(pool_key, pool_value)
    assert torch.equal(laid_key, expected_key) and torch.equal(laid_value, expected_value)
    assert out.dtype == dtype and out.shape == query.shape
    expected = reference(query, contexts(pool_key, tables, lens), contexts(pool_value, tables, lens), lens, starts,
                         head_dim ** -0.5, dtype == torch.bfloat16)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writer_and_layout_round_trip(dtype):
    torch.manual_seed(1)
    num_kv_heads, blocks, block_size, head_dim = 2, 5, 32, 64
    pool = [torch.zeros(num_kv_heads, blocks, block_size, head_dim, dtype=dtype) for _ in range(2)]
    kv = torch.randn(7, 2 * num_kv_heads, head_dim).to(dtype)  # strided rows, as in the model
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.tensor([0, 31, 32, 45, 100, 127, 159])
    KERNEL.write(key, value, *pool, slots)
    torch_key, torch_value = KERNEL.from_layout(*pool)
    assert torch.equal(torch_key.view(num_kv_heads, -1, head_dim)[:, slots], key.transpose(0, 1))
    assert torch.equal(torch_value.view(num_kv_heads, -1, head_dim)[:, slots], value.transpose(0, 1))
    assert torch.equal(torch.stack(KERNEL.to_layout(torch_key, torch_value)), torch.stack(pool))


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 4, 4), (8, 6, 2)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_float16_pool_under_float32_queries(head_dim, num_heads, num_kv_heads, block_size):
    """--kv-cache-dtype float16 on a float32 model: the new K/V are stored as torch's ``.to(float16)``
    rounds them, and attention is float32 arithmetic over the stored values (AVX2 + F16C for head dims of 64
    and 128, the portable loops for 8)."""
    lens, starts, tables, pool_key, pool_value, query, new_key, new_value, slots = paged_problem(
        torch.float32, head_dim, num_heads, num_kv_heads, block_size)
    half_key, half_value = pool_key.half(), pool_value.half()
    assert KERNEL.supports(torch.float16, head_dim, block_size, torch.float32)
    assert not KERNEL.supports(torch.float16, head_dim, block_size)  # float16 queries: no entry
    out = KERNEL(query, half_key, half_value, tables, lens, starts, int(lens.max()), head_dim ** -0.5,
                 new=(new_key, new_value, slots))

    for pool, new in ((pool_key, new_key), (pool_value, new_value)):
        pool.view(pool.shape[0], -1, head_dim)[:, slots] = new.transpose(0, 1)
    assert torch.equal(half_key, pool_key.half()) and torch.equal(half_value, pool_value.half())
    assert out.dtype == torch.float32 and out.shape == query.shape
    expected = reference(query, contexts(half_key.float(), tables, lens), contexts(half_value.float(), tables, lens),
                         lens, starts, head_dim ** -0.5, round_probs=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    written = [torch.zeros_like(half_key) for _ in range(2)]
    KERNEL.write(new_key, new_value, *written, slots)
    for pool, new in zip(written, (new_key, new_value)):
        assert torch.equal(pool.view(pool.shape[0], -1, head_dim)[:, slots], new.transpose(0, 1).half())


def test_kernel_refuses_shapes_and_dtypes_it_cannot_take():
    query = torch.randn(2, 5, 8)
    pool = torch.zeros(2, 3, 16, 8)
    tables, ones = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="5 heads over 2 KV heads"):
        KERNEL(query, pool, pool.clone(), tables, ones, ones - 1, 1, 1.0)
    assert not KERNEL.supports(torch.bfloat16, 64, 8) and KERNEL.supports(torch.float32, 64, 8)
    with pytest.raises(ValueError, match="float16 pool takes torch.float32 activations"):
        KERNEL(query.half()[:, :2], pool.half(), pool.half(), tables, ones, ones - 1, 1, 1.0)


def test_disabled_kernel_leaves_attention_to_torch(monkeypatch):
    from llmbus.workers.attention import make_attention_backend

    monkeypatch.setenv(build.DISABLE_ENV, "0")
    bindings.library.cache_clear(), decode_attention_kernel.cache_clear()
    try:
        assert decode_attention_kernel() is None
        assert make_attention_backend(torch.device("cpu")).name == "torch_sdpa"
    finally:
        monkeypatch.delenv(build.DISABLE_ENV)
        bindings.library.cache_clear(), decode_attention_kernel.cache_clear()
    assert make_attention_backend(torch.device("cpu")).name == "cpu_kernel"


def test_failed_build_is_a_warning_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    bindings.library.cache_clear(), decode_attention_kernel.cache_clear()
    try:
        assert decode_attention_kernel() is None
    finally:
        bindings.library.cache_clear(), decode_attention_kernel.cache_clear()


def test_library_whose_structures_differ_from_the_bindings_is_refused():
    """llmbus_kernels_abi answers the header's sizes and constants, which the bindings share; a field added
    on one side only (here a StepArgs with one more, as the bindings would then see it) or another
    constant is refused at load, naming each difference."""
    library = bindings.library()
    bindings.check_abi(library)  # the real pair agrees
    assert library.llmbus_kernels_abi(b"no such name") == -1

    class LongerStepArgs(ctypes.Structure):
        _fields_ = [*bindings.StepArgs._fields_, ("added", ctypes.c_int64)]

    size = ctypes.sizeof(bindings.StepArgs)
    doctored = {**bindings.abi_expectations(), "sizeof(StepArgs)": ctypes.sizeof(LongerStepArgs), "MAX_ROWS": 16}
    with pytest.raises(bindings.KernelABIError) as refused:
        bindings.check_abi(library, doctored)
    assert (f"sizeof(StepArgs) is {size} in the library, {size + 8} in bindings.py; MAX_ROWS is 8 in the library, "
            "16 in bindings.py" in str(refused.value))


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_greedy_kernel_chooses_and_scores_as_torch(rows):
    """sampling.c's greedy rows: each row's first argmax and its log-softmax, as torch's argmax and
    log_softmax give them, with ties, a NaN row, an all -inf row and a strided view (a vocabulary cut from
    padded logits); a single row splits its vocabulary across the threads."""
    kernels = sampling_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the kernel is optional")
    greedy = kernels.greedy
    gen = torch.Generator().manual_seed(rows)
    padded = torch.randn(rows, 50_000, generator=gen) * 4
    padded[0, 31_000] = padded[0, 7] = padded[0].max() + 1  # a tie: the first index wins
    if rows > 2:
        padded[1, 123] = float("nan")
        padded[2] = float("-inf")
    logits = padded[:, :49_152]
    ids, logprobs = greedy(logits)
    # the exact log-softmax: torch's float32 one is off by up to 1.6e-5 on AVX2, the kernel by 1.5e-6
    want = torch.log_softmax(logits.double(), dim=-1)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()
    assert ids[0] == 7
    expected = want.gather(1, ids[:, None]).squeeze(1).float()
    assert torch.allclose(logprobs, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    if rows > 2:
        assert ids[1] == 123 and logprobs[1:3].isnan().all()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_sampling_kernel_draws_as_the_torch_path(rows, monkeypatch):
    """sampling.c's drawn rows through sample(): the same tokens and log-probabilities as the torch path,
    for greedy and drawn rows side by side, temperatures from tiny (the scaled logits overflow: the limit
    distribution, the argmax) to large, with and without a warper's masks in the batch."""
    from llmbus.bus.messages import SamplingParams
    from llmbus.workers import sampling

    if sampling_kernels() is None:
        pytest.skip("no C compiler: the kernel is optional")
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 5000, generator=gen) * 5
    temperatures = [1.0, 0.7, 1e-38, 2.5, 0.05]
    for top_k in (0, 40):
        params = [SamplingParams(do_sample=i % 5 != 1, temperature=temperatures[i % 5], top_k=top_k, seed=100 + i)
                  for i in range(rows)]
        positions = list(range(7, 7 + rows))
        kernel_way = sampling.sample(logits, params, positions)
        with monkeypatch.context() as patch:
            patch.setattr(sampling, "_kernels_for", lambda _: None)
            torch_way = sampling.sample(logits, params, positions)
        assert kernel_way.token_ids.tolist() == torch_way.token_ids.tolist()
        torch.testing.assert_close(kernel_way.logprobs, torch_way.logprobs, rtol=1e-5, atol=1e-5)


def test_sampling_kernel_never_draws_a_masked_token():
    """A masked token (-inf, a warper's) has probability 0: not drawn even at u = 0 where it comes first,
    nor at the top of the distribution (u just below 1) where it comes last."""
    kernels = sampling_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the kernel is optional")
    logits = torch.tensor([[float("-inf"), float("-inf"), 1.0, 2.0, 0.5, float("-inf")]] * 2)
    ids, logprobs = kernels.sample(logits, torch.tensor([True, True]), torch.ones(2),
                                   torch.tensor([0.0, 1.0 - 2.0 ** -24]))
    assert ids.tolist() == [2, 4]
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1)[[0, 1], ids])
