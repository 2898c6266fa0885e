"""Choosing the next token for a batch of requests, vectorised over the batch.

The logits go through TGI's ``NextTokenChooser`` order, each step only on the rows that asked for it, after
OpenAI's ``logit_bias`` (first, as transformers' ``SequenceBiasLogitsProcessor`` comes before its penalties, and
as vLLM and llama.cpp apply it):

0. the logit bias: each listed token's logit gets its value added (``logit + bias``, one float32 addition);
   then vLLM's ``min_tokens``: while a request has generated fewer, the ids that would end it get ``-inf``.
1. the watermark (Kirchenbauer et al., "lefthash" as TGI and transformers' ``WatermarkLogitsProcessor``):
   a ``torch.Generator`` seeded with ``15485863 * previous token`` permutes the vocabulary, and the first
   ``WATERMARK_GAMMA`` of it (the green list) gets ``+WATERMARK_DELTA``. Greedy rows too.
2. the penalties, greedy rows too: the repetition penalty exactly as transformers'
   ``RepetitionPenaltyLogitsProcessor``, then the frequency penalty as TGI's
   ``HeterogeneousFrequencyPenaltyLogitsProcessor``. Both read the request's token history (prompt and
   generated tokens so far), which the caller (rank 0's ModelRunner) keeps.
3. greedy rows take the argmax. Sampled rows go through temperature, top-k, top-p, min-p and typical-p (in
   that order: TGI's, with min-p, which TGI lacks, where transformers' ``generate`` puts its
   ``MinPLogitsWarper``) expressed as masks over the whole ``[S, vocab]`` batch, then draw one token each
   by inverse-CDF sampling with a single uniform number. On CPU the argmax, the log-softmax and the draw
   run in C, each row on its own (``sampling.c``: torch's whole-batch passes are a sizeable share of a large
   batch's step; design notes, "Choosing tokens in C on CPU"), except for the rows that ask for
   ``top_n_tokens``, drawn in torch's ops whose log-softmax gives their alternatives; the warpers stay torch
   ops. Each row is computed the same way whatever shares its step (its logprob too: a neighbour asking for
   top tokens does not move it).

The uniform is stateless: a function of the request's ``SamplingParams.seed`` and of the position of
the token being sampled only (``seeded_uniform``), never of how many tokens were drawn before. The
watermark's green list depends on the previous token only. So a seeded request yields the same tokens
whatever else shares its batch, and a request that is preempted and recomputed from its prompt and
generated tokens draws, at each position, what it would have drawn without the interruption. Nothing is
kept per request.

Returned logprobs are those of the processed distribution: the log-softmax after logit bias, watermark,
penalties, temperature and warpers (for greedy rows, after logit bias, watermark and penalties).
``top_n_tokens`` are the n most likely tokens of that same distribution, from one ``topk`` over the rows that
ask; tokens a warper masked out (probability 0) are left out, as TGI does, so a row may get fewer than n.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from llmbus.bus.messages import SamplingParams
from llmbus.workers import gpu_ops
from llmbus.workers.kernels import bindings
from llmbus.workers.launched_step import to_device
from llmbus.workers.step_rows import TokenHistory

TOP_P_CANDIDATES = 256  # first guess at the nucleus size; a full sort when some row needs more

# The watermark's defaults (TGI's): the green list's share of the vocabulary and the bias added to its
# logits; the workers' --watermark-gamma/--watermark-delta (TGI's WATERMARK_GAMMA/DELTA) override them.
# The hash key is the one TGI and transformers use, so their detectors apply.
WATERMARK_GAMMA = 0.5
WATERMARK_DELTA = 2.0
WATERMARK_HASH_KEY = 15485863

_UINT64_MASK = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's stream increment
_UNIFORM_BITS = 24  # a float32 holds these exactly: uniforms are multiples of 2**-24 in [0, 1)


def _mix64(z: int) -> int:
    """splitmix64's output function (Stafford's variant 13): a bijection of 64-bit words whose outputs,
    over consecutive multiples of the golden gamma, pass BigCrush."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in ``[0, 1)`` for ``(seed, position)``: the ``position``-th output of the
    splitmix64 stream that starts at ``mix(seed)``, cut to 24 bits.

    Counter-based, so a draw depends on nothing but its two arguments. Plain Python integers: cheaper
    per row than reseeding a torch.Generator, and for the batches served cheaper than the same hash
    vectorised in int64 tensor ops, whose ~20 small ops have a fixed cost (design notes, "Choosing
    tokens in C on CPU").
    """
    state = (_mix64(seed & _UINT64_MASK) + position * _GOLDEN_GAMMA) & _UINT64_MASK
    return (_mix64(state) >> (64 - _UNIFORM_BITS)) * (1.0 / (1 << _UNIFORM_BITS))


class Sampled(NamedTuple):
    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor  # [S] float32, of the processed distribution
    top: TopTokens | None = None  # the rows' top_n_tokens alternatives, on the device; None when none asked

    @property
    def top_tokens(self) -> list[list]:
        """Per row, [[ids], [logprobs]] of its top_n_tokens most likely tokens ([] where it asked for none);
        an empty list when no row asked (read from the device here)."""
        return self.top.lists() if self.top is not None else []


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           histories: list[torch.Tensor | None] | None = None,
           last_tokens: list[int] | None = None, prompt_lens: list[int] | None = None,
           watermark_gamma: float | None = None, watermark_delta: float | None = None) -> Sampled:
    """Token ids, their logprobs and the requested top tokens for ``logits [S, vocab]``.

    ``positions[i]`` is the position row i's token will take in its sequence (the tokens before it:
    ``num_computed + len(token_ids)`` of the step that samples it); with the seed it picks the row's
    uniform number (``seeded_uniform``). ``histories[i]`` is row i's token history (1-D long, any
    device), needed only where ``has_penalties(params[i])``; ``last_tokens[i]`` the token before the one
    being sampled (the last one fed for row i), needed only where ``params[i].watermark``;
    ``prompt_lens[i]`` where the generated part of the history starts, needed only for a presence
    penalty. Other entries (or the whole lists) may be None. ``watermark_gamma``/``watermark_delta``:
    see ``apply_watermark``.
    """
    logits = logits.float()
    if any(p.logit_bias_ids for p in params):
        logits = apply_logit_bias(logits, params)
    if any(p.min_new_tokens for p in params):
        logits = apply_min_tokens(logits, params, positions, prompt_lens)
    if any(p.watermark for p in params):
        logits = apply_watermark(logits, params, last_tokens, watermark_gamma, watermark_delta)
    if any(has_penalties(p) for p in params):
        logits = apply_penalties(logits, params, histories, prompt_lens)
    asks_top = [bool(p.top_n_tokens) for p in params]
    if not any(p.do_sample for p in params):
        greedy_ids, chosen = greedy(logits)
        if not any(asks_top):
            return Sampled(greedy_ids, chosen)
        # The rows that asked for top tokens take their token's logprob from the same log-softmax as those; the
        # others keep greedy()'s, as alone (whatever a neighbour asks, a row's logprob is computed the same way).
        logprobs = torch.log_softmax(logits, dim=-1)
        own = logprobs.gather(1, greedy_ids[:, None]).squeeze(1)
        return Sampled(greedy_ids, torch.where(_rows(asks_top, logits.device), own, chosen),
                       top_tokens(logprobs, params))
    # The rows' draw parameters, made on the CPU and sent over in one copy (from pinned memory on a GPU:
    # the host does not wait for it); greedy rows get temperature 1 and a dummy uniform 0.
    rows = torch.tensor([[float(p.do_sample) for p in params],
                         [p.temperature if p.do_sample else 1.0 for p in params],
                         [seeded_uniform(p.seed, position) if p.do_sample else 0.0
                          for p, position in zip(params, positions)]], dtype=torch.float32)
    if logits.device.type == "cuda":
        rows = to_device(rows, torch.float32, logits.device)
    do_sample, temperature, uniforms = rows[0] > 0.5, rows[1], rows[2]
    kernels = _kernels_for(logits)
    if kernels is not None:
        # The same draw as below, each row on its own: the warpers' masks (where a row asked for them) on
        # the scaled logits, else the kernel divides by the temperature itself.
        if any(_warps(p) for p in params):
            warped = apply_warpers(logits / temperature[:, None], params).contiguous()
            drawn = Sampled(*kernels.sample(warped, do_sample, torch.ones_like(temperature), uniforms,
                                            raw=logits.contiguous()))
        else:
            drawn = Sampled(*kernels.sample(logits, do_sample, temperature, uniforms))
        if not any(asks_top):
            return drawn
        # The rows that asked for top tokens are drawn in torch's ops, whose log-softmax gives their alternatives
        # (only those rows: every op is a row's own); the others keep the kernel's draw, as alone.
        asked = [i for i, a in enumerate(asks_top) if a]
        index = torch.tensor(asked)
        part = _sample_on_torch(logits.index_select(0, index), [params[i] for i in asked], do_sample[index],
                                temperature[index], uniforms[index])
        token_ids, logprobs = drawn.token_ids.clone(), drawn.logprobs.clone()
        token_ids[index], logprobs[index] = part.token_ids, part.logprobs
        top = TopTokens(part.top.ids, part.top.values, [asked[r] for r in part.top.rows],
                        _top_counts(params, logits.shape[1]), len(params))
        return Sampled(token_ids, logprobs, top)
    full = _sample_on_torch(logits, params, do_sample, temperature, uniforms)
    plain = [not p.do_sample and not p.top_n_tokens for p in params]
    if not any(plain):
        return full
    # greedy rows that asked for nothing more take greedy()'s token and logprob, as they do alone (on CUDA its
    # Triton kernels), whatever their neighbours sample
    greedy_ids, chosen = greedy(logits)
    mask = _rows(plain, logits.device)
    return Sampled(torch.where(mask, greedy_ids, full.token_ids), torch.where(mask, chosen, full.logprobs), full.top)


def _rows(flags: list[bool], device: torch.device) -> torch.Tensor:
    """A row mask on ``device`` (from pinned memory on a GPU: the host does not wait)."""
    return to_device(flags, torch.bool, device)


def _sample_on_torch(logits: torch.Tensor, params: list[SamplingParams], do_sample: torch.Tensor,
                     temperature: torch.Tensor, uniforms: torch.Tensor) -> Sampled:
    """``sample``'s draw in torch's ops (on any device), the rows' top tokens from the same log-softmax."""
    greedy_ids = logits.argmax(dim=-1)
    warped = apply_warpers(logits / temperature[:, None], params)
    warped_logprobs = torch.log_softmax(warped, dim=-1)
    overflowed = torch.isnan(warped_logprobs).any(dim=-1)
    # Checked on the host only on the CPU: on a GPU the check would wait for the device, so the (rarely
    # needed) replacement is always computed there.
    if logits.device.type != "cpu" or bool(overflowed.any()):
        # A temperature so small that logits / temperature overflow f32: sample from the limit of the
        # distribution as the temperature falls, all mass on the argmax, instead of from NaNs.
        limit = torch.full_like(warped_logprobs, float("-inf")).scatter_(1, greedy_ids[:, None], 0.0)
        warped_logprobs = torch.where(overflowed[:, None], limit, warped_logprobs)

    cdf = warped_logprobs.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    # Kept strictly below the total, the target falls where the CDF jumps, which is never at a masked
    # token (adding a zero probability leaves the CDF flat); u * total alone could round up to it.
    targets = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # never an id past the vocabulary, whatever the numbers did: one bad row must not kill the worker
    sampled_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)

    token_ids = torch.where(do_sample, sampled_ids, greedy_ids)
    # Greedy rows are untouched by the warpers (temperature 1.0, no masks), so one log-softmax
    # serves both kinds of rows.
    return Sampled(token_ids, warped_logprobs.gather(1, token_ids[:, None]).squeeze(1),
                   top_tokens(warped_logprobs, params))


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the first, on ties) and its log-softmax, for float32 ``logits [S, vocab]``: one C
    pass per row on CPU where the kernels build (``sampling.c``), two Triton kernels on CUDA
    (``gpu_ops.greedy``), torch's ops elsewhere."""
    kernels = _kernels_for(logits)
    if kernels is not None:
        return kernels.greedy(logits)
    if logits.is_cuda and gpu_ops.available(logits):
        return gpu_ops.greedy(logits)
    ids = logits.argmax(dim=-1)
    return ids, torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)


