"""workers.linear.Linear: the oneDNN-packed projection gives F.linear's results (decode-sized and
prefill-sized inputs, with and without bias), and it is the path taken on this CPU."""

import pytest
import torch
import torch.nn.functional as F

from llmbus.workers.linear import Linear


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


def test_cpu_with_onednn_packs():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert Linear(torch.randn(8, 8)).packed
