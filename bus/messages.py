"""Every message that crosses a process boundary in llmbus, and nothing else.

Wire layout: a two-frame ZeroMQ multipart message, ``[kind, payload]``. Frame 0 is one byte, the
message kind (``Kind``); frame 1 is msgpack: the message's fields as an array, in declaration order,
nested structs likewise as arrays. The receiver picks the class from the kind byte before decoding.

Evolution rules (the wire is a protocol, like TGI's generate.proto):
- Add fields only at the end of a struct, always with a default; never reorder, rename the kind byte or
  reuse a number. A decoder fills missing trailing fields from their defaults and ignores extra ones, so
  a newer sender can talk to an older receiver within one ``WIRE_VERSION``.
- A change that breaks that (a field's meaning, a removed field) bumps ``WIRE_VERSION``, which the
  handshakes (``WorkerHello``, ``FrontendHello``) check. ``tests/bus/test_wire_golden.py`` pins the bytes.

Decoding checks every field's type (bus/codec.py).

Token ids only: workers never see text. Hot-path messages (``StepCommand``, ``StepResult``,
``TokenBatch``) are columnar (one list per field) so a step is one message, not one per request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from llmbus.bus.codec import Message, ProtocolError, register_nested  # ProtocolError: part of this module's API

WIRE_VERSION = 25  # 2: NewRequestData.cached_ids; SchedulerStats prefix-cache, preemption and batch metrics
# 3: SamplingParams.presence_penalty
# 4: rank health probes (HealthCheck/HealthProbe/HealthAck/HealthReply), FrontendStats, AddRequest.traceparent
# 5: Grammar (AddRequest.grammar, NewRequestData.grammar): a rank that ignored it would sample unconstrained
# 6: RestartService (a scheduler that resumes after its ranks died relies on a supervisor that restarts
#    them); WorkerReady's warmup step time (the default step deadline) and vocab size;
#    SchedulerStats.worker_restarts
# 7: speculation (StepCommand.num_spec, StepResult.num_tokens): a rank that ignored num_spec would take
#    guesses for computed tokens; SchedulerStats.spec_proposed/spec_accepted
# 8: WorkerReady.attention_backend; SchedulerHello's dtype, attention backend and devices (/info)
#    StepResult.failed_error (a step that ran out of memory fails its requests, not the ranks)
# 9: SamplingParams.min_p: a rank that ignored it would sample from tokens the request cut off
# 10: TokenBatch.cached_tokens (prompt tokens the prefix cache held, for Anthropic's usage)
# 11: FrontendStats.route_names/route_counts (generation requests per route, summed over frontends)
# 12: SamplingParams.frequency_per_count: a rank that ignored it would apply TGI's far weaker formula
# 13: WorkerReady.onednn_cache_capacity, StepResult.request_state, SchedulerStats' memory gauges (issue #36)
# 14: steps scheduled ahead (overlap): SAMPLED_LAST in StepCommand.token_ids, StepCommand.ahead; a rank that
#     took SAMPLED_LAST for a token id would compute garbage
# 15: LoRA adapters (AddRequest.adapter, NewRequestData.adapter, WorkerReady/SchedulerHello.lora_adapters): a
#     rank that ignored NewRequestData.adapter would answer with the base model
# 16: FrontendStats.adapter_names/adapter_counts (llmbus_generation_adapter_count)
# 17: WorkerReady.rope_split_tokens (LongRoPE: the prefix cache keeps prompts past it apart)
# 18: StepResult/TokenBatch.prompt_logprobs entries carry the prompt positions' top tokens: [rid, logprobs, tops]
# 19: SchedulerStats' step outcomes, sampling, filter and concat durations and skipped tokens (TGI's dashboard)
# 20: WorkerReady.rope_split_by_length (dynamic NTK: a scheduler that ignored it would share the blocks of long
#     prompts of different lengths, rotated with different bases)
# 21: SamplingParams.logit_bias_ids/logit_bias_values (OpenAI's logit_bias): a rank that ignored them would
#     sample from the unbiased logits
# 22: vLLM's min_tokens (SamplingParams.min_new_tokens/min_tokens_masked_ids) and stop_token_ids
#     (StoppingParams.request_stop_ids): a rank that ignored them would let a request end too early
# 23: images (AddRequest.images, NewRequestData.images): a rank that ignored them would read the image
#     placeholders' own embeddings
# 24: ImageInput.grid (Qwen2-VL's M-RoPE positions); NewRequestData.images holds the cached prefix's images
#     too, as stubs without data: a rank that ignored them would rotate the text after an image wrongly
# 25: WorkerReady.images "whole" (Gemma 3: an image's placeholders attend each other both ways, so a step computes
#     all of them): a scheduler that ignored it would cut an image between steps, which such ranks refuse

# Decoders refuse payloads above this size instead of allocating for them; a step with a few
# thousand prompts of max length stays far below it.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024


DRAFT_GUESS = -1  # StepCommand.token_ids: a guess the draft model fills in
# StepCommand.token_ids: the token rank 0 sampled for this request in the step before, not known to the
# scheduler when it sent this one (a step scheduled ahead); rank 0 puts it in
SAMPLED_LAST = -2


class Kind(enum.IntEnum):
    """Frame 0 of every message. Stable wire ids: never renumber."""

    ADD_REQUEST = 0x01
    ABORT_REQUEST = 0x02
    FRONTEND_HELLO = 0x03
    HEALTH_CHECK = 0x04
    FRONTEND_STATS = 0x05
    STEP = 0x10
    SHUTDOWN = 0x11
    HEALTH_PROBE = 0x12
    STEP_RESULT = 0x20
    WORKER_HELLO = 0x21
    WORKER_READY = 0x22
    WORKER_FATAL = 0x23
    HEALTH_ACK = 0x24
    TOKEN_BATCH = 0x30
    REQUEST_FAILED = 0x31
    SCHEDULER_HELLO = 0x32
    SCHEDULER_STATS = 0x33
    HEALTH_REPLY = 0x34
    ENGINE_DEAD = 0x3F
    SERVICE_READY = 0x40
    SERVICE_FATAL = 0x41
    RESTART_SERVICE = 0x42


class FinishReason(enum.IntEnum):
    """Why a request stopped, in ``TokenBatch.finish_reasons``. The names are TGI's."""

    NONE = 0  # still running
    LENGTH = 1  # max_new_tokens reached (checked before EOS, as TGI does)
    EOS_TOKEN = 2  # an EOS / stop token id was sampled
    STOP_SEQUENCE = 3  # a stop sequence matched (decided by the frontend, which owns text)
    ABORTED = 4  # cancelled: client gone, or the engine dropped it

    @property
    def tgi_name(self) -> str:
        return {1: "length", 2: "eos_token", 3: "stop_sequence"}.get(int(self), "aborted")