def _kernels_for(logits: torch.Tensor) -> SamplingKernels | None:
    """``sampling.c`` where it takes ``logits`` (float32 on CPU, rows contiguous), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        return None
    return sampling_kernels()


class TopTokens:
    """The ``top_n_tokens`` most likely tokens of the rows that asked (``rows``), best first, still on the
    device (``ids``, ``values``: ``[R, depth]``), so that the step's one copy to the host brings them with
    its tokens (launched_step.ResultCopy); ``lists`` reads them into ``Sampled.top_tokens``' form."""

    __slots__ = ("ids", "values", "rows", "counts", "num_rows")

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, rows: list[int], counts: list[int], num_rows: int):
        self.ids, self.values, self.rows, self.counts, self.num_rows = ids, values, rows, counts, num_rows

    def lists(self, ids: list[list[int]] | None = None, values: list[list[float]] | None = None) -> list[list]:
        """Per row ``[[ids], [logprobs]]`` (``[]`` where it asked for none), masked tokens (``-inf``) left
        out; from the host copies ``ids``/``values`` of the tensors when given, else read here."""
        if ids is None:
            ids, values = self.ids.tolist(), self.values.tolist()
        out: list[list] = [[] for _ in range(self.num_rows)]
        minus_inf = float("-inf")
        for row_ids, row_values, i in zip(ids, values, self.rows):
            n = self.counts[i]
            while n and row_values[n - 1] == minus_inf:  # sorted: the masked tokens come last
                n -= 1
            out[i] = [[int(t) for t in row_ids[:n]], row_values[:n]]
        return out


