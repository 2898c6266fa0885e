"""``workers/gpu_ops.py``'s Triton kernels, run on the CPU by Triton's interpreter, against the torch ops they
replace in the decoder layer (``models/llama.py``): float32 to rounding, bfloat16 to two roundings of the
output (the kernels round once, at the end, torch after every op; and where a float32 intermediate differs in
its last bit, a bfloat16 rounding of it may fall the other way). The torch ops are run with ``available`` false:
under the interpreter, the layer's own calls would take the kernels too."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers import gpu_ops
from llmbus.workers.models.llama import RMSNorm

interpreted_triton_kernels()


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


@contextlib.contextmanager
def torch_ops():
    """The callers' torch path, as off the GPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_ops, "available", lambda tensor: False)
        yield


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # two bfloat16 roundings apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96])  # a power of two, and one whose block is masked
def test_rms_norm_and_the_residual_add_before_it(dtype, width):
    torch.manual_seed(0)
    norm = RMSNorm(torch.randn(width).to(dtype), 1e-6)
    residual = torch.randn(5, width) * 3
    update = torch.randn(5, width).to(dtype)
    assert gpu_ops.available(residual)
    with torch_ops():
        want, want_summed = norm(update), norm(residual + update)
    _close(gpu_ops.rms_norm(update, norm.weight, norm.eps), want)
    expected_sum = residual + update
    normed, summed = gpu_ops.rms_norm(update, norm.weight, norm.eps, residual=residual)
    assert summed is residual and torch.equal(residual, expected_sum)
    _close(normed, want_summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [3, 20])  # fewer than one tile of heads, and more
def test_rotary_on_queries_and_keys(dtype, heads):
    torch.manual_seed(1)
    x = torch.randn(4, heads, 32).to(dtype)
    angles = torch.randn(4, 1, 16)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)
    _close_rotated(gpu_ops.rotary(x, cos, sin), x, cos, sin)
    # a view of the fused QKV output, as the attention layer passes it: rows strided past the heads
    qkv = torch.randn(4, heads + 2, 32).to(dtype)
    _close_rotated(gpu_ops.rotary(qkv[:, :heads], cos, sin), qkv[:, :heads], cos, sin)


def _close_rotated(got, x, cos, sin) -> None:
    """``x * cos + rotate(x) * sin`` cancels where its two terms nearly meet, so a bfloat16 result is held to
    roundings of the terms, not of itself."""
    with torch_ops():
        want = gpu_ops.apply_rotary(x, cos, sin)
    if x.dtype == torch.float32:
        return _close(got, want)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1).float()
    scale = x.float().abs() * cos.float().abs() + swapped.abs() * sin.float().abs()
    assert got.dtype == want.dtype
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * scale + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(3, 2 * 1100) * 4).to(dtype)  # two column tiles, the second masked
    gate, up = gate_up.chunk(2, dim=-1)
    _close(gpu_ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("dtype", "largest"), [(torch.float32, 8), (torch.bfloat16, 8), (torch.float32, 40)])
def test_lora_delta_gives_each_row_its_own_adapters_delta(dtype, largest):
    """Rows of the base model (slot 0: untouched, even where slot 0's matrices are not zero), of adapters of
    rank 3 and ``largest`` (the others zero-padded to it; 40 takes the kernels more than one tile of ranks),
    in any order, on widths that are not multiples of the kernels' tiles (1100 inputs: three partial sums)."""
    rows, width, out_features = 7, 1100, 150
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    y = torch.randn(rows, out_features, generator=generator).to(dtype)
    ranks = {1: 3, 2: largest}
    shrink = torch.randn(3, largest, width, generator=generator).to(dtype)
    expand = torch.randn(3, out_features, largest, generator=generator).to(dtype)
    for slot, rank in ranks.items():  # what padding holds: zeros past each adapter's rank
        shrink[slot, rank:] = 0
        expand[slot, :, rank:] = 0
    slots = torch.tensor([1, 0, 2, 2, 0, 1, 2], dtype=torch.int32)
    want = y.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot:
            a, b = shrink[slot, :ranks[slot]].float(), expand[slot, :, :ranks[slot]].float()
            want[row] = (y[row].float() + b @ (a @ x[row].float())).to(dtype)
    got = gpu_ops.lora_delta(x, y.clone(), shrink, expand, slots)
    assert torch.equal(got[slots == 0], y[slots == 0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-4)
    else:  # the kernel adds in float32 and rounds once
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)


def test_greedy_takes_the_first_argmax_and_its_log_softmax():
    """Over a vocabulary of three chunks (the last partial): a row whose maximum is tied across two chunks
    (the first wins, as torch.argmax), one whose first chunk is all -inf (a grammar's mask), one of noise."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9000, generator=generator) * 4
    logits[0, 5000] = logits[0, 8999] = logits[0, 10] = 30.0  # tied in chunks 0, 1 and 2: index 10 wins
    logits[1, :4096] = float("-inf")
    ids, logprobs = gpu_ops.greedy(logits)
    assert ids.dtype == torch.long and ids.tolist() == logits.argmax(dim=-1).tolist()
    assert ids[0] == 10
    want = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want, rtol=1e-5, atol=1e-5)


def test_the_launch_arithmetic_is_tritons():
    """The launch wrappers' next_power_of_2 and cdiv, computed plainly (triton's go through its constexpr-function
    wrapper on every call), give triton's values."""
    import triton

    from llmbus.workers import _gpu_ops_kernels as kernels

    for n in range(0, 5000):
        assert kernels.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 1024):
            assert kernels.cdiv(n, d) == triton.cdiv(n, d), (n, d)