# ---------------------------------------------------------------------------------------------
# Parameters embedded in requests
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SamplingParams(Message):
    """How to choose the next token. Validated by the frontend; workers trust it."""

    temperature: float = 1.0  # > 0; 1.0 leaves logits unchanged
    top_k: int = 0  # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0  # 1.0 = off; else nucleus sampling
    typical_p: float = 1.0  # 1.0 = off; else typical sampling
    do_sample: bool = False  # False = greedy argmax (all warpers ignored)
    seed: int = 0  # per-request RNG seed; the frontend draws one when the client gave none
    repetition_penalty: float = 1.0  # 1.0 = off (CTRL-style, over prompt and generated ids)
    frequency_penalty: float = 0.0  # 0.0 = off; TGI: logit -= penalty * count / len, over prompt + generated
    top_n_tokens: int = 0  # how many alternatives to return per generated token
    watermark: bool = False  # Kirchenbauer et al. green-list bias
    presence_penalty: float = 0.0  # 0.0 = off; OpenAI's: logit -= penalty if the token was generated before
    min_p: float = 0.0  # 0.0 = off; else drop tokens less likely than min_p x the most likely one's probability
    # frequency_penalty as OpenAI's API defines it: logit -= penalty * count, over the generated tokens only
    # (the OpenAI routes). False: TGI's count / len over prompt + generated, which a long chat prompt dilutes
    # to nothing (frequency_penalty 2.0 left SmolLM2's greedy answers unchanged)
    frequency_per_count: bool = False
    # OpenAI's logit_bias, as two parallel lists: logit_bias_values[i] is added to the logit of token
    # logit_bias_ids[i] before any other processing (ids distinct, in the vocabulary; values in [-100, 100])
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # vLLM's min_tokens: while fewer than min_new_tokens tokens are generated, min_tokens_masked_ids (the ids that
    # would end the request: EOS unless ignore_eos, and its own stop ids) get logit -inf, so none is sampled
    min_new_tokens: int = 0
    min_tokens_masked_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Grammar(Message):
    """What a constrained request's output must match; rank 0 masks every sampled token with it.

    The frontend has checked that it compiles, so ranks trust it. Kinds (the source's language):
    - ``json_schema``: a JSON Schema as JSON text (``{"type": "object"}`` is "any JSON object"); an
      ``x-guidance`` key may set llguidance's JSON options (separators, whitespace).
    - ``regex``: a regular expression the whole output must match (Rust ``regex`` syntax, no lookaround).
    - ``lark``: a context-free grammar in llguidance's Lark dialect (``%json {...}`` embeds a schema, and
      ``<|special|>`` names a special token); tool calling sends one of these.
    """

    kind: str
    source: str