def _top_counts(params: list[SamplingParams], vocab: int) -> list[int]:
    """How many top tokens each row gets: what it asked for, at most the vocabulary."""
    return [min(p.top_n_tokens, vocab) for p in params]


def top_tokens(logprobs: torch.Tensor, params: list[SamplingParams]) -> TopTokens | None:
    """The ``top_n_tokens`` most likely tokens of each row of the processed ``logprobs [S, vocab]`` that asks;
    None when no row asks. One ``topk`` over the rows that ask, as deep as the largest n."""
    counts = _top_counts(params, logprobs.shape[1])
    if not any(counts):
        return None
    rows = [i for i, n in enumerate(counts) if n > 0]
    subset = logprobs if len(rows) == len(params) else logprobs.index_select(
        0, to_device(rows, torch.long, logprobs.device))
    best = subset.topk(max(counts), dim=-1)
    return TopTokens(best.indices, best.values, rows, counts, len(params))


@functools.lru_cache(maxsize=256)
def watermark_greenlist(previous_token: int, vocab: int, gamma: float) -> torch.Tensor:
    """The green list after ``previous_token`` as a CPU bool mask ``[vocab]`` (shared: not to be written).

    "lefthash" with a context of one token: a CPU generator seeded with ``hash key * previous token``
    draws a permutation of the vocabulary, whose first ``int(vocab * gamma)`` ids are green. The draw is
    what makes a watermarked row cost (a randperm of the vocabulary), hence the cache: a bool mask is one
    byte per token (256 of them hold 40 MB at a 150k vocabulary).
    """
    generator = torch.Generator().manual_seed((WATERMARK_HASH_KEY * previous_token) % (2**64 - 1))
    green = torch.randperm(vocab, generator=generator)[:int(vocab * gamma)]
    return torch.zeros(vocab, dtype=torch.bool).index_fill_(0, green, True)


