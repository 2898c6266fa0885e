"""Greedy tokens two ways, for token-exact comparisons: transformers' on a model it loaded (with each
step's top-1/top-2 logit margin, which must be decisive for a match to mean anything) and a served
model's (``/generate``, EOS ignored)."""

from __future__ import annotations

import torch

from llmbus.testing.http import post

MIN_MARGIN = 1e-3


def greedy_with_margins(model, tokenizer, prompt: str, max_new_tokens: int,
                        **generate_kwargs) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and each one's top-1/top-2 margin of the processed scores (``generate_kwargs``:
    more of ``generate``'s, such as a ``sequence_bias``)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                         pad_token_id=tokenizer.eos_token_id, **generate_kwargs)
    top2 = [torch.topk(scores[0].float(), 2).values for scores in out.scores]
    return out.sequences[0, ids.shape[1]:].tolist(), [float(t[0] - t[1]) for t in top2]


def greedy_reference(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    tokens, margins = greedy_with_margins(model, tokenizer, prompt, max_new_tokens)
    assert all(margin > MIN_MARGIN for margin in margins), "reference margin not decisive"
    return tokens


def served_greedy(server, prompt: str, max_new_tokens: int) -> list[int]:
    status, _, body = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": max_new_tokens, "details": True, "ignore_eos_token": True}})
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]]