GRAMMAR_KINDS = ("json_schema", "regex", "lark")


@dataclass(slots=True)
class StoppingParams(Message):
    """When the scheduler finishes a request without the frontend's help."""

    max_new_tokens: int  # >= 1
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids (generation_config + tokenizer)
    ignore_eos: bool = False  # benchmark mode: only max_new_tokens ends the request
    # vLLM's stop_token_ids: more ids that end the request (EOS_TOKEN), ignore_eos or not (before
    # SamplingParams.min_new_tokens tokens rank 0 samples none, unless a complete grammar leaves nothing else)
    request_stop_ids: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# frontend -> scheduler (PUSH -> PULL "requests")
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class FrontendHello(Message):
    """First message of a frontend: where the scheduler should PUSH its events."""

    KIND: ClassVar[Kind] = Kind.FRONTEND_HELLO
    frontend_id: str  # unique per frontend process
    events_endpoint: str  # the frontend's bound PULL endpoint
    wire_version: int = WIRE_VERSION


@dataclass(slots=True)
class ImageInput(Message):
    """One image of a prompt (vision-language models). The frontend fetched it, checked that it decodes and
    counted its placeholder tokens; every rank runs the model's image processor and vision encoder on it
    (as TGI's shards do), whose output rows are the embeddings of those placeholders."""

    offset: int  # index in the prompt of the first of its placeholder tokens
    num_tokens: int  # placeholder tokens it fills: the encoder's output rows for it
    data: bytes  # the image file as the client sent it (PNG, JPEG, WebP, GIF, ...)
    # blake2b (16 bytes) of ``data``: the prefix cache tells two images' positions apart by it, so a prompt
    # shares the K/V of an image only with a prompt that holds the same image at the same place
    digest: bytes
    # [rows, cols] its placeholders stand in, for a model whose positions follow the image's layout (Qwen2-VL's
    # M-RoPE: a placeholder's position is its row and column, and the text after the image resumes at the
    # image's first position plus max(rows, cols)); [] for the others
    grid: list[int] = field(default_factory=list)

    def problem(self, prompt_len: int) -> str | None:
        """What makes this image of an AddRequest unsafe for the ranks, or None (only the scheduler sends
        ``stub``s, of images the ranks' cache holds)."""
        if self.num_tokens < 1 or self.offset < 0 or self.offset + self.num_tokens > prompt_len:
            return f"an image's {self.num_tokens} tokens at {self.offset} are not inside the {prompt_len}-token prompt"
        if not self.data:
            return "an image without data"
        if len(self.digest) != IMAGE_DIGEST_BYTES:
            return f"an image's digest must be {IMAGE_DIGEST_BYTES} bytes"
        if self.grid and (len(self.grid) != 2 or min(self.grid) < 1 or self.grid[0] * self.grid[1] != self.num_tokens):
            return f"an image's grid must be [rows, cols] of its {self.num_tokens} tokens, not {self.grid}"
        return None

    def stub(self) -> "ImageInput":
        """This image without its file: where it stands, for a rank whose KV cache already holds it (its
        placeholders are never computed, but the positions after them follow from it)."""
        return ImageInput(self.offset, self.num_tokens, b"", self.digest, list(self.grid))


