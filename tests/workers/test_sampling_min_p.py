"""min-p, the warper llama.cpp and vLLM offer and TGI lacks, against transformers' ``MinPLogitsWarper``:
the same mask, in transformers' place among the warpers (after top-p, before typical-p), only on the rows
that ask, and through ``sample`` on the C kernels' path and torch's alike."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                                                    TypicalLogitsWarper)

from llmbus.bus.messages import SamplingParams
from llmbus.workers.sampling import apply_warpers, sample


def _reference(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``scores [1, vocab]`` through transformers' warpers in ``generate``'s order."""
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    if p.typical_p < 1.0:
        scores = TypicalLogitsWarper(p.typical_p)(None, scores)
    return scores


ROWS = [
    SamplingParams(do_sample=True, min_p=0.05),
    SamplingParams(do_sample=True, min_p=0.3),
    SamplingParams(do_sample=True),  # asks for nothing: untouched beside min-p rows
    SamplingParams(do_sample=True, min_p=1.0),  # only the most likely token
    SamplingParams(do_sample=True, top_k=40, top_p=0.95, min_p=0.1, typical_p=0.9),
    SamplingParams(min_p=0.5),  # greedy: warpers ignored
]


def test_min_p_masks_match_transformers():
    torch.manual_seed(5)
    logits = torch.randn(len(ROWS), 500) * 1.5
    ours = apply_warpers(logits, ROWS)
    for row, p in enumerate(ROWS):
        expected = _reference(logits[row:row + 1], p) if p.do_sample else logits[row:row + 1]
        assert torch.equal(ours[row:row + 1], expected), f"row {row}: {p}"
    assert torch.isfinite(ours[2]).all() and torch.isfinite(ours[5]).all()
    kept = torch.isfinite(ours).sum(dim=1).tolist()
    assert kept[3] == 1 and 1 < kept[1] < kept[0] < 500, kept


def test_sampled_tokens_stay_inside_the_min_p_set():
    """The draw never picks a token min-p removed, on the kernels' path (no top_n_tokens) and torch's, and
    the logprobs are those of the renormalised distribution."""
    torch.manual_seed(6)
    logits = torch.randn(64, 300) * 2
    params = [SamplingParams(do_sample=True, min_p=0.2, seed=s) for s in range(64)]
    allowed = torch.isfinite(apply_warpers(logits, params))
    for top_n in (0, 3):
        rows = [SamplingParams(do_sample=True, min_p=0.2, seed=s, top_n_tokens=top_n) for s in range(64)]
        out = sample(logits, rows, positions=list(range(64)))
        assert allowed.gather(1, out.token_ids[:, None]).all()
        expected = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1),
                                   rtol=0, atol=1e-5)
