"""Draft-model speculation on rank 0: a small causal LM with the target's tokenizer guesses each
speculating request's next tokens greedily, in place of the scheduler's n-gram lookup.

The draft keeps a KV pool of its own with the target's block size and block count, addressed by the same
block tables: a position's draft K/V lives in the draft pool's copy of the block that holds its target
K/V. Every step the draft computes the tokens the target computes (so its cache follows every request),
then, for each speculating request, one greedy token per guess after the last real token. A guess is
verified like any other (model_runner: kept while the target's own draw agrees), so the draft only changes
how many tokens a step keeps, never which. Positions past what the target keeps are rewritten by later
steps in both pools alike.
"""

from __future__ import annotations

import dataclasses

import torch

from llmbus.bus.messages import SamplingParams

_GREEDY = SamplingParams()


def _draft_row(seq, token_ids: list[int], num_computed: int, sample: bool):
    """``seq`` (a SeqInput) as the draft computes it: ``token_ids`` after ``num_computed`` cached ones,
    greedy, and none of the target's own sampling work (guesses, grammar, prompt logprobs). The draft has
    no LoRA adapters: it guesses with its own weights, and the target's verification keeps the adapter's
    tokens."""
    return dataclasses.replace(seq, token_ids=token_ids, num_computed=num_computed, sample=sample,
                               sampling=_GREEDY, num_spec=0, grammar=None, prompt_logprobs=False, adapter="")


def _checked(out):
    """The draft's step output; a draft step that ran out of memory fails the target's step with it (the
    target's step handles that as its own, model_runner.ModelRunner.step)."""
    if out.failed:
        raise torch.OutOfMemoryError(out.failed)
    return out


class DraftProposer:
    def __init__(self, runner):
        self.runner = runner  # a ModelRunner of the draft model (rank 0 only, one rank)
        # rid -> (position, token) of its last guess, whose draft K/V was never computed (nothing came
        # after it): if the target keeps it, the draft computes it first thing next step
        self.uncomputed: dict[str, tuple[int, int]] = {}

    def fill(self, seqs: list) -> None:
        """Replace the placeholder guesses of ``seqs`` (SeqInput) with the draft's greedy tokens, in place."""
        first_pass = []
        for seq in seqs:
            real = len(seq.token_ids) - seq.num_spec if seq.sample else len(seq.token_ids)
            tokens, start = seq.token_ids[:real], seq.num_computed
            last_guess = self.uncomputed.pop(seq.rid, None)
            if last_guess is not None and last_guess[0] == start - 1:  # kept by the target
                tokens, start = [last_guess[1], *tokens], start - 1
            first_pass.append(_draft_row(seq, tokens, start, bool(seq.sample and seq.num_spec)))
        out = _checked(self.runner.step(first_pass))
        guesses = dict(zip(out.rids, ([t] for t in out.token_ids)))
        speculating = [s for s in seqs if s.sample and s.num_spec]
        for r in range(1, max((s.num_spec for s in speculating), default=0)):
            more = [s for s in speculating if s.num_spec > r]
            position = {s.rid: s.num_computed + len(s.token_ids) - s.num_spec + r - 1 for s in more}
            out = _checked(self.runner.step([_draft_row(s, [guesses[s.rid][-1]], position[s.rid], True)
                                             for s in more]))
            for rid, token in zip(out.rids, out.token_ids):
                guesses[rid].append(token)
        for seq in speculating:
            seq.token_ids = seq.token_ids[:len(seq.token_ids) - seq.num_spec] + guesses[seq.rid]
            self.uncomputed[seq.rid] = (seq.num_computed + len(seq.token_ids) - 1, seq.token_ids[-1])

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.uncomputed.pop(rid, None)
        self.runner.drop(rids)