IMAGE_DIGEST_BYTES = 16
# A request's images together, as files (the frontend refuses more); the scheduler also keeps a step's new
# requests' images under it past the first request, so a step command stays far below MAX_PAYLOAD_BYTES.
MAX_IMAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class AddRequest(Message):
    """A validated, tokenized generation request."""

    KIND: ClassVar[Kind] = Kind.ADD_REQUEST
    rid: str  # unique across frontends: "<frontend_id>-<n>", and refused otherwise (problem)
    frontend_id: str  # where the events go
    input_ids: list[int]  # the prompt, already truncated; never empty
    sampling: SamplingParams
    stopping: StoppingParams
    prompt_logprobs: bool = False  # decoder_input_details: return logprobs of the prompt tokens
    arrival_time: float = 0.0  # time.time() when the HTTP request arrived
    traceparent: str = ""  # W3C trace context of the request's span (tracing on), so the scheduler's span joins it
    grammar: Grammar | None = None  # constrained decoding; None: any token may follow
    adapter: str = ""  # the LoRA adapter that computes this request (--lora-adapters' name); "": the base model
    # its images, in prompt order, their placeholder runs apart (a vision-language model; [] for text)
    images: list[ImageInput] = field(default_factory=list)

    def problem(self, vocab_size: int, lora_adapters: tuple[str, ...] | list[str] = (),
                images: str | None = None) -> str | None:
        """What makes this request unsafe to take, or None: a rid outside its frontend's ids, or anything the
        ranks (which trust what they are given) cannot run. The frontend never sends such a request; any
        other local process might. ``vocab_size`` 0: unknown; ``lora_adapters``: the adapters the ranks hold;
        ``images``: the images the model reads (``WorkerReady.images``; None: unknown)."""
        if not self.rid.startswith(f"{self.frontend_id}-"):
            # rids are unique across frontends only through their prefix: one outside it could take the id
            # another frontend's next request will have, which would then fail as a duplicate
            return f"request id {self.rid!r} is not one of frontend {self.frontend_id!r}'s ({self.frontend_id}-N)"
        if not self.input_ids:
            return "empty prompt"
        if min(self.input_ids) < 0 or (vocab_size and max(self.input_ids) >= vocab_size):
            return f"token ids must be in [0, {vocab_size}): the model's vocabulary"
        sp, st = self.sampling, self.stopping
        if not all(math.isfinite(v) for v in (sp.temperature, sp.top_p, sp.typical_p, sp.repetition_penalty,
                                              sp.frequency_penalty, sp.presence_penalty)):
            return "sampling parameters must be finite numbers"
        if sp.temperature <= 0 or sp.repetition_penalty <= 0:
            return "temperature and repetition_penalty must be > 0"
        if not (0 < sp.top_p <= 1 and 0 < sp.typical_p <= 1):
            return "top_p and typical_p must be in (0, 1]"
        if sp.top_k < 0 or not 0 <= sp.top_n_tokens <= 1024 or sp.seed < 0:
            return "top_k, top_n_tokens and seed must be >= 0 (top_n_tokens at most 1024)"
        bias_ids, bias_values = sp.logit_bias_ids, sp.logit_bias_values
        if (len(bias_ids) != len(bias_values) or len(set(bias_ids)) != len(bias_ids)
                or any(t < 0 or (vocab_size and t >= vocab_size) for t in bias_ids)
                or not all(-100.0 <= v <= 100.0 for v in bias_values)):  # NaN fails this too
            return f"logit_bias must pair distinct token ids in [0, {vocab_size}) with values in [-100, 100]"
        if st.max_new_tokens < 1 or any(t < 0 for t in st.stop_token_ids + st.request_stop_ids):
            return "max_new_tokens must be >= 1 and stop token ids >= 0"
        if not 0 <= sp.min_new_tokens <= st.max_new_tokens or any(
                t < 0 or (vocab_size and t >= vocab_size) for t in sp.min_tokens_masked_ids):
            return f"min_new_tokens must be in [0, max_new_tokens] and its masked ids in [0, {vocab_size})"
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            return f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}"
        if self.adapter and self.adapter not in lora_adapters:
            return f"adapter {self.adapter!r} is not loaded (loaded: {', '.join(lora_adapters) or 'none'})"
        if self.images and images == "":
            return "the model reads no images"
        if images == "grid" and any(not image.grid for image in self.images):
            return "the model places an image by its grid: every image needs one"
        if sum(len(image.data) for image in self.images) > MAX_IMAGE_BYTES:
            return f"a request's images must be at most {MAX_IMAGE_BYTES} bytes together"
        end = 0
        for image in self.images:
            problem = image.problem(len(self.input_ids))
            if problem is None and image.offset < end:
                problem = "images must be in prompt order, their tokens apart"
            if problem is not None:
                return problem
            end = image.offset + image.num_tokens
        return None


register_nested("AddRequest", "sampling", SamplingParams)
register_nested("AddRequest", "grammar", Grammar)
register_nested("AddRequest", "stopping", StoppingParams)
register_nested("AddRequest", "images", ImageInput, many=True)


@dataclass(slots=True)
class AbortRequest(Message):
    """Drop these requests wherever they are (client gone, stop sequence matched)."""

    KIND: ClassVar[Kind] = Kind.ABORT_REQUEST
    rids: list[str]


@dataclass(slots=True)
class HealthCheck(Message):
    """/health asks whether every rank answers: the scheduler probes them and sends a HealthReply."""

    KIND: ClassVar[Kind] = Kind.HEALTH_CHECK
    frontend_id: str  # where the HealthReply goes
    check_id: int  # echoed by HealthReply; unique per frontend
    timeout_s: float  # ranks that have not answered by then make the reply a failure


@dataclass(slots=True)
class Histogram(Message):
    """A Prometheus histogram as counts per bucket since start (how both the scheduler and frontends keep
    theirs, so they add up across processes)."""

    buckets: list[float]  # upper bounds, ascending; an implicit last bucket is +Inf
    counts: list[int]  # observations per bucket (not cumulative), len(buckets) + 1
    sum: float = 0.0  # sum of every observation


