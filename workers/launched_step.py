"""A step whose device work is queued but whose tokens are not yet on the host (issue #39: the GPU never waits
for the scheduler).

``ModelRunner.launch`` queues a step's forward pass, its sampling and the copy of its tokens to the host, and
returns a ``LaunchedStep``; ``result()`` waits for that copy (the one synchronisation of a decode step) and
builds the ``StepOutput``. Between the two, the worker can launch the next step, which the scheduler sent
ahead with ``SAMPLED_LAST`` where each running request's last token goes: a ``DeviceFeed`` writes those tokens
from this step's sampled ids, still on the device, into the next step's input, so the device runs one step
after the other without the host's turnaround between them (vLLM v1's async scheduling and SGLang's overlap
scheduler do the same). On the CPU a step's work is done when ``launch`` returns, so ``ready()`` is true at
once and the worker answers before it reads the next command, as it did before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from llmbus.workers import pinned_staging

if TYPE_CHECKING:
    from llmbus.workers.sampling import TopTokens


@dataclass(slots=True)
class StepOutput:
    """Rank 0's result of a step: one token per sequence that sampled, in input order (several for one
    that speculated: ``num_tokens``)."""

    rids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    forward_time: float  # seconds
    sample_time: float
    # [[rid, [logprob of prompt tokens computed this step]]]; a request's lists over its chunks concatenate
    # to its prompt tokens 1..n-1 (the first token has nothing to be predicted from).
    prompt_logprobs: list[list] = field(default_factory=list)
    # Per sampled sequence [[ids], [logprobs]] of its top_n_tokens ([] where none asked); [] if none did.
    top_tokens: list[list] = field(default_factory=list)
    errors: list[list] = field(default_factory=list)  # [[rid, error type, why]]: constrained requests that fail
    num_tokens: list[int] = field(default_factory=list)  # tokens per sequence; [] when each has one
    failed: str = ""  # not empty: the step ran out of memory and nothing of it counts (why; out_of_memory_step)


class ResultCopy:
    """A step's sampled ids, their logprobs and the top alternatives asked for, on their way to the host: one
    non-blocking copy into pinned memory (``pack``), queued when the step is launched (so it runs before any
    later step's work on the stream), and waited for by ``lists()`` (``unpack``)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor, top: "TopTokens | None" = None,
                 packed: torch.Tensor | None = None):
        """``packed``: ``pack``'s vector made already (a replayed graph's, of its ``b`` rows: ids, then
        logprobs from ``b`` on), of which ``token_ids`` and ``logprobs`` are the first rows."""
        self.event: torch.cuda.Event | None = None
        self.top = top
        if token_ids.device.type == "cpu":
            self.ids, self.values = token_ids, logprobs
            return
        flat = pack(token_ids, logprobs, top) if packed is None else packed
        self.host = pinned_staging.RESULTS.take(flat.numel())
        self.host.copy_(flat, non_blocking=True)
        self.rows = len(token_ids)
        self.logprobs_at = self.rows if packed is None else packed.shape[0] // 2
        self.event = torch.cuda.Event()
        self.event.record()

    def lists(self) -> tuple[list[int], list[float], list[list]]:
        """(ids, logprobs, top tokens as ``Sampled.top_tokens`` gives them: [] when none was asked)."""
        if self.event is None:
            return self.ids.tolist(), self.values.tolist(), self.top.lists() if self.top is not None else []
        if self.host is not None:  # read once: the buffer goes back to the pool for a later step's copy
            self.event.synchronize()
            self.read = self.host.tolist()
            pinned_staging.RESULTS.give_back(self.host)
            self.host = None
        return unpack(self.read, self.rows, self.top, self.logprobs_at)


def pack(token_ids: torch.Tensor, logprobs: torch.Tensor, top: "TopTokens | None") -> torch.Tensor:
    """One float64 vector of a step's results (float64 holds every id exactly): ids, logprobs, then the top
    alternatives' ids and logprobs, row by row."""
    parts = [token_ids.double(), logprobs.double()]
    if top is not None:
        parts += [top.ids.double().flatten(), top.values.double().flatten()]
    return torch.cat(parts)