def apply_watermark(logits: torch.Tensor, params: list[SamplingParams], last_tokens: list[int] | None,
                    gamma: float | None = None, delta: float | None = None) -> torch.Tensor:
    """``logits [S, vocab]`` (float32) with ``delta`` added to the green list of every row that asks for a
    watermark; ``gamma`` and ``delta`` default to ``WATERMARK_GAMMA`` and ``WATERMARK_DELTA``."""
    gamma = WATERMARK_GAMMA if gamma is None else gamma
    delta = WATERMARK_DELTA if delta is None else delta
    rows = [i for i, p in enumerate(params) if p.watermark]
    if last_tokens is None or any(last_tokens[i] is None for i in rows):
        raise ValueError("a watermarked row has no previous token")
    device, vocab = logits.device, logits.shape[1]
    green = to_device(torch.stack([watermark_greenlist(int(last_tokens[i]), vocab, gamma) for i in rows]),
                      torch.bool, device)
    # x + delta * 1.0 on green tokens and x + 0.0 elsewhere: exactly transformers' scores, and several
    # times faster on CPU than torch.where over a bool mask.
    green = green.to(logits.dtype)
    if len(rows) == len(params):
        return logits.add(green, alpha=delta)
    row_index = to_device(rows, torch.long, device)
    return logits.index_copy(0, row_index, logits.index_select(0, row_index).add_(green, alpha=delta))