@dataclass(slots=True)
class FrontendStats(Message):
    """One frontend's request metrics (``tgi_request_*``) since it started. Frontends send theirs to the
    scheduler when they changed, a few times a second at most; the scheduler relays each to every other
    frontend, so whichever frontend a scrape reaches reports the sum over all of them."""

    KIND: ClassVar[Kind] = Kind.FRONTEND_STATS
    frontend_id: str
    request_count: int  # generation requests received
    request_success: int  # answered in full
    failure_labels: list[str]  # TGI's err label of each failure counter ...
    failure_counts: list[int]  # ... and its count
    histogram_names: list[str]  # metric name after tgi_request_ (duration, input_length, ...) ...
    histograms: list[Histogram]  # ... and its histogram
    route_names: list[str] = field(default_factory=list)  # the HTTP route of each request counter ...
    route_counts: list[int] = field(default_factory=list)  # ... and its count (llmbus_request_route_count)
    adapter_names: list[str] = field(default_factory=list)  # the LoRA adapter of finished generations ("": base) ...
    adapter_counts: list[int] = field(default_factory=list)  # ... and their count (llmbus_generation_adapter_count)


# ---------------------------------------------------------------------------------------------
# scheduler -> workers (XPUB -> SUB "steps"): one StepCommand per forward pass
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class NewRequestData(Message):
    """A request the workers have not seen: everything they must keep for it, keyed by rid."""

    rid: str
    sampling: SamplingParams
    block_table: list[int]  # KV blocks owned by this request, in order
    prompt_len: int  # tokens of the prompt (the rest of its tokens are generated ones)
    prompt_logprobs: bool = False
    # Tokens whose K/V this request finds already in its first blocks (a prefix-cache hit; the step's
    # num_computed for it starts at len(cached_ids)). Ranks need them only for the token history that
    # repetition and frequency penalties read; empty when nothing was cached.
    cached_ids: list[int] = field(default_factory=list)
    # AddRequest.grammar. Rank 0 rebuilds the grammar's state from the tokens after ``prompt_len`` that
    # it is given (cached_ids and prompt chunks), so a preempted request resumes where it was.
    grammar: Grammar | None = None
    adapter: str = ""  # AddRequest.adapter: every rank adds this LoRA adapter's deltas to the request's rows
    # AddRequest.images; those wholly in the cached prefix (``cached_ids``) as ``ImageInput.stub``s, without
    # their files: the ranks never encode them, but a model whose positions follow its images reads their places
    images: list[ImageInput] = field(default_factory=list)


register_nested("NewRequestData", "sampling", SamplingParams)
register_nested("NewRequestData", "images", ImageInput, many=True)
register_nested("NewRequestData", "grammar", Grammar)


@dataclass(slots=True)
class StepCommand(Message):
    """One forward pass over a batch, as a diff against what the workers already hold.

    Scheduled requests are listed in batch order by ``rids``; ``token_ids`` concatenates the tokens each
    computes this step (a whole prompt or a chunk of it for a new request, the last sampled token for a
    running one). Positions run from ``num_computed[i]`` for ``num_new[i]`` tokens. Every rank computes
    the same thing, so ranks other than 0 learn the sampled tokens from the next step's ``token_ids``.

    A step sent ``ahead`` (before the result of the step before it was read) may feed ``SAMPLED_LAST`` as a
    running request's last token: the one rank 0 sampled for it in that step (the other ranks take it from
    rank 0's broadcast of its sampled ids). If that step failed, a one-rank group skips this one and a larger
    group computes it on placeholders; either way its result is dropped and the scheduler schedules it again.
    """

    KIND: ClassVar[Kind] = Kind.STEP
    step_id: int  # 1, 2, 3, ... per scheduler run; a rank that sees a gap dies (a new rank starts anywhere)
    new_requests: list[NewRequestData]  # requests scheduled for the first time (or after preemption)
    rids: list[str]  # scheduled requests, in batch order
    num_computed: list[int]  # per scheduled request: tokens already in its KV cache
    num_new: list[int]  # per scheduled request: tokens in token_ids for it
    token_ids: list[int]  # concatenation of every scheduled request's new tokens
    sample: list[bool]  # per scheduled request: sample a token after this step (False mid-prompt)
    added_blocks: list[list] = field(default_factory=list)  # [[rid, [block ids]]]: blocks appended
    finished_rids: list[str] = field(default_factory=list)  # drop state: finished, aborted, preempted
    # Per scheduled request: of its tokens this step, the trailing guesses to verify (speculation;
    # scheduler/speculation.py); [] when none speculates. A guess of DRAFT_GUESS is left for rank 0's draft
    # model to make (--draft-model-id), which it shares with the other ranks.
    num_spec: list[int] = field(default_factory=list)
    ahead: bool = False


register_nested("StepCommand", "new_requests", NewRequestData, many=True)
register_nested("FrontendStats", "histograms", Histogram, many=True)


