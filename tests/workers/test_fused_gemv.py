"""The fused decode layer's GEMV (workers/kernels/csrc/decode_layer.c, ``gemv_proj``) against torch: float32 rows and
int8 rows with group scales, for every batch size it takes (1..8), output counts that are and are not
multiples of four, and group shapes that the batch-1 int8 loop (dot_int8_row) takes (32, 64) or leaves to
the general one (per row, 24, a ragged last group)."""

import ctypes

import pytest
import torch

from llmbus.workers import fused_decode
from llmbus.workers.kernels import bindings
from llmbus.workers.linear import StackedLinear
from llmbus.testing.prequantized import mxfp4_weight
from llmbus.workers.quant import QuantizedLinear, as_bf16, quantize_int4, quantize_int8, tiled_forms

LIBRARY = bindings.library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler: the fused decode layer is optional")


def gemv(proj: bindings.Proj, x: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.full((x.shape[0], out_features), float("nan"))
    width = max(part.tiled.k_padded for part in fused_decode._parts(proj)) or x.shape[1]
    prepared, sums = torch.empty(2 * x.shape[0] * width, dtype=torch.bfloat16), torch.empty(2 * x.shape[0] * width)
    assert LIBRARY.gemv_proj(ctypes.byref(proj), None if bias is None else bias.data_ptr(), x.data_ptr(),
                             x.shape[1], out_features, x.shape[0], y.data_ptr(), prepared.data_ptr(),
                             sums.data_ptr()) == 0
    return y


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize(("out_features", "in_features", "group"),
                         [(64, 96, 32), (67, 128, 64), (6, 32, 32), (3, 64, 32), (65, 96, None), (66, 96, 24),
                          (41, 80, 32)])
def test_int8_rows_give_the_dequantized_weights_product(rows, out_features, in_features, group):
    torch.manual_seed(rows * 1000 + out_features)
    weight = quantize_int8(torch.randn(out_features, in_features), group)
    x = torch.randn(rows, in_features)
    keep = []
    y = gemv(fused_decode._int8_proj(weight, keep), x, out_features)
    expected = (x.double() @ weight.dequantize().double().T).float()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (67, 100), (1, 7)])
def test_float32_rows_give_the_product(rows, out_features, in_features):
    torch.manual_seed(rows + out_features)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    keep = []
    y = gemv(fused_decode._dense_proj(weight, keep), x, out_features)
    torch.testing.assert_close(y, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-4)


def test_more_rows_than_one_pass_serves_are_passes_of_its_rows():
    """Past MAX_ROWS rows: passes of MAX_ROWS, each row the bits it has alone (issue #35 part 4)."""
    keep = []
    proj = fused_decode._dense_proj(torch.randn(5, 40), keep)
    x = torch.randn(3 * bindings.MAX_ROWS + 3, 40)
    alone = torch.cat([gemv(proj, x[b:b + 1], 5) for b in range(x.shape[0])])
    assert torch.equal(gemv(proj, x, 5), alone)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (67, 100), (5, 7), (3, 576)])
def test_bfloat16_copy_gives_the_same_bits_as_its_float32_rows(rows, out_features, in_features):
    """A float32 weight of bfloat16 numbers read through its bfloat16 copy: the same sums, bit for bit."""
    torch.manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features).bfloat16().float()
    x = torch.randn(rows, in_features)
    keep = []
    dense = fused_decode._dense_proj(weight, keep)
    compact = fused_decode._dense_proj(weight, keep)
    copies = fused_decode.Bfloat16Copies(budget=1 << 30)
    copies.add(compact, weight, keep)
    assert compact.bf16 and copies.made == 1 and copies.bytes == weight.numel() * 2
    assert torch.equal(gemv(compact, x, out_features), gemv(dense, x, out_features))


@pytest.mark.parametrize("form", ["float32", "bf16_copy", "int8"])
@pytest.mark.parametrize(("out_features", "in_features", "group"),
                         [(64, 96, 32), (67, 100, None), (5, 7, None), (3, 576, 32), (9, 96, 24), (7, 200, 64)])
def test_a_rows_sum_is_the_same_bits_whatever_the_batch(form, out_features, in_features, group):
    """Batch invariance (issue #35 part 4): row b of a pass of 1..8 rows gives the bits of that row alone."""
    if form == "int8" and group is None:
        pytest.skip("int8 takes a group")
    torch.manual_seed(out_features * 31 + in_features)
    weight, x = torch.randn(out_features, in_features), torch.randn(bindings.MAX_ROWS, in_features)
    keep = []
    if form == "int8":
        proj = fused_decode._int8_proj(quantize_int8(weight, group), keep)
    else:
        proj = fused_decode._dense_proj(weight.bfloat16().float() if form == "bf16_copy" else weight, keep)
        if form == "bf16_copy":
            fused_decode.Bfloat16Copies(budget=1 << 30).add(proj, weight.bfloat16().float(), keep)
    alone = torch.cat([gemv(proj, x[b:b + 1], out_features) for b in range(bindings.MAX_ROWS)])
    for rows in range(2, bindings.MAX_ROWS + 1):
        assert torch.equal(gemv(proj, x[:rows], out_features), alone[:rows]), f"{rows} rows"


