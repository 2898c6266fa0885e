"""A penalty at the edge of what validation lets through (a repetition penalty of float32's smallest
positive value) must not turn a row's logits into inf and its logprobs into NaN, which JSON carries as null:
the penalised logit stays at float32's largest value, so greedy rows, sampled rows and top tokens all get
numbers. (Schemathesis found it through /v1/completions with temperature 0 and logprobs.)"""

from __future__ import annotations

import math

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.workers.sampling import sample

TINY = 1.401298464324817e-45  # float32's smallest positive (denormal) value


@pytest.mark.parametrize("top_n", [0, 2])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_tiny_repetition_penalty_keeps_logprobs_finite(top_n, do_sample):
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]] * 2)
    params = [SamplingParams(repetition_penalty=TINY, do_sample=do_sample, seed=1, top_n_tokens=top_n)] * 2
    out = sample(logits, params, [2, 2], [torch.tensor([0, 1])] * 2, [1, 1], [1, 1])
    assert out.token_ids.tolist() == [0, 0]  # the penalised positive logit is now the largest
    assert torch.isfinite(out.logprobs).all(), out.logprobs
    for row in out.top_tokens:
        assert all(math.isfinite(v) for v in row[1]), row