@dataclass(slots=True)
class Shutdown(Message):
    """Stop after this message (sent on the step channel so every rank stops at the same point)."""

    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str = ""


@dataclass(slots=True)
class HealthProbe(Message):
    """Every rank answers with a HealthAck once it reaches this point of the step stream (after the
    step it is computing, if any): proof that each rank is alive and not stuck."""

    KIND: ClassVar[Kind] = Kind.HEALTH_PROBE
    probe_id: int  # 1, 2, 3, ... per scheduler run; not a step: step ids are unaffected


# ---------------------------------------------------------------------------------------------
# worker rank 0 -> scheduler (PUSH -> PULL "results"), and every rank -> scheduler ("control")
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class StepResult(Message):
    """Rank 0's answer to one StepCommand, for the whole batch."""

    KIND: ClassVar[Kind] = Kind.STEP_RESULT
    step_id: int  # echoes StepCommand.step_id
    rids: list[str]  # the requests that sampled, in batch order
    token_ids: list[int]  # per sampled request: the new token
    logprobs: list[float]  # per sampled request: log-softmax of the new token (after warpers)
    forward_time: float = 0.0  # seconds spent in the forward pass
    sample_time: float = 0.0  # seconds spent sampling
    top_tokens: list[list] = field(default_factory=list)  # per sampled request: [[ids], [logprobs]]
    # [[rid, [logprob per prompt token], tops]]: tops, per prompt token, its position's top_n_tokens most likely
    # tokens as [[ids], [logprobs]] ([] when the request asked for none)
    prompt_logprobs: list[list] = field(default_factory=list)
    # [[rid, error_type, why]]: requests rank 0 cannot go on with (their grammar does not compile for this
    # vocabulary: "validation"; it failed while generating: "generation"). Their token this step is an
    # end-of-sequence, which the scheduler drops as it fails them (RequestFailed with that error_type).
    errors: list[list] = field(default_factory=list)
    # Per sampled request: how many of token_ids / logprobs are its (a speculating one keeps its verified
    # guesses and one sampled token); [] when each has one.
    num_tokens: list[int] = field(default_factory=list)
    # Not empty: the step failed without harm to the ranks (it ran out of memory) and nothing of it counts;
    # why, for the requests the scheduler fails for it (scheduler/policy.py, fail_step).
    failed_error: str = ""
    # Per-request objects rank 0 holds after this step (Worker.request_state summed: request states,
    # histories, grammar matchers, prompt-logprob rows, draft guesses), those of the requests that finished
    # in this step included (the next step drops them): it stays bounded by the batch (issue #36)
    request_state: int = 0


@dataclass(slots=True)
class WorkerHello(Message):
    """A rank is subscribed to the step channel and speaks this wire version."""

    KIND: ClassVar[Kind] = Kind.WORKER_HELLO
    rank: int
    world_size: int
    pid: int
    wire_version: int = WIRE_VERSION


@dataclass(slots=True)
class WorkerReady(Message):
    """A rank loaded its weights, warmed up and sized its KV block pool."""

    KIND: ClassVar[Kind] = Kind.WORKER_READY
    rank: int
    num_blocks: int  # KV blocks this rank can hold; the scheduler takes the minimum over ranks
    block_size: int  # tokens per KV block
    dtype: str = ""
    device: str = ""
    max_position_embeddings: int = 0
    # The slowest warmup step and the tokens it computed: the scheduler's default step deadline scales
    # from it (0: not measured).
    warmup_step_s: float = 0.0
    warmup_step_tokens: int = 0
    vocab_size: int = 0  # rows of the LM head: token ids the scheduler accepts are below it (0: unknown)
    attention_backend: str = ""  # the attention backend's name (workers.attention.BACKEND_CLASSES; "": none)
    # Entries each of oneDNN's two shape-keyed kernel caches may hold (--onednn-cache-capacity; 0: not a CPU rank)
    onednn_cache_capacity: int = 0
    lora_adapters: list[str] = field(default_factory=list)  # names of the LoRA adapters loaded, in order
    # LongRoPE's or dynamic NTK's original length: a prompt longer than this is rotated with other factors (or
    # another base) from its first token on, so the scheduler's prefix cache keeps its blocks apart from shorter
    # prompts' (0: one rotation for all)
    rope_split_tokens: int = 0
    # dynamic NTK: such a prompt's base follows its own length, so prompts of each length are kept apart
    rope_split_by_length: bool = False
    # The images the model reads: "" none (a text model), "sequence" (each image's embeddings in
    # place of its placeholders, in order: LLaVA), "grid" (and its placeholders' grid places the positions
    # after it: Qwen2-VL's M-RoPE), "whole" (as "sequence", and an image's placeholders attend each other both
    # ways, so a step computes all of those it computes any of: Gemma 3); the scheduler refuses requests whose
    # images the ranks could not read
    images: str = ""


