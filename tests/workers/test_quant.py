"""Weight-only int8 / int4 / MXFP4: every kernel (quant_kernels.c, torch's, the dense fallback) against a
dequantize-then-matmul reference, the GGUF block conversions against the gguf package's own dequantizers,
and the forms' algebra (fusing rows, slicing columns) against the same operations on float weights."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from llmbus.testing.prequantized import mxfp4_weight as to_mxfp4
from llmbus.workers import mxfp4, quant
from llmbus.workers.gguf_checkpoint import GGUFRaw
from llmbus.workers.kernels import bindings, build
from llmbus.workers.linear import Linear

torch.manual_seed(0)
HAS_KERNEL = quant._library() is not None


def weight(n: int = 96, k: int = 160) -> torch.Tensor:
    return torch.randn(n, k) * 0.05


def reference(x: torch.Tensor, w: quant.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().T
    return (y + bias.double() if bias is not None else y).float()


@pytest.fixture(params=["ours", "torch"])
def backend(request, monkeypatch):
    """quant_kernels.c, or what runs without it (torch's kernels in bf16, a dense weight in float32)."""
    if request.param == "ours" and not HAS_KERNEL:
        pytest.skip("no AVX2 + FMA or no compiler: the tiled kernel does not run here")
    if request.param == "torch":
        monkeypatch.setenv(build.DISABLE_ENV, "0")
    bindings.library.cache_clear(), quant._library.cache_clear()
    yield request.param
    bindings.library.cache_clear(), quant._library.cache_clear()


FORMS = {"int8 row": lambda w: quant.quantize_int8(w, None), "int8 g32": lambda w: quant.quantize_int8(w, 32),
         "int4 g32": lambda w: quant.quantize_int4(w, 32), "int4 g64": lambda w: quant.quantize_int4(w, 64),
         "mxfp4": to_mxfp4}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("k", [160, 100])  # 100: not whole groups of 32 or 64 (nor of 128)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_equal_dequantized_matmul(backend, form, rows, k, dtype):
    w = FORMS[form](weight(100, k))
    bias = torch.randn(100) * 0.1
    linear = quant.QuantizedLinear(w, bias.to(dtype), dtype)
    x = torch.randn(rows, k).to(dtype)
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, 100)
    expected = reference(x.float(), w, bias.to(dtype).float())
    if dtype == torch.float32:  # float32 accumulation; ours carries x to ~2^-17 of itself
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    else:  # bf16 output (and, on torch's kernels, bf16 scales): a few bf16 steps
        torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.skipif(not HAS_KERNEL, reason="quant_kernels.c does not run here")
def test_our_kernel_takes_strided_rows_and_ragged_outputs():
    w = quant.quantize_int4(weight(37, 96))  # 37 rows: not whole tiles of 16
    linear = quant.QuantizedLinear(w, None, torch.float32)
    x = torch.randn(5, 200)[:, 10:106]  # rows 200 apart
    torch.testing.assert_close(linear(x), reference(x, w, None), rtol=1e-4, atol=1e-5)


def int16_reference(x: torch.Tensor, w: quant.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """What integer_products.c computes, exactly (float64): x quantized to 16 bits per block of 32 (d = max|x| /
    32767, q = x * (1 / d) rounded half away from zero, in float32), times the weight's exact values."""
    k = x.shape[1]
    blocks = F.pad(x.float(), (0, -k % 32)).reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 32767
    scaled = (blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d))).double()
    q = scaled.sign() * (scaled.abs() + 0.5).floor()
    y = (q * d.double()).reshape(x.shape[0], -1)[:, :k] @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


def wide_mxfp4(n: int, k: int) -> quant.Mxfp4Weight:
    """Every code, blocks of very different scales, and e8m0's subnormal end and a scale far from 1."""
    w = to_mxfp4(weight(n, k) * torch.logspace(-3, 1, k))
    assert set(w.values.unique().tolist()) == set(range(16))
    w.scale[0, :2], w.scale[1, 2] = 2.0 ** -127, 2.0 ** 100
    return w


INTEGER_FORMS = {"mxfp4": wide_mxfp4, "int4 g32": lambda n, k: quant.quantize_int4(weight(n, k) * 4, 32),
                "int4 g64": lambda n, k: quant.quantize_int4(weight(n, k), 64),
                "int8 g32": lambda n, k: quant.quantize_int8(weight(n, k) * 4, 32),
                "int8 g16": lambda n, k: quant.quantize_int8(weight(n, k), 16),  # Q6_K's
                "int8 row": lambda n, k: quant.quantize_int8(weight(n, k), None)}


