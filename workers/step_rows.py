"""How a step's rows map to what it returns, beside the forward pass (``model_runner.py``): a penalised
request's token history, the logits rows of prompt logprobs, and speculative rows as one-token rows and back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmbus.workers.launched_step import to_device

if TYPE_CHECKING:
    from llmbus.workers.model_runner import SeqInput


class TokenHistory:
    """Every token computed so far for one penalised request, and how often each id occurs in it (all of it,
    and its generated part: from ``prompt_len`` on), on the model's device and updated there, so that a step
    whose token the host has not seen yet (fed on the device) records it all the same, and the penalties
    read the counts without a copy from the host. Ids past the vocabulary count in a last, unread column."""

    __slots__ = ("buffer", "length", "seen", "generated", "prompt_len", "vocab")

    def __init__(self, vocab: int, prompt_len: int, device: torch.device | str = "cpu", capacity: int = 64):
        self.vocab = vocab
        self.prompt_len = prompt_len
        self.buffer = torch.empty(capacity, dtype=torch.long, device=device)
        self.length = 0
        self.seen = torch.zeros(vocab + 1, dtype=torch.float32, device=device)
        self.generated = torch.zeros(vocab + 1, dtype=torch.float32, device=device)

    @classmethod
    def of(cls, tokens: torch.Tensor, prompt_len: int, vocab: int, device: torch.device) -> "TokenHistory":
        """The history of ``tokens`` (1-D, any device)."""
        history = cls(vocab, prompt_len, device, capacity=max(len(tokens), 1))
        history.write(0, tokens)
        return history

    def __len__(self) -> int:
        return self.length

    def write(self, start: int, token_ids: list[int] | torch.Tensor) -> None:
        """Put ``token_ids`` (a list, or a long tensor on the device) at positions ``start..``; anything
        recorded past ``start`` is replaced (a step computed again) and uncounted."""
        if start > self.length:
            raise ValueError(f"token history has {self.length} tokens, cannot write at position {start}")
        device = self.buffer.device
        tokens = to_device(token_ids, torch.long, device)
        if start < self.length:
            self._count(self.buffer[start:self.length], start, -1.0)
        end = start + len(tokens)
        if end > len(self.buffer):
            grown = torch.empty(max(end, 2 * len(self.buffer)), dtype=torch.long, device=device)
            grown[:start] = self.buffer[:start]
            self.buffer = grown
        self.buffer[start:end] = tokens
        self._count(tokens, start, 1.0)
        self.length = end

    def _count(self, tokens: torch.Tensor, start: int, sign: float) -> None:
        """Add ``sign`` per occurrence of ``tokens`` (at positions ``start..``) to the counts: float32 holds
        every count exactly, in any order of the additions."""
        if not len(tokens):
            return
        ids = tokens.clamp(max=self.vocab)
        ones = torch.full(ids.shape, sign, dtype=torch.float32, device=ids.device)
        self.seen.index_add_(0, ids, ones)
        first_generated = max(0, self.prompt_len - start)
        if first_generated < len(ids):
            self.generated.index_add_(0, ids[first_generated:], ones[first_generated:])

    def tokens(self) -> torch.Tensor:
        return self.buffer[:self.length]


@dataclass(slots=True)
class PromptLogprobRows:
    """Which logits rows a step needs when some sequences want prompt logprobs: every row of their
    prompt tokens, besides the last row of each sampled sequence."""

    logits_index: torch.Tensor  # rows of the flat token batch to compute logits for
    sample_rows: torch.Tensor  # positions in logits_index of the sampled sequences' last rows
    spans: list[tuple[SeqInput, int, int]]  # (sequence, first position in logits_index, prompt tokens in it)

    @classmethod
    def plan(cls, seqs: list[SeqInput], device: torch.device) -> "PromptLogprobRows | None":
        if not any(s.prompt_logprobs and s.num_computed < s.prompt_len for s in seqs):
            return None
        pieces, sample_rows, spans = [], [], []
        row, taken = 0, 0
        for seq in seqs:
            n = len(seq.token_ids)
            if seq.prompt_logprobs and seq.num_computed < seq.prompt_len:
                spans.append((seq, taken, min(n, seq.prompt_len - seq.num_computed)))
                pieces.append(torch.arange(row, row + n))
                taken += n
                if seq.sample:
                    sample_rows.append(taken - 1)
            elif seq.sample:
                pieces.append(torch.tensor([row + n - 1]))
                sample_rows.append(taken)
                taken += 1
            row += n
        return cls(torch.cat(pieces).to(device), torch.tensor(sample_rows, dtype=torch.long, device=device), spans)

    def gather(self, logits: torch.Tensor, pending: dict[str, torch.Tensor]) -> list[list]:
        """``[[rid, [logprobs], tops]]`` of the prompt tokens of this step, ``tops`` holding for each of them
        its position's ``top_n_tokens`` most likely tokens as ``[[ids], [logprobs]]`` (empty when the request
        asked for none); updates ``pending`` (see ModelRunner)."""
        out = []
        for seq, first, n in self.spans:
            logprobs = torch.log_softmax(logits[first:first + n].float(), dim=-1)
            tokens = torch.tensor(seq.token_ids[:n], dtype=torch.long, device=logits.device)
            # Row i scores token i + 1 of this chunk; the previous chunk's last row scores token 0.
            scoring = [logprobs[:-1]]
            values = logprobs[:-1].gather(1, tokens[1:, None]).squeeze(1)
            previous = pending.pop(seq.rid, None)
            if previous is not None:
                values = torch.cat((previous[tokens[0]].view(1), values))
                scoring.insert(0, previous[None])
            if seq.num_computed + n < seq.prompt_len:
                pending[seq.rid] = logprobs[-1]
            tops = []
            if seq.sampling.top_n_tokens:
                for rows in scoring:
                    top = rows.topk(seq.sampling.top_n_tokens, dim=-1)
                    tops += [[ids, lps] for ids, lps in zip(top.indices.tolist(), top.values.tolist())]
            out.append([seq.rid, values.tolist(), tops])
        return out


def one_token_rows(seqs: list[SeqInput]) -> list[SeqInput]:
    """A speculating decode as 1 + num_spec one-token decodes of itself, one per position, sharing its
    block table: each sees the K/V of the positions before it (every attention path writes a step's K/V
    before it attends), so the forward pass and sampling treat each position as a step of its own, and
    small steps keep the fused decode path."""
    rows = []
    for seq in seqs:
        if not (seq.num_spec and seq.sample):
            rows.append(seq)
            continue
        first = len(seq.token_ids) - 1 - seq.num_spec  # tokens before the last real one: a plain chunk
        if first > 0:
            rows.append(dataclasses.replace(seq, token_ids=seq.token_ids[:first], sample=False, num_spec=0))
        rows += [dataclasses.replace(seq, token_ids=[token], num_computed=seq.num_computed + first + r, num_spec=0)
                 for r, token in enumerate(seq.token_ids[first:])]
        rows[-1 - seq.num_spec].num_spec = seq.num_spec  # the first sampled row says how many follow
    return rows


def keep_verified(rows: list[SeqInput], tokens: list[int], logprobs: list[float],
                   top_tokens: list) -> tuple[list[str], list[int], list[float], list, list[int]]:
    """From one sample per row back to one entry per sequence: a speculating one keeps its guesses up to
    the first its samples disagree with, then that sample (or the one after its last guess); the others
    their one token. Also the rids, how many tokens each kept and one top_tokens entry per sequence."""
    rids, kept_tokens, kept_logprobs, kept_top, num_tokens = [], [], [], [], []
    i = 0
    while i < len(rows):
        seq = rows[i]
        guesses = [r.token_ids[0] for r in rows[i + 1:i + 1 + seq.num_spec]]
        n = 1
        while n <= seq.num_spec and tokens[i + n - 1] == guesses[n - 1]:
            n += 1
        rids.append(seq.rid)
        kept_tokens += tokens[i:i + n]
        kept_logprobs += logprobs[i:i + n]
        if top_tokens:
            kept_top.append(top_tokens[i])
        num_tokens.append(n)
        i += 1 + seq.num_spec
    return rids, kept_tokens, kept_logprobs, kept_top, num_tokens