@dataclass(slots=True)
class WorkerFatal(Message):
    """A rank hit an error it cannot recover from; it exits right after sending this."""

    KIND: ClassVar[Kind] = Kind.WORKER_FATAL
    rank: int
    error: str


@dataclass(slots=True)
class HealthAck(Message):
    """A rank's answer to a HealthProbe (on the control channel)."""

    KIND: ClassVar[Kind] = Kind.HEALTH_ACK
    rank: int
    probe_id: int


# ---------------------------------------------------------------------------------------------
# scheduler -> frontend (PUSH -> the frontend's PULL "events-<frontend id>"); FrontendStats is relayed
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SchedulerHello(Message):
    """The scheduler's answer to FrontendHello: limits fixed at warmup."""

    KIND: ClassVar[Kind] = Kind.SCHEDULER_HELLO
    max_batch_total_tokens: int
    block_size: int
    wire_version: int = WIRE_VERSION
    # what the ranks compute with, for /info: the model's dtype, the attention backend, each rank's device
    dtype: str = ""
    attention_backend: str = ""
    devices: list[str] = field(default_factory=list)
    lora_adapters: list[str] = field(default_factory=list)  # what AddRequest.adapter may name (/v1/models)


@dataclass(slots=True)
class TokenBatch(Message):
    """New tokens of one step for one frontend, columnar."""

    KIND: ClassVar[Kind] = Kind.TOKEN_BATCH
    rids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    finish_reasons: list[int]  # FinishReason per token; NONE while running
    top_tokens: list[list] = field(default_factory=list)  # per token [[ids], [logprobs]] when asked
    prompt_logprobs: list[list] = field(default_factory=list)  # [[rid, [logprobs], tops]] on first tokens
    queue_times: list[float] = field(default_factory=list)  # per token: seconds queued (first token only, else 0)
    # [[rid, guessed tokens, kept]] for each request that finished in this batch after speculating
    speculation: list[list] = field(default_factory=list)
    # [[rid, prompt tokens found in the prefix cache at first admission]] on first tokens, for the APIs that
    # report cached prompt tokens (Anthropic's cache_read_input_tokens)
    cached_tokens: list[list] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats(Message):
    """The scheduler's gauges, to every frontend for /metrics: sent after a step at most a few times a
    second, and whenever the scheduler goes idle (so an idle server reports its final state)."""

    KIND: ClassVar[Kind] = Kind.SCHEDULER_STATS
    queue_size: int  # requests waiting for admission
    batch_size: int  # requests in the running batch
    batch_max_tokens: int  # KV tokens the running batch holds blocks for (TGI's batch max_tokens)
    kv_blocks_total: int  # blocks in the pool (the minimum over ranks)
    kv_blocks_free: int  # blocks owned by no request (blocks kept only by the prefix cache count as free)
    block_size: int
    kv_blocks_cached: int = 0  # of the free ones: blocks the prefix cache keeps for reuse (evicted on demand)
    # Counters since the scheduler started (Prometheus counters on the frontend):
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached (their prefill was skipped)
    preemptions: int = 0  # running requests sent back to the queue for lack of KV blocks
    prefill_steps: int = 0  # steps that computed prompt tokens (TGI's method="prefill")
    decode_steps: int = 0  # steps with decode tokens only (method="decode")
    concat_chunking: int = 0  # steps where new requests joined a running batch, chunked prefill on
    concat_backpressure: int = 0  # the same with chunking off, admitted on waiting_served_ratio
    concat_wait_exceeded: int = 0  # the same with chunking off, admitted after max_waiting_tokens steps
    # Histograms since the scheduler started; durations in seconds:
    prefill_forward: Histogram | None = None  # rank 0's forward time of prefill steps
    decode_forward: Histogram | None = None  # rank 0's forward time of decode steps
    prefill_duration: Histogram | None = None  # whole prefill steps: command sent to result back
    decode_duration: Histogram | None = None  # whole decode steps
    next_batch_size: Histogram | None = None  # requests admitted by each step that admitted any
    worker_restarts: int = 0  # times the worker ranks died or hung and were restarted, requests resumed
    spec_proposed: int = 0  # guessed tokens fed to the ranks (n-gram speculation)
    spec_accepted: int = 0  # of those, kept
    spec_method: str = "ngram"  # where the guesses come from: "ngram" or "draft"
    # Memory gauges (issue #36): what bounds and shows each per-process store that grows with traffic
    onednn_cache_capacity: int = 0  # rank 0's WorkerReady.onednn_cache_capacity
    worker_request_state: int = 0  # rank 0's StepResult.request_state after the last step
    prefix_cache_heap_entries: int = 0  # the prefix cache's LRU heap, live and stale entries (kv_blocks.py)
    # What TGI's Grafana dashboard reads beside them (its tgi_batch_* and tgi_request_skipped_tokens):
    prefill_success: int = 0  # prefill steps whose result came back whole
    decode_success: int = 0
    prefill_failure: int = 0  # prefill steps that failed (out of memory) or were lost with their ranks
    decode_failure: int = 0
    prefill_sample: Histogram | None = None  # rank 0's time choosing tokens after the forward (TGI's "decode")
    decode_sample: Histogram | None = None
    prefill_filter: Histogram | None = None  # the scheduler's time applying a step's result (TGI's "filter")
    decode_filter: Histogram | None = None
    concat_duration: Histogram | None = None  # forming a step that joined new requests to a running batch
    skipped_tokens: Histogram | None = None  # per request and step: tokens beyond the first (speculation)