@pytest.mark.skipif(not HAS_KERNEL, reason="the tiled kernels do not run here")
@pytest.mark.parametrize("form", INTEGER_FORMS)
@pytest.mark.parametrize("k", [160, 100])  # 100: the last block of activations (and group) ragged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_products_multiply_16_bit_activations(form, k, dtype):
    """MXFP4 and int4 weights multiply activations quantized to 16 bits in blocks of 32 (integer_products.c)
    where they enter at bfloat16's precision: up to float32 accumulation, the kernel gives the exact product of
    those values with the weights' values (int4's offsets against the quantized activations' sums), for any
    number of rows."""
    if form in ("mxfp4", "int8 g16") and k % 32:
        pytest.skip("MXFP4 is whole blocks of 32, and int8 in groups of 16 (Q6_K's rows: whole super-blocks)")
    w = INTEGER_FORMS[form](100, k)
    bias = torch.randn(100)
    for rows in (1, 5, 9, 70):
        x = torch.randn(rows, k) * torch.logspace(1, -2, k)  # a block's values far below its largest, too
        # a block whose largest is 32767 / 8: d = 1/8, and q = 8x are halves, which round away from zero
        x[0, 32:64] = torch.cat((torch.arange(-15.5, 15.5) / 8, torch.tensor([32767 / 8])))
        ours = quant.QuantizedLinear(w, bias, dtype, bf16_inputs=True)(x.to(dtype)).double()
        expected = int16_reference(x.to(dtype), w, bias)
        exact = reference(x.to(dtype).float(), w, bias).double()
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8  # float32 sums; bf16 outputs
        torch.testing.assert_close(ours, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
        assert (exact - expected).abs().max() > 1e-6 * expected.abs().max()  # the check tells them apart


@pytest.mark.skipif(not HAS_KERNEL, reason="the tiled kernels do not run here")
@pytest.mark.parametrize("form", ["mxfp4", "int4 g32", "int8 g16"])
def test_integer_products_take_blocks_whose_scale_is_subnormal(form):
    """A block whose largest value is below 2^-113 has a scale (largest / 32767) below 2^-128, whose inverse
    overflows float32: its values are divided by the scale instead, and the product stays the product (the
    weights' scales large enough that the block's scale times theirs stays a normal float32)."""
    big = weight(40, 96) * 2.0 ** 12
    w = {"mxfp4": to_mxfp4, "int4 g32": lambda b: quant.quantize_int4(b, 32),
         "int8 g16": lambda b: quant.quantize_int8(b, 16)}[form](big)
    x = torch.randn(3, 96) * 2.0 ** -118
    x[1, 32:64] *= 2.0 ** 100  # one ordinary block beside tiny ones
    ours = quant.QuantizedLinear(w, None, torch.float32, bf16_inputs=True)(x).double()
    exact = reference(x, w, None).double()
    assert ours.isfinite().all()
    torch.testing.assert_close(ours[[0, 2]], exact[[0, 2]], rtol=1e-3, atol=1e-3 * exact[[0, 2]].abs().max().item())


def test_mxfp4_scales_pack_as_their_e8m0_bytes():
    """The kernel keeps MXFP4's scales as the bytes gpt-oss publishes (a quarter of float32's memory): every
    e8m0 value goes there and back exactly, and a scale that is no power of two is refused."""
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(mxfp4.scale_bytes(mxfp4.scale_values(every)), every)
    with pytest.raises(ValueError, match="powers of two"):
        mxfp4.scale_bytes(torch.tensor([0.75]))
    if HAS_KERNEL:
        pack = quant.QuantizedLinear(to_mxfp4(weight(20, 64)), None, torch.bfloat16)._pack
        assert pack.scale.dtype == torch.uint8 and pack.scale.shape == (2, 2, 16)
        # byte 0 is 2^-127 (a float32 subnormal), not 0: 32 weights of 6 * 2^-127 against 2^120 give 1.5
        smallest = quant.Mxfp4Weight(torch.full((1, 32), 7, dtype=torch.uint8), torch.tensor([[2.0 ** -127]]))
        out = quant.QuantizedLinear(smallest, None, torch.float32)(torch.full((1, 32), 2.0 ** 120))
        assert out.item() == 1.5


@pytest.mark.skipif(not HAS_KERNEL, reason="the tiled kernels do not run here")
@pytest.mark.parametrize("form", ["mxfp4", "int4 g32", "int8 g16"])
@pytest.mark.parametrize("k", [96, 4160])  # 4160: 130 blocks, past a chunk that many rows widen at a time
def test_integer_product_rows_do_not_depend_on_the_rows_beside_them(form, k):
    """A row's result is the same bits alone or among others (each row's blocks are quantized and summed by
    themselves, whether the weights are widened for each block of rows or once for all of them), and a row
    holding an infinity or a NaN comes out NaN without touching the rest; a zero row gives the bias."""
    w = INTEGER_FORMS[form](37, k)  # 37 outputs: not whole tiles of 16
    bias = torch.randn(37)
    linear = quant.QuantizedLinear(w, bias, torch.float32, bf16_inputs=True)
    x = torch.randn(21, k)  # past 16 rows: int8 widens its values once for all rows there too
    x[3] = 0
    x[7, 40], x[8, 2] = float("inf"), float("nan")
    together = linear(x)
    for row in range(21):
        alone = linear(x[row:row + 1])
        assert torch.equal(alone, together[row:row + 1]) or (row in (7, 8) and alone.isnan().all()), row
    assert together[7:9].isnan().all() and not together[[r for r in range(21) if r not in (7, 8)]].isnan().any()
    assert torch.equal(together[3], bias)


def test_quantizers_stay_within_half_a_step():
    w = weight(96, 100)  # the last group of 32 has 4 columns
    for int8 in (quant.quantize_int8(w), quant.quantize_int8(w, 32)):
        step = quant._expand(int8.scale, 100, int8.group)
        assert ((int8.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    int4 = quant.quantize_int4(w)
    assert int4.scale.shape == (96, 4)
    step = quant._expand(int4.scale, 100, int4.group)
    assert ((int4.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    # min/max grids: the ends of each group are exact up to float rounding
    torch.testing.assert_close(int4.dequantize()[:, 96:].amax(dim=1), w[:, 96:].amax(dim=1))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_keep_their_values_exactly(kind):
    w = weight(64, 192).numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))
    converted = quant.from_gguf(GGUFRaw(kind, torch.from_numpy(blocks), w.shape))
    assert isinstance(converted, quant.Int8Weight if kind == "Q8_0" else quant.Int4Weight)
    assert converted.group == 32
    # float16 scales (and Q4_1's offsets) are exact in float32; q * d (+ m) rounds as gguf's does
    torch.testing.assert_close(converted.dequantize(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_gguf_weights_compute_with_the_files_values(backend, kind):
    w = weight(64, 192).numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    exact = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))
    linear = quant.QuantizedLinear(quant.from_gguf(GGUFRaw(kind, torch.from_numpy(blocks), w.shape)), None,
                                   torch.float32)
    x = torch.randn(3, 192)
    torch.testing.assert_close(linear(x), (x.double() @ exact.double().T).float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_fusing_rows_and_slicing_columns_match_float_operations(form):
    quantize = FORMS[form]
    a, b = weight(64, 192), weight(32, 192)
    qa, qb = quantize(a), quantize(b)
    fused = type(qa).cat([qa, qb])
    assert torch.equal(fused.dequantize(), torch.cat((qa.dequantize(), qb.dequantize())))
    for start, stop in ((64, 128), (128, 192)):
        assert torch.equal(qa.cols(start, stop).dequantize(), qa.dequantize()[:, start:stop])
    ragged = quantize(weight(8, 100))  # a slice may end at the ragged end
    assert torch.equal(ragged.cols(64, 100).dequantize(), ragged.dequantize()[:, 64:])
    if qa.group is not None:
        with pytest.raises(ValueError, match=f"multiples of {qa.group}"):
            qa.cols(8, 40)
    with pytest.raises(ValueError, match="different group sizes"):
        type(qa).cat([qa, qb.cols(0, 64 if qa.group is None else qa.group)])


def test_sliced_kernel_equals_sliced_float_weight(backend):
    w = quant.quantize_int4(weight(48, 192))
    x = torch.randn(2, 64)
    linear = quant.QuantizedLinear(w.cols(64, 128), None, torch.float32)
    torch.testing.assert_close(linear(x), (x.double() @ w.dequantize()[:, 64:128].double().T).float(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_equal_dequantized_rows_and_share_the_heads_copy(backend, group, dtype):
    table = quant.quantize_int8(weight(50, 100), group)
    embedding, head = quant.tied_embedding_and_head(table, dtype)
    ids = torch.tensor([[0, 7], [49, 7]])
    rows = embedding(ids)
    assert rows.shape == (2, 2, 100) and rows.dtype == dtype
    torch.testing.assert_close(rows, table.dequantize()[ids].to(dtype), rtol=0, atol=0)
    assert embedding._pack is head._pack  # one int8 matrix for both


def test_make_linear():
    w = weight()
    assert isinstance(quant.make_linear(w), Linear)
    made = quant.make_linear(w.bfloat16(), quantize="int4")
    assert isinstance(made, quant.QuantizedLinear) and made.method == "int4" and made.out_features == 96
    assert quant.make_linear(quant.quantize_int8(w), dtype=torch.float32).method == "int8"
    with pytest.raises(ValueError, match="unknown quantization"):
        quant.make_linear(w, quantize="int3")


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown quantization"):
        quant.quantize(weight(), "int3")