def plain_greedy(params: SamplingParams) -> bool:
    """Whether ``sample`` takes ``greedy``'s choice for this row as it is: no draw, no top-n alternatives, no
    logit bias or min_tokens mask, no watermark and no penalty (what a decode graph computes beside its logits)."""
    return not (params.do_sample or params.top_n_tokens or params.logit_bias_ids or params.min_new_tokens
                or params.watermark or has_penalties(params))


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                     prompt_lens: list[int] | None) -> torch.Tensor:
    """``logits [S, vocab]`` with ``-inf`` at each row's ``min_tokens_masked_ids`` while it has generated fewer
    than ``min_new_tokens`` tokens (``positions[i] - prompt_lens[i]``: those before the one being sampled)."""
    if prompt_lens is None:
        raise ValueError("min_new_tokens needs the prompt lengths")
    held = [(i, p.min_tokens_masked_ids) for i, p in enumerate(params)
            if positions[i] - prompt_lens[i] < p.min_new_tokens and p.min_tokens_masked_ids]
    if not held:
        return logits
    index = _row_token_index(held, logits.device)
    masked = logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))
    # A row whose grammar allows nothing but a stop id (it is complete) keeps it: the grammar's answer must end,
    # and a row of -inf would draw garbage. Decided on the device: nothing here waits for it.
    return torch.where(torch.isfinite(masked).any(dim=-1, keepdim=True), masked, logits)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits [S, vocab]`` (float32) with each row's ``logit_bias_values`` added at its ``logit_bias_ids``:
    the biased entries are ``logit + bias`` in float32, every other entry is left as it was (a new tensor:
    the caller's logits may be a graph's output buffer)."""
    index = _row_token_index([(i, p.logit_bias_ids) for i, p in enumerate(params)], logits.device)
    values = to_device([v for p in params for v in p.logit_bias_values], torch.float32, logits.device)
    # The ids of a row are distinct (AddRequest.problem), so accumulating adds each value exactly once.
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def _row_token_index(row_tokens: list[tuple[int, list[int]]], device: torch.device) -> torch.Tensor:
    """``[2, n]`` (row, token) pairs of each ``(row, token ids)``, in order, on ``device`` in one copy (from pinned
    memory on a GPU: the host does not wait for it)."""
    return to_device([[row for row, tokens in row_tokens for _ in tokens],
                      [t for _, tokens in row_tokens for t in tokens]], torch.long, device)


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[TokenHistory | torch.Tensor | None] | None,
                    prompt_lens: list[int] | None = None) -> torch.Tensor:
    """Repetition, frequency then presence penalty on the raw ``logits [S, vocab]`` (float32) of the
    rows that ask.

    ``histories[i]``: row i's ``TokenHistory`` (its token counts, kept on the device by the runner), or its
    tokens as a 1-D long tensor (counted here, with ``prompt_lens[i]`` where its generated part starts).

    - repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``, CTRL): every token id
      present in the history gets ``logit * penalty`` if its logit is negative, else ``logit / penalty``.
    - frequency penalty, TGI's formula (``HeterogeneousFrequencyPenaltyLogitsProcessor``):
      ``logit -= penalty * count(token in history) / len(history)``, over the whole history (prompt and
      generated). TGI divides by its padded batch width and also counts its padding id 0; here each row
      divides by its own history's length and padding counts for nothing, which is what TGI gives a
      request that is alone in its batch. With ``frequency_per_count`` (the OpenAI routes), OpenAI's:
      ``logit -= penalty * count(token in the generated part)``, no division, the prompt not counted.
    - presence penalty, OpenAI's: ``logit -= penalty`` for every token id present in the generated part
      of the history (from ``prompt_lens[i]`` on). Not the prompt: a chat prompt holds the template's
      role and end-of-turn markers, and penalising those would keep the model from ending its answer.

    Nothing here waits for the device: the choices are made from ``params`` and the lengths on the host.
    """
    rows = [i for i, p in enumerate(params) if has_penalties(p)]
    if histories is None or any(histories[i] is None or len(histories[i]) == 0 for i in rows):
        raise ValueError("a penalised row has no token history")
    device = logits.device
    vocab = logits.shape[1]
    frequency = [params[i].frequency_penalty for i in rows]
    per_count = [params[i].frequency_per_count and params[i].frequency_penalty != 0.0 for i in rows]
    presence = [params[i].presence_penalty for i in rows]
    if prompt_lens is None and any(not isinstance(histories[i], TokenHistory) for i in rows):
        if any(per_count):
            raise ValueError("an OpenAI frequency penalty needs the prompt lengths")
        if any(presence):
            raise ValueError("a presence penalty needs the prompt lengths")
    counted = [histories[i] if isinstance(histories[i], TokenHistory) else
               TokenHistory.of(histories[i], prompt_lens[i] if prompt_lens is not None else 0, vocab, device)
               for i in rows]
    row_index = to_device(rows, torch.long, device)
    scores = logits.index_select(0, row_index)
    seen = torch.stack([h.seen[:vocab] for h in counted])

    # the generated parts' counts, read by OpenAI's frequency penalty and the presence penalty
    wants_generated = any(per_count) or (any(presence) and any(len(h) > h.prompt_len for h in counted))
    generated = torch.stack([h.generated[:vocab] for h in counted]) if wants_generated else None

    repetition = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in repetition):  # a penalty of 1.0 leaves its row exactly as it was
        factor = to_device(repetition, torch.float32, device)[:, None]
        scores = torch.where(seen > 0, torch.where(scores < 0, scores * factor, scores / factor), scores)

    if any(frequency):
        # a per-count row counts its generated part only, and divides by 1
        counts = seen
        if any(per_count):
            counts = torch.where(to_device(per_count, torch.bool, device)[:, None], generated, seen)
        values = to_device([[1.0 if per_count[r] else float(len(h)) for r, h in enumerate(counted)], frequency],
                           torch.float32, device)
        # TGI's order of operations: frequency = count / length, then times the penalty (OpenAI's rows divide
        # by 1). A 0.0 penalty subtracts exact zeros.
        scores -= counts / values[0][:, None] * values[1][:, None]

    if any(presence) and any(len(h) > h.prompt_len for h in counted):
        present = (generated > 0).float()
        scores -= present * to_device(presence, torch.float32, device)[:, None]

    # A repetition penalty near 0 (TGI only asks for > 0) divides a positive logit past float32's range: kept
    # at the largest float, the row's argmax and its log-softmax stay numbers instead of inf and NaN.
    scores = scores.clamp_(max=torch.finfo(torch.float32).max)
    return logits.index_copy(0, row_index, scores)


def _warps(p: SamplingParams) -> bool:
    """Whether ``apply_warpers`` masks a row with these parameters: it skips rows for which this is False,
    so a warper it does not name here would be left out everywhere, not only on the kernels' path."""
    return p.do_sample and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 or p.typical_p < 1.0)