for _name in ("prefill_forward", "decode_forward", "prefill_duration", "decode_duration", "next_batch_size",
              "prefill_sample", "decode_sample", "prefill_filter", "decode_filter", "concat_duration",
              "skipped_tokens"):
    register_nested("SchedulerStats", _name, Histogram)


@dataclass(slots=True)
class HealthReply(Message):
    """The answer to a HealthCheck."""

    KIND: ClassVar[Kind] = Kind.HEALTH_REPLY
    check_id: int  # HealthCheck.check_id
    ok: bool  # every rank answered in time
    message: str = ""  # why not, for the log


@dataclass(slots=True)
class RequestFailed(Message):
    """One request ended with an error; the rest of the batch goes on."""

    KIND: ClassVar[Kind] = Kind.REQUEST_FAILED
    rid: str
    error_type: str  # TGI's: validation, generation, overloaded, ...
    message: str


@dataclass(slots=True)
class EngineDead(Message):
    """The engine cannot serve anymore: every in-flight request fails (424)."""

    KIND: ClassVar[Kind] = Kind.ENGINE_DEAD
    reason: str


# ---------------------------------------------------------------------------------------------
# any service -> supervisor (PUSH -> PULL "supervisor"), only when launched by `llmbus up`
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ServiceReady(Message):
    """A service is ready to do its job (the scheduler: every rank is Ready; the frontend: listening)."""

    KIND: ClassVar[Kind] = Kind.SERVICE_READY
    service: str  # "scheduler", "workers", "frontend"
    pid: int
    detail: str = ""  # free text for the operator, e.g. the URL or the KV capacity


@dataclass(slots=True)
class ServiceFatal(Message):
    """A service is about to exit because of this error."""

    KIND: ClassVar[Kind] = Kind.SERVICE_FATAL
    service: str
    pid: int
    error: str


@dataclass(slots=True)
class RestartService(Message):
    """The scheduler lost its worker ranks (one died, or a step outlived its deadline) and will resume
    every request once new ranks are ready: stop what is left of the group (SIGKILL: a hung rank does not
    answer SIGTERM) and start it again. Without a supervisor to send it to, the scheduler gives up instead."""

    KIND: ClassVar[Kind] = Kind.RESTART_SERVICE
    service: str  # the plan's name: "workers"
    pid: int  # of the sender
    reason: str  # what happened, for the operator


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (FrontendHello, AddRequest, AbortRequest, HealthCheck, FrontendStats, StepCommand, Shutdown,
                HealthProbe, StepResult, WorkerHello, WorkerReady, WorkerFatal, HealthAck, SchedulerHello,
                SchedulerStats, HealthReply, TokenBatch, RequestFailed, EngineDead, ServiceReady, ServiceFatal,
                RestartService)
}
assert len(MESSAGE_TYPES) == len(Kind), "every Kind has exactly one message class"


def encode(msg: Message) -> list[bytes]:
    """The two frames of ``msg``."""
    return [bytes((msg.KIND,)), msgpack.packb(msg.to_wire(), use_bin_type=True)]


def decode(frames: list[bytes]) -> Message:
    """Parse two frames into a message; raises ProtocolError for anything malformed."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    kind_frame, payload = frames
    if len(kind_frame) != 1:
        raise ProtocolError(f"kind frame must be 1 byte, got {len(kind_frame)}")
    try:
        cls = MESSAGE_TYPES[Kind(kind_frame[0])]
    except ValueError:
        raise ProtocolError(f"unknown message kind 0x{kind_frame[0]:02x}") from None
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"{cls.__name__} payload of {len(payload)} bytes exceeds the limit")
    try:
        values = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types for corrupt input
        raise ProtocolError(f"{cls.__name__}: undecodable payload ({e})") from None
    return cls.from_wire(values)
