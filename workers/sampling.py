"""Choosing the next token for a batch of requests, vectorised over the batch.

First the penalties, on the raw logits of the rows that asked for them (greedy rows too): the
repetition penalty exactly as transformers' ``RepetitionPenaltyLogitsProcessor``, then the frequency
penalty as TGI's ``HeterogeneousFrequencyPenaltyLogitsProcessor``. Both read the request's token history
(prompt and generated tokens so far), which the caller (rank 0's ModelRunner) keeps. Then greedy rows
take the argmax. Sampled rows go through temperature, top-k, top-p and typical-p (in that
order, as TGI does) expressed as masks over the whole ``[S, vocab]`` batch, then draw one token each by
inverse-CDF sampling with a single uniform number from the request's own ``torch.Generator``. The
generator is seeded with ``SamplingParams.seed`` on the request's first sampled token and kept until
``drop``: a seeded request yields the same tokens whatever else shares its batch.

Returned logprobs are those of the processed distribution (penalties, temperature and warpers).
Not applied here: ``watermark`` and ``top_n_tokens``.
"""

from __future__ import annotations

import torch

from llmbus.bus.messages import SamplingParams

_UINT64_MASK = (1 << 64) - 1
TOP_P_CANDIDATES = 256  # first guess at the nucleus size; a full sort when some row needs more


