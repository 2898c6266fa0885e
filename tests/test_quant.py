"""Weight-only int8 / int4: the kernels against a dequantize-then-matmul reference, the GGUF block
conversions against the gguf package's own dequantizers, and the forms' algebra (fusing rows, slicing
columns) against the same operations on float weights."""

from __future__ import annotations

import gguf
import pytest
import torch

from llmbus.workers import quant
from llmbus.workers.gguf_checkpoint import GGUFRaw

torch.manual_seed(0)


def weight(n: int = 96, k: int = 160) -> torch.Tensor:
    return torch.randn(n, k) * 0.05


def reference(x: torch.Tensor, w: quant.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().T
    return (y + bias.double() if bias is not None else y).float()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernels_equal_dequantized_matmul(method, rows, with_bias):
    w = quant.quantize(weight(), method)
    bias = torch.randn(96) * 0.1 if with_bias else None
    linear = quant.QuantizedLinear(w, bias.to(torch.bfloat16) if with_bias else None, torch.bfloat16)
    x = torch.randn(rows, 160)
    y = linear(x.to(torch.bfloat16)).float()
    # bf16 inputs, scales and output: within a few bf16 steps of the exact product
    torch.testing.assert_close(y, reference(x.to(torch.bfloat16).float(), w, bias), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_float32_computes_with_the_quantized_values_exactly(method):
    w = quant.quantize(weight(), method)
    linear = quant.QuantizedLinear(w, None, torch.float32)
    x = torch.randn(5, 160)
    torch.testing.assert_close(linear(x), reference(x, w, None), rtol=1e-5, atol=1e-5)


def test_quantizers_stay_within_half_a_step():
    w = weight()
    int8 = quant.quantize_int8(w)
    assert ((int8.dequantize() - w).abs() <= int8.scale[:, None] / 2 + 1e-7).all()
    int4 = quant.quantize_int4(w)
    step = int4.scale.repeat_interleave(int4.group, dim=1)
    assert ((int4.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_int4(torch.randn(4, 40))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_keep_their_values(kind):
    w = weight().numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))
    converted = quant.from_gguf(GGUFRaw(kind, torch.from_numpy(blocks), w.shape))
    torch.testing.assert_close(converted.dequantize(), expected, rtol=0, atol=1e-7)


def test_gguf_q8_0_is_requantized_per_row():
    w = weight().numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    converted = quant.from_gguf(GGUFRaw("Q8_0", torch.from_numpy(blocks), w.shape))
    assert isinstance(converted, quant.Int8Weight)
    assert ((converted.dequantize() - expected).abs() <= converted.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fusing_rows_and_slicing_columns_match_float_operations(method):
    a, b = weight(64, 128), weight(32, 128)
    fused = type(quant.quantize(a, method)).cat([quant.quantize(a, method), quant.quantize(b, method)])
    torch.testing.assert_close(fused.dequantize(), torch.cat((quant.quantize(a, method).dequantize(),
                                                               quant.quantize(b, method).dequantize())))
    sliced = quant.quantize(a, method).cols(32, 96)
    torch.testing.assert_close(sliced.dequantize(), quant.quantize(a, method).dequantize()[:, 32:96])
    if method == "int4":
        with pytest.raises(ValueError, match="multiples of 32"):
            quant.quantize(a, method).cols(8, 40)


def test_int8_embedding_rows_equal_dequantized_rows():
    table = quant.quantize_int8(weight(50, 64))
    ids = torch.tensor([0, 7, 49, 7])
    rows = quant.QuantizedEmbedding(table, torch.float32)(ids)
    torch.testing.assert_close(rows, table.dequantize()[ids])


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown quantization"):
        quant.quantize(weight(), "int3")