def unpack(values: list[float], rows: int, top: "TopTokens | None",
           logprobs_at: int | None = None) -> tuple[list[int], list[float], list[list]]:
    """``pack``'s vector, read on the host, as ``ResultCopy.lists`` gives it (``logprobs_at``: where the
    logprobs start, if not right after the ``rows`` ids)."""
    at = rows if logprobs_at is None else logprobs_at
    ids, logprobs = [int(i) for i in values[:rows]], values[at:at + rows]
    if top is None:
        return ids, logprobs, []
    depth = top.ids.shape[1]
    size = len(top.rows) * depth
    top_ids, top_values = values[2 * rows:2 * rows + size], values[2 * rows + size:]
    return ids, logprobs, top.lists([top_ids[r:r + depth] for r in range(0, size, depth)],
                                    [top_values[r:r + depth] for r in range(0, size, depth)])


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a tensor) as a tensor on ``device`` without waiting for it: from the host on a GPU
    through pinned memory (``pinned_staging.UPLOADS``) and a non-blocking copy, queued behind the step's work
    (``torch.tensor(values, device=cuda)`` copies from pageable memory, which first waits for everything queued
    on the stream)."""
    tensor = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return pinned_staging.UPLOADS.upload(tensor, device)


def fed_ids(token_lists, feed: "DeviceFeed | None", device: torch.device) -> torch.Tensor:
    """A step's flat token ids (``token_lists``: each row's, in order) on ``device``, the ``SAMPLED_LAST`` rows
    written from ``feed`` where there is one."""
    return fed_ids_and(token_lists, feed, [], device)[0]


def fed_ids_and(token_lists, feed: "DeviceFeed | None", values: list[int],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``fed_ids``, and ``values`` (more of the step's int64s: its logits rows) on ``device`` too, all in one
    copy with the feed's rows and picks: on a GPU each copy from the host is a tensor made, a pinned staging
    and a launch."""
    ids = [t for tokens in token_lists for t in tokens]
    count, fed = len(ids), len(feed.rows) if feed is not None else 0
    sent = to_device(ids + (feed.rows + feed.picks if fed else []) + values, torch.long, device)
    if fed:
        feed.write(sent[:count], sent[count:count + 2 * fed].view(2, fed))
    return sent[:count], sent[count + 2 * fed:]


class DeviceFeed:
    """Tokens a step takes from the step launched before it: flat input row ``rows[i]`` gets
    ``source[picks[i]]``, the id that step sampled for the request, without the host seeing it."""

    def __init__(self, source: torch.Tensor, rows: list[int], picks: list[int]):
        self.source = source
        self.rows = rows
        self.picks = picks

    def gather_into(self, buffer: torch.Tensor) -> list[int]:
        """The source's ids into ``buffer`` (int64, on the device: a CUDA graph's fixed input) in one copy,
        and each of ``rows``' index in it; a source longer than ``buffer`` is gathered down to the picks."""
        if self.source.shape[0] <= buffer.shape[0]:
            buffer[:self.source.shape[0]].copy_(self.source)
            return self.picks
        index = to_device(self.picks, torch.long, buffer.device)
        buffer[:len(self.picks)].copy_(self.source.index_select(0, index))
        return list(range(len(self.picks)))

    def write(self, input_ids: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Into ``input_ids`` (the step's flat token ids, on the device), queued behind the source's step;
        ``index``: ``[rows, picks]`` on the device already (else copied there here)."""
        if index is None:
            index = to_device((self.rows, self.picks), torch.long, input_ids.device)
        input_ids.index_copy_(0, index[0], self.source.index_select(0, index[1]))


class LaunchedStep:
    """A step launched on the device; ``result()`` is its StepOutput (None off rank 0)."""

    def __init__(self, finish: Callable[[], StepOutput | None], copy: ResultCopy | None = None,
                 sampled_ids: torch.Tensor | None = None, rids: list[str] | None = None):
        """``finish``: builds the output once ``copy`` is on the host; ``sampled_ids``/``rids``: the ids the
        step sampled, still on the device, and the requests they belong to, row for row (None where the
        step's tokens cannot be fed on: a speculating step keeps a variable number per request)."""
        self._finish = finish
        self._output: StepOutput | None = None
        self._copy = copy
        self._sampled_ids = sampled_ids
        self._row_of = {rid: row for row, rid in enumerate(rids)} if sampled_ids is not None and rids else {}

    @classmethod
    def finished(cls, output: StepOutput | None) -> "LaunchedStep":
        """A step whose output is already known (nothing sampled, an off-zero rank, out of memory)."""
        return cls(lambda: output)

    def ready(self) -> bool:
        """Whether ``result()`` would not wait for the device."""
        return self._copy is None or self._copy.event is None or self._copy.event.query()

    def result(self) -> StepOutput | None:
        if self._finish is not None:
            self._output, self._finish = self._finish(), None
        return self._output

    def can_feed(self, rids: list[str]) -> bool:
        """Whether this step sampled a token, still on the device, for every one of ``rids``."""
        return bool(self._row_of) and all(rid in self._row_of for rid in rids)

    def feed(self, rows: list[int], rids: list[str]) -> DeviceFeed:
        """The next step's flat input ``rows`` take the tokens this step sampled for ``rids`` (``can_feed``)."""
        return DeviceFeed(self._sampled_ids, rows, [self._row_of[rid] for rid in rids])