def test_no_bfloat16_copy_of_float32_values_or_past_the_budget():
    keep = []
    exact = torch.randn(9000, 8).bfloat16().float()
    inexact = exact.clone()
    inexact[-1, -1] += 2.0 ** -20  # in the last chunk the check converts
    copies = fused_decode.Bfloat16Copies(budget=exact.numel() * 2)
    for weight in (inexact, exact, exact):
        copies.add(fused_decode._dense_proj(weight, keep), weight, keep)
    assert copies.made == 1 and copies.bytes == exact.numel() * 2  # the inexact one, then no room left


@pytest.mark.skipif(not tiled_forms(), reason="the tiled kernel needs AVX512-BF16 or AVX2 + FMA")
@pytest.mark.parametrize("bf16_inputs", [False, True])
@pytest.mark.parametrize("form", ["bf16", "int8", "int4", "mxfp4"])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (67, 128), (5, 32)])
def test_tiled_rows_are_the_kernels_bits_whatever_the_batch(form, out_features, in_features, bf16_inputs):
    """A tiled projection in the fused layer gives the bits the tiled kernels' product gives, and a row's
    result does not depend on how many rows are beside it (1, 3, 8 or 13: past MAX_ROWS too). Inputs as
    bf16 hi + lo carry x to ~2^-17; rounded to bf16 (the bfloat16 plan) the products are those of bf16(x), but
    for the integer forms' (int8 and int4 there, MXFP4 always), whose 16-bit activations carry x to 2^-16 of
    its block's largest."""
    torch.manual_seed(out_features + in_features)
    make = {"bf16": as_bf16, "int8": quantize_int8, "int4": quantize_int4, "mxfp4": mxfp4_weight}[form]
    weight = make(torch.randn(out_features, in_features))
    linear = QuantizedLinear(weight, None, torch.float32, bf16_inputs=bf16_inputs)
    keep = []
    proj = fused_decode._proj_args(linear, keep)
    assert proj.tiled.values
    x = torch.randn(13, in_features)
    alone = torch.cat([gemv(proj, x[i:i + 1], out_features) for i in range(13)])
    assert torch.equal(alone, linear(x))
    for rows in (1, 3, 8, 13):
        assert torch.equal(gemv(proj, x[:rows], out_features), alone[:rows])
    integers = form == "mxfp4" or (form in ("int8", "int4") and bf16_inputs)
    exact_x = x.bfloat16() if bf16_inputs and not integers else x
    torch.testing.assert_close(alone, (exact_x.double() @ weight.dequantize().double().T).float(), rtol=1e-4,
                               atol=1e-3)


@pytest.mark.skipif(not tiled_forms(), reason="the tiled kernel needs AVX512-BF16 or AVX2 + FMA")
@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_a_projection_stacked_from_parts_of_different_forms_gives_each_parts_bits(bf16_inputs):
    """A fused projection whose parts are kept in different forms (llama.cpp's Q4_K_M: Q4_K q and k, a Q6_K v)
    is one C projection of linked parts: each part's outputs, and its share of the bias, are that part's own
    product's bits, for any number of rows."""
    torch.manual_seed(3)
    weights = [quantize_int4(torch.randn(48, 96), 32), quantize_int8(torch.randn(32, 96), 16),
               as_bf16(torch.randn(21, 96))]  # 21: the last part's outputs are not a whole tile
    bias = torch.randn(101)
    shares = bias.split([48, 32, 21])
    parts = [QuantizedLinear(w, b, torch.float32, bf16_inputs=bf16_inputs) for w, b in zip(weights, shares)]
    stacked = StackedLinear(parts, bias)
    keep = []
    proj = fused_decode._proj_args(stacked, keep)
    assert [p.tiled.kind for p in fused_decode._parts(proj)] == [bindings.TILED_INT4, bindings.TILED_INT8,
                                                                  bindings.TILED_BF16]
    x = torch.randn(11, 96)
    expected = torch.cat([part(x) for part in parts], dim=1)
    assert torch.equal(stacked(x), expected)
    for rows in (1, 3, 8, 11):
        assert torch.equal(gemv(proj, x[:rows], 101, bias), expected[:rows])
