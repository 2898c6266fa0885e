"""workers.linear.Linear: gemm.c and the oneDNN-packed projection give F.linear's results (decode-sized and
prefill-sized inputs, with and without bias, shapes that fill no tile evenly), and which one a CPU takes."""

import pytest
import torch
import torch.nn.functional as F

from llmbus.workers import linear as linear_module
from llmbus.workers.linear import Linear, float32_gemm

needs_gemm = pytest.mark.skipif(float32_gemm() is None, reason="gemm.c runs on AVX2 + FMA without AVX-512")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_packed_linear_equals_f_linear(dtype, atol, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    for b in (None, bias):
        got, expected = Linear(weight, b)(x), F.linear(x, weight, b)
        assert got.shape == expected.shape == (rows, 96)
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=atol)


@needs_gemm
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 129, 300])  # panels of 16, blocks of 128 rows
@pytest.mark.parametrize("out_features, in_features", [(5, 3), (13, 64), (96, 770), (600, 1536)])  # tiles of 6,
def test_gemm_equals_f_linear(rows, out_features, in_features):                                   # blocks of 768
    torch.manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features + 2)[:, 1:-1]  # a strided view: Linear makes it contiguous
    for b in (None, bias):
        linear = Linear(weight, b)
        assert linear.gemm is not None and linear.plain and linear.packed is None
        torch.testing.assert_close(linear(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


def test_cpu_with_onednn_packs(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(linear_module, "float32_gemm", lambda: None)
    linear = Linear(torch.randn(8, 8))
    assert linear.packed is not None and not linear.plain
    both = Linear(torch.randn(8, 8), keep_plain=True)
    assert both.packed is not None and both.plain


@needs_gemm
def test_float32_on_this_cpu_takes_gemm_on_the_plain_weight_alone():
    linear = Linear(torch.randn(8, 8), keep_plain=True)
    assert linear.gemm is not None and linear.plain and linear.packed is None
    assert Linear(torch.randn(8, 8, dtype=torch.bfloat16)).gemm is None


def test_plain_projections_are_also_packed_while_the_second_copies_fit(monkeypatch):
    """For the fused decode layer, dense projections keep their plain form; a packed second copy (faster
    GEMMs for prompts and large batches) is added while the copies fit in SECOND_COPY_SHARE of the host's
    available memory, and the ones past it stay plain only, computing through F.linear."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    from llmbus.workers import weight_builder

    monkeypatch.setattr(linear_module, "float32_gemm", lambda: None)  # where gemm.c runs nothing is packed
    weight_bytes = 16 * 32 * 4
    monkeypatch.setattr(weight_builder, "mem_available_bytes",
                        lambda: int(2.5 * weight_bytes / weight_builder.SECOND_COPY_SHARE))
    build = weight_builder.WeightBuilder(object(), rank=0, world_size=1, dtype=torch.float32,
                                         device=torch.device("cpu"), keep_plain=True)
    linears = [build._dense_linear(torch.randn(16, 32), None) for _ in range(4)]
    assert [(lin.plain, lin.packed is not None) for lin in linears] == [(True, True)] * 2 + [(True, False)] * 2
    x = torch.randn(5, 32)
    for lin in linears:
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=0, atol=1e-5)
    assert "2 dense projections kept plain and packed" in build.summary()
    unbounded = weight_builder.WeightBuilder(object(), rank=0, world_size=1, dtype=torch.float32,
                                             device=torch.device("cpu"))
    assert not unbounded._dense_linear(torch.randn(16, 32), None).plain
