"""A request as the scheduler sees it, and one step's work: the data the policy (``policy.py``) reads and
writes, and the process (``process.py``) turns into commands and token events."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmbus.bus.messages import SAMPLED_LAST, FinishReason, Grammar, ImageInput, SamplingParams, StoppingParams
from llmbus.scheduler.speculation import GuessRate, NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """The scheduler's view of one request."""

    rid: str
    frontend_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    prompt_logprobs: bool = False
    arrival_time: float = 0.0
    traceparent: str = ""  # the frontend's span of this request, when tracing (bus/tracing.py)
    grammar: Grammar | None = None  # passed to the ranks with the request; the policy never reads it
    adapter: str = ""  # its LoRA adapter ("": the base model); prefixes are shared within one adapter only
    images: list[ImageInput] = field(default_factory=list)  # passed to the ranks; the policy reads prompt_keys
    # prompt_ids as the prefix cache keys them: an image's placeholders by its digest (image_keys); None: the ids
    prompt_keys: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    admitted_time: float | None = None  # first admission
    cached_tokens: int = 0  # prompt tokens the prefix cache held at first admission
    prompt_logprob_values: list[float] = field(default_factory=list)  # prompt tokens 1..n-1, as computed
    prompt_logprob_tops: list[list] = field(default_factory=list)  # their positions' [[ids], [logprobs]], if asked
    num_preemptions: int = 0
    ngrams: NgramIndex | None = None  # prompt + output, indexed once the request first speculates
    guess_rate: GuessRate | None = None  # its recent acceptance, once it first speculates
    spec_proposed: int = 0  # guessed tokens fed ...
    spec_accepted: int = 0  # ... and kept
    # Scheduling ahead: tokens fed by steps scheduled but not yet applied, and tokens those steps sample
    # (not known yet); ``generation`` changes whenever the request's computed state is thrown away
    # (preempted, ranks restarted), so results of steps scheduled before are dropped.
    ahead: int = 0
    pending: int = 0
    generation: int = 0

    def __post_init__(self) -> None:
        if self.images and self.prompt_keys is None:
            self.prompt_keys = image_keys(self.prompt_ids, self.images)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scheduled_computed(self) -> int:
        """Tokens computed once every step scheduled so far ran: where the next step starts."""
        return self.num_computed + self.ahead

    @property
    def scheduled_tokens(self) -> int:
        """Prompt, output and the tokens sampled by steps not yet applied."""
        return self.num_tokens + self.pending

    def feed(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` to feed a step; a pending token's place holds SAMPLED_LAST."""
        known = self.num_tokens
        return self.tokens(start, min(end, known)) + [SAMPLED_LAST] * (end - max(start, known))

    @property
    def max_kv_tokens(self) -> int:
        # The last sampled token is never fed back, so its K/V is never written.
        return len(self.prompt_ids) + self.stopping.max_new_tokens - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: they go out with the first token, so not after it."""
        return self.prompt_logprobs and not self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def cache_keys(self, start: int, end: int) -> list[int]:
        """``tokens(start, end)`` as the prefix cache keys them (``prompt_keys``)."""
        if self.prompt_keys is None:
            return self.tokens(start, end)
        p = len(self.prompt_ids)
        return self.prompt_keys[start:min(end, p)] + self.output_ids[max(start - p, 0):max(end - p, 0)]

    @property
    def image_bytes(self) -> int:
        return sum(len(image.data) for image in self.images)

    def images_from(self, position: int) -> list[ImageInput]:
        """What ranks computing from ``position`` must see of the images: whole, those whose placeholders end
        after it; as ``stub``s (where they stand, without their files), those before it."""
        return [image if image.offset + image.num_tokens > position else image.stub() for image in self.images]


def images_chunk_end(images: list[ImageInput], start: int, end: int) -> int:
    """Where a step that computes a prompt's tokens from ``start`` ends, given it would end at ``end``, so that it
    computes all of any image's placeholders it computes one of: at ``end``, unless that is inside an image; then
    at the image's first placeholder where the step starts before it, else at the image's end, past ``end`` (a
    step over the prefill budget by at most the rest of one image, as a whole prompt may be without chunking)."""
    for image in images:
        first, stop = image.offset, image.offset + image.num_tokens
        if first < end < stop:
            return first if first > start else stop
    return end


def image_keys(prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
    """``prompt_ids`` with the j-th placeholder of each image replaced by a key of (its digest, j): negative,
    so never a token id, and equal only for the same image at the same place in the same prefix, which the
    radix tree's path already pins (as SGLang pads image positions with the image's hash)."""
    keys = list(prompt_ids)
    for image in images:
        base = int.from_bytes(image.digest, "big") << 32
        keys[image.offset:image.offset + image.num_tokens] = [-(base | j) - 3 for j in range(image.num_tokens)]
    return keys


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    token_ids: list[int]  # tokens computed this step
    num_computed: int  # before this step
    sample: bool
    is_decode: bool = False  # computes only the token sampled last (else prompt or recomputed tokens)
    num_spec: int = 0  # of token_ids, the trailing guessed ones the ranks verify (a speculating decode)
    generation: int = 0  # the request's generation when scheduled: a result for an older one is dropped
    # a plain decode of a request braked from guessing: the token n-gram lookup would have guessed, checked
    # against the sampled one (free: nothing of it goes to the ranks)
    watched_guess: int | None = None


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work, from which the process builds a StepCommand."""

    new_requests: list[Request]  # first time on the workers (or again after preemption)
    seqs: list[ScheduledSeq]  # batch order: running requests by admission, then newly admitted ones
    finished_rids: list[str]  # workers drop these before the step
    added_blocks: list[tuple[str, list[int]]] = field(default_factory=list)  # running requests' new blocks
    concat_reason: str | None = None  # why new requests joined a running batch (TGI's tgi_batch_concat)

    @property
    def has_prefill(self) -> bool:
        return not all(seq.is_decode for seq in self.seqs)

    @property
    def speculates(self) -> bool:
        """Whether a row verifies guesses or watches one: the next step's guesses need its tokens."""
        return any(seq.num_spec or seq.watched_guess is not None for seq in self.seqs)


@dataclass(slots=True)
class TokenEvent:
    request: Request
    token_id: int
    logprob: float
    finish_reason: FinishReason
    prompt_logprobs: list[float] | None = None  # on a request's first token, when it asked for them
    prompt_top_tokens: list[list] | None = None  # with them: each position's top tokens (empty: none asked)