class Sampler:
    """Per-rank-0 sampler holding one CPU generator per seeded request, keyed by request id.

    Generators live on the CPU whatever the model device: one uniform per request is drawn there and
    sent over with a single copy, and CPU streams are reproducible across devices.
    """

    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.generators.pop(rid, None)

    def _generator(self, rid: str, seed: int) -> torch.Generator:
        generator = self.generators.get(rid)
        if generator is None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed & _UINT64_MASK)
            self.generators[rid] = generator
        return generator

    def __call__(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams],
                 histories: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``[S]`` (long) and their logprobs ``[S]`` (float32) for ``logits [S, vocab]``.

        ``histories[i]`` is row i's token history (1-D long, any device), needed only where
        ``has_penalties(params[i])``; other entries (or the whole list) may be None.
        """
        logits = logits.float()
        if any(has_penalties(p) for p in params):
            logits = apply_penalties(logits, params, histories)
        greedy_ids = logits.argmax(dim=-1)
        if not any(p.do_sample for p in params):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, greedy_ids[:, None]).squeeze(1)
            return greedy_ids, logprobs

        device = logits.device
        do_sample = torch.tensor([p.do_sample for p in params], device=device)
        temperature = torch.tensor([p.temperature if p.do_sample else 1.0 for p in params],
                                   dtype=torch.float32, device=device)
        warped = apply_warpers(logits / temperature[:, None], params)
        warped_logprobs = torch.log_softmax(warped, dim=-1)

        # Only sampled rows advance their generator; greedy rows get a dummy 0.
        uniforms = torch.tensor([torch.rand((), generator=self._generator(rid, p.seed)).item() if p.do_sample
                                 else 0.0 for rid, p in zip(rids, params)], dtype=torch.float32)
        uniforms = uniforms.to(device)
        cdf = warped_logprobs.exp().cumsum(dim=-1)
        total = cdf[:, -1:]
        # Kept strictly below the total, the target falls where the CDF jumps, which is never at a masked
        # token (adding a zero probability leaves the CDF flat); u * total alone could round up to it.
        targets = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        sampled_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1)

        token_ids = torch.where(do_sample, sampled_ids, greedy_ids)
        # Greedy rows are untouched by the warpers (temperature 1.0, no masks), so one log-softmax
        # serves both kinds of rows.
        return token_ids, warped_logprobs.gather(1, token_ids[:, None]).squeeze(1)


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[torch.Tensor | None] | None) -> torch.Tensor:
    """Repetition then frequency penalty on the raw ``logits [S, vocab]`` (float32) of the rows that ask.

    The penalised rows' histories go into one ``[P, max_len]`` index padded with ``vocab``, which points
    at an extra scratch column dropped at the end (as transformers does for ids beyond the logits).

    - repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``, CTRL): every token id
      present in the history gets ``logit * penalty`` if its logit is negative, else ``logit / penalty``.
    - frequency penalty, TGI's formula (``HeterogeneousFrequencyPenaltyLogitsProcessor``):
      ``logit -= penalty * count(token in history) / len(history)``, over the whole history (prompt and
      generated). TGI divides by its padded batch width and also counts its padding id 0; here each row
      divides by its own history's length and padding counts for nothing, which is what TGI gives a
      request that is alone in its batch.
    """
    rows = [i for i, p in enumerate(params) if has_penalties(p)]
    if histories is None or any(histories[i] is None or len(histories[i]) == 0 for i in rows):
        raise ValueError("a penalised row has no token history")
    device = logits.device
    vocab = logits.shape[1]
    seqs = [histories[i].to(device=device, dtype=torch.long) for i in rows]
    index = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=vocab).clamp_(max=vocab)
    row_index = torch.tensor(rows, device=device)
    scores = torch.nn.functional.pad(logits.index_select(0, row_index), (0, 1))

    repetition = torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32,
                              device=device)[:, None]
    if bool((repetition != 1.0).any()):  # a penalty of 1.0 leaves its row exactly as it was
        picked = scores.gather(1, index)
        # Duplicated ids write the same value twice, so scatter_ is deterministic here.
        scores.scatter_(1, index, torch.where(picked < 0, picked * repetition, picked / repetition))

    frequency = [params[i].frequency_penalty for i in rows]
    if any(frequency):
        lengths = torch.tensor([len(h) for h in seqs], dtype=torch.float32, device=device)
        counts = torch.zeros_like(scores).scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
        penalty = torch.tensor(frequency, dtype=torch.float32, device=device)
        # TGI's order of operations: frequency = count / length, then times the penalty. A 0.0 penalty
        # subtracts exact zeros.
        scores -= counts / lengths[:, None] * penalty[:, None]

    return logits.index_copy(0, row_index, scores[:, :vocab])


def apply_warpers(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and typical-p as ``-inf`` masks on temperature-scaled ``scores [S, vocab]``.

    Each warper only touches the rows that asked for it: a disabled top-p (1.0) must not trim a tail
    whose cumulative probability rounds to 1.
    """
    device = scores.device
    vocab = scores.shape[1]
    top_k = [min(p.top_k, vocab) if p.do_sample and p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p if p.do_sample else 1.0 for p in params]
    typical_p = [p.typical_p if p.do_sample else 1.0 for p in params]

    if any(top_k):
        k = torch.tensor([k or vocab for k in top_k], device=device)
        top_values = scores.topk(int(k.max()), dim=-1).values
        threshold = top_values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill(scores < threshold, float("-inf"))

    # top-p and typical-p sort the vocabulary, the costly part: only the rows that asked are sorted.
    top_p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if top_p_rows:
        rows = torch.tensor(top_p_rows, device=device)
        top_p_t = torch.tensor([top_p[i] for i in top_p_rows], dtype=torch.float32, device=device)
        subset = scores[rows]
        probs = subset.softmax(dim=-1)
        # A full sort of the vocabulary is slow on CPU, and the nucleus is usually a few dozen tokens:
        # take the top candidates, widening until they hold top_p of the mass in every row. Every token
        # outside them is then dropped anyway, so this is exact.
        sorted_probs, sorted_index = probs.topk(min(vocab, TOP_P_CANDIDATES), dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1)
        if sorted_probs.shape[1] < vocab and not bool((cumulative[:, -1] >= top_p_t).all()):
            sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
        # Drop a token once the mass of the tokens strictly more likely than it reaches top_p: the token
        # that crosses the threshold stays, and so does the first one always.
        keep_sorted = (cumulative - sorted_probs) < top_p_t[:, None]
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(subset, dtype=torch.bool).scatter_(1, sorted_index, keep_sorted)
        scores = scores.index_copy(0, rows, subset.masked_fill(~keep, float("-inf")))

    typical_rows = [i for i, p in enumerate(typical_p) if p < 1.0]
    if typical_rows:
        rows = torch.tensor(typical_rows, device=device)
        mass = torch.tensor([typical_p[i] for i in typical_rows], dtype=torch.float32, device=device)
        subset = scores[rows]
        log_probs = torch.log_softmax(subset, dim=-1)
        entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)
        surprise_gap = (-log_probs - entropy).abs()
        sorted_gap, sorted_index = surprise_gap.sort(dim=-1)
        cumulative = subset.gather(1, sorted_index).softmax(dim=-1).cumsum(dim=-1)
        last_kept = (cumulative < mass[:, None]).sum(dim=1).clamp(max=vocab - 1)
        remove_sorted = sorted_gap > sorted_gap.gather(1, last_kept[:, None])
        remove_sorted[:, 0] = False
        remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
        scores = scores.index_copy(0, rows, subset.masked_fill(remove, float("-inf")))
    return scores