def apply_warpers(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p, min-p and typical-p as ``-inf`` masks on temperature-scaled ``scores [S, vocab]``.

    Each warper only touches the rows that asked for it: a disabled top-p (1.0) must not trim a tail
    whose cumulative probability rounds to 1.
    """
    if not any(_warps(p) for p in params):
        return scores
    device = scores.device
    vocab = scores.shape[1]
    top_k = [min(p.top_k, vocab) if p.do_sample and p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p if p.do_sample else 1.0 for p in params]
    typical_p = [p.typical_p if p.do_sample else 1.0 for p in params]

    if any(top_k):
        k = [k or vocab for k in top_k]
        top_values = scores.topk(max(k), dim=-1).values
        k = to_device(k, torch.long, device)
        threshold = top_values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill(scores < threshold, float("-inf"))

    # top-p and typical-p sort the vocabulary, the costly part: only the rows that asked are sorted.
    top_p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if top_p_rows:
        rows = to_device(top_p_rows, torch.long, device)
        top_p_t = to_device([top_p[i] for i in top_p_rows], torch.float32, device)
        subset = scores[rows]
        probs = subset.softmax(dim=-1)
        # A full sort of the vocabulary is slow on CPU, and the nucleus is usually a few dozen tokens:
        # take the top candidates, widening until they hold top_p of the mass in every row. Every token
        # outside them is then dropped anyway, so this is exact. On a GPU the full sort is cheap, and the
        # check would wait for the device.
        width = min(vocab, TOP_P_CANDIDATES) if device.type == "cpu" else vocab
        sorted_probs, sorted_index = probs.topk(width, dim=-1) if width < vocab else \
            probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        if width < vocab and not bool((cumulative[:, -1] >= top_p_t).all()):
            sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
        # Drop a token once the mass of the tokens strictly more likely than it reaches top_p: the token
        # that crosses the threshold stays, and so does the first one always.
        keep_sorted = (cumulative - sorted_probs) < top_p_t[:, None]
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(subset, dtype=torch.bool).scatter_(1, sorted_index, keep_sorted)
        scores = scores.index_copy(0, rows, subset.masked_fill(~keep, float("-inf")))

    min_p_rows = [i for i, p in enumerate(params) if p.do_sample and p.min_p > 0.0]
    if min_p_rows:
        # min-p (transformers' MinPLogitsWarper, as vLLM and llama.cpp define it): drop the tokens whose
        # probability is below min_p times the most likely token's. min_p <= 1 (validated), so that token
        # always stays: a float product by at most 1 never exceeds it.
        rows = to_device(min_p_rows, torch.long, device)
        min_p = to_device([params[i].min_p for i in min_p_rows], torch.float32, device)
        subset = scores[rows]
        probs = subset.softmax(dim=-1)
        remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = scores.index_copy(0, rows, subset.masked_fill(remove, float("-inf")))

    typical_rows = [i for i, p in enumerate(typical_p) if p < 1.0]
    if typical_rows:
        rows = to_device(typical_rows, torch.long, device)
        mass = to_device([typical_p[i] for i in typical_rows], torch.float32, device)
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


class SamplingKernels:
    """``sampling.c``'s entries: the greedy choice, and the inverse-CDF draw, of float32 CPU logits ``[rows,
    vocab]`` (rows contiguous), with each chosen token's log-probability."""

    def __init__(self, library: ctypes.CDLL):
        """``library``: the kernel library, bound (``kernels.bindings.library``)."""
        self._greedy, self._sample = library.greedy_f32, library.sample_f32
        self._scratch = torch.empty(0, dtype=torch.float32)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first argmax and its log-softmax."""
        rows, vocab = logits.shape
        ids, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
        self._greedy(logits.data_ptr(), rows, vocab, logits.stride(0), ids.data_ptr(), logprobs.data_ptr())
        return ids, logprobs

    def sample(self, logits: torch.Tensor, sampled: torch.Tensor, temperatures: torch.Tensor,
               uniforms: torch.Tensor, raw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the first argmax where ``sampled`` (bool) is False, else the inverse-CDF draw at
        ``uniforms`` from the softmax of the row divided by ``temperatures``; and each token's
        log-probability under that distribution. ``raw``: the logits before warpers masked ``logits``
        (same shape and strides), whose argmax a row takes when its scaled logits overflow."""
        raw = logits if raw is None else raw
        if raw.shape != logits.shape or raw.stride() != logits.stride():
            raise ValueError("raw logits must have the warped logits' shape and strides")
        rows, vocab = logits.shape
        threads = torch.get_num_threads()
        if self._scratch.numel() < threads * vocab:
            self._scratch = torch.empty(threads * vocab, dtype=torch.float32)
        sampled = sampled.to(torch.uint8).contiguous()
        temperatures, uniforms = temperatures.float().contiguous(), uniforms.float().contiguous()
        ids, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
        self._sample(logits.data_ptr(), raw.data_ptr(), rows, vocab, logits.stride(0), sampled.data_ptr(),
                     temperatures.data_ptr(), uniforms.data_ptr(), self._scratch.data_ptr(),
                     self._scratch.numel() // vocab, ids.data_ptr(), logprobs.data_ptr())
        return ids, logprobs


@functools.cache
def sampling_kernels() -> SamplingKernels | None:
    """``sampling.c``'s entries, built if needed; None where they cannot be (``kernels.bindings.library``)."""
    library = bindings.library()
    return SamplingKernels(library) if library is not None else None
