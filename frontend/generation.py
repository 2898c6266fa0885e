"""One generation request from validation to its last token.

``Generator.prepare`` takes an admission permit (429 when ``max_concurrent_requests`` are in flight),
validates, loads a vision model's images (frontend/images.py), tokenizes (long prompts on a worker thread)
and checks lengths; ``Generation.start`` sends the ``AddRequest``; ``Generation.next_tokens`` turns engine
events into TGI tokens: incremental text, special flag, top tokens, and the finish reason, matching stop
sequences on the text. ``close`` releases the permit and aborts the request in the scheduler unless it
finished there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from llmbus.bus import messages as m
from llmbus.bus import tracing
from llmbus.bus.messages import FinishReason
from llmbus.frontend.config import Limits
from llmbus.frontend.engine_client import TIMED_OUT, EngineClient, EngineFailure, EngineTokens, Mailbox
from llmbus.frontend.errors import ApiError, ErrorKind, generation_error, validation_error
from llmbus.frontend.images import FetchRules, LoadedImage, PromptImages
from llmbus.frontend.tokenizer import LONG_TEXT_CHARS, ModelTokenizer
from llmbus.frontend.validation import GenerateParameters, ValidParameters, validate_lengths, validate_parameters
from llmbus.frontend.vision_models import VisionSpec


@dataclass(slots=True)
class TokenOut:
    id: int
    text: str
    logprob: float | None
    special: bool
    top_tokens: list[dict]  # [{"id","text","logprob","special"}], empty unless top_n_tokens
    finish_reason: str | None  # "length" | "eos_token" | "stop_sequence" on the last token


@dataclass
class Prepared:
    """A validated, tokenized request holding an admission permit."""

    inputs: str
    input_ids: list[int]
    params: ValidParameters
    max_new_tokens: int
    start_time: float  # time.monotonic() when the HTTP request arrived
    arrival_time: float  # time.time() likewise, for the scheduler
    prompt_logprobs: bool = False  # decoder_input_details
    images: list[m.ImageInput] = field(default_factory=list)  # where input_ids hold images (a vision model)


class Generator:
    """Admission, validation and tokenization in front of the engine."""

    def __init__(self, engine: EngineClient, tokenizer: ModelTokenizer, limits: Limits,
                 max_concurrent_requests: int, validation_workers: int = 2, enable_prefill_logprobs: bool = False,
                 on_finished: Callable[["Generation"], None] | None = None, vision: VisionSpec | None = None,
                 image_fetch: FetchRules | None = None):
        """``vision``: the served model's images (None: a text model, whose prompts' ``![](...)`` is text);
        ``image_fetch``: what fetching its http(s) images may do (None: TGI's defaults)."""
        self.engine = engine
        self.on_finished = on_finished  # called with each generation that finishes (metrics)
        self.enable_prefill_logprobs = enable_prefill_logprobs
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_concurrent_requests = max_concurrent_requests
        self.permits_in_use = 0
        self.draining = False  # after SIGTERM: new requests get 503
        self.liveness_needed = False  # a generation failed in the engine: /health must generate to pass
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=validation_workers, thread_name_prefix="tokenize")
        # images decode on the tokenizing threads: both are a prompt's preparation, bounded alike
        self.images = (PromptImages(vision, image_fetch or FetchRules(), self._executor) if vision is not None
                       else None)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def acquire(self) -> None:
        if self.draining:
            raise ApiError(ErrorKind.SHUTTING_DOWN)
        if self.permits_in_use >= self.max_concurrent_requests:
            raise ApiError(ErrorKind.OVERLOADED)
        self.permits_in_use += 1
        self._idle.clear()

    def release(self) -> None:
        self.permits_in_use -= 1
        if self.permits_in_use == 0:
            self._idle.set()

    async def liveness(self, timeout_s: float) -> bool:
        """TGI's model health check: a real one-token greedy generation. True if it succeeded (or every
        permit is taken: the engine is busy serving, and failures there will show)."""
        try:
            gen = await self.prepare("liveness", GenerateParameters(max_new_tokens=1), time.monotonic(),
                                     time.time())
        except ApiError as e:
            return e.kind is ErrorKind.OVERLOADED
        try:
            await gen.start()
            await asyncio.wait_for(gen.run_to_end(), timeout_s)
        except (ApiError, asyncio.TimeoutError):
            return False
        finally:
            gen.close()
        self.liveness_needed = False
        return True

    async def wait_idle(self) -> None:
        """Until no request holds a permit (every generation in flight has been closed)."""
        await self._idle.wait()

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def off_loop(self, encode, text: str, add_special_tokens: bool = True):
        """``encode(text, add_special_tokens)`` (a ``ModelTokenizer`` method), on a tokenizing thread when
        ``text`` is long; the tokenizer's own error as TGI reports it."""
        try:
            if len(text) <= LONG_TEXT_CHARS:
                return encode(text, add_special_tokens)
            return await asyncio.get_running_loop().run_in_executor(self._executor, encode, text, add_special_tokens)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own error, as TGI reports it
            raise validation_error(f"tokenizer error {e}") from None

    async def prepare_all(self, jobs: list[tuple[str, GenerateParameters, bool]], start_time: float,
                          arrival_time: float, *, name: str | None = None) -> list["Generation"]:
        """``prepare`` for each ``(inputs, parameters, add_special_tokens)``: every one validated before
        any starts; on an error the permits already taken are given back. ``name``: what an error calls the
        job it is about (``name[i]``: a request of several the client told apart)."""
        gens: list[Generation] = []
        loaded: dict[str, LoadedImage] = {}  # the jobs' images (n choices of one prompt), fetched once
        try:
            for i, (inputs, parameters, add_special_tokens) in enumerate(jobs):
                try:
                    gens.append(await self.prepare(inputs, parameters, start_time, arrival_time,
                                                   add_special_tokens=add_special_tokens, loaded_images=loaded))
                except ApiError as e:
                    raise (e if name is None else e.at(f"{name}[{i}]")) from None
        except BaseException:
            for gen in gens:
                gen.close()
            raise
        return gens

    def _with_token_lists(self, params: ValidParameters, max_new_tokens: int) -> ValidParameters:
        """``params`` whose token lists (``logit_bias``, ``stop_token_ids``) are in the vocabulary, and whose vLLM
        ``min_tokens`` masks the ids that would end the request before then: EOS (unless ``ignore_eos``) and its
        ``stop_token_ids``."""
        self.tokenizer.known_ids(params.sampling.logit_bias_ids, param="logit_bias")
        self.tokenizer.known_ids(params.stop_token_ids, param="stop_token_ids")
        minimum = params.sampling.min_new_tokens
        if not minimum:
            return params
        if minimum > max_new_tokens:
            raise validation_error(f"`min_tokens` must be <= the tokens to generate ({max_new_tokens}). "
                                   f"Given: {minimum}", param="min_tokens")
        eos = [] if params.ignore_eos else list(self.tokenizer.eos_token_ids)
        masked = list(dict.fromkeys(eos + params.stop_token_ids))
        return dataclasses.replace(params, sampling=dataclasses.replace(params.sampling,
                                                                        min_tokens_masked_ids=masked))

    async def expand_images(self, text: str, loaded_images: dict[str, LoadedImage] | None = None
                            ) -> tuple[str, list[LoadedImage]]:
        """For a vision model, ``text`` with each image's ``![](<url>)`` replaced by its placeholder tokens'
        text, and the images, loaded (``loaded_images``: those of the request loaded already, added to);
        ``text`` as it is for a text model."""
        if self.images is None:
            return text, []
        return await self.images.expand(text, self.limits.max_input_tokens, loaded_images)

    async def prompt_ids(self, text: str, add_special_tokens: bool = True,
                         loaded_images: dict[str, LoadedImage] | None = None) -> tuple[list[int], list[LoadedImage]]:
        """The token ids of a prompt's text, its images' placeholders included, and its images."""
        text, images = await self.expand_images(text, loaded_images)
        return await self.tokenize(text, add_special_tokens), images

    async def prepare(self, inputs: str | list[int], parameters: GenerateParameters, start_time: float,
                      arrival_time: float, *, add_special_tokens: bool = True,
                      loaded_images: dict[str, LoadedImage] | None = None) -> "Generation":
        """A Generation ready to start; raises ApiError (422, 429, 424). Holds a permit until closed.

        ``inputs``: text, or token ids fed as they are; ``add_special_tokens=False`` for text that already
        carries them (a rendered chat template). ``loaded_images``: images loaded for another job of the
        request, by reference (added to)."""
        self.acquire()
        try:
            params = validate_parameters(inputs, parameters, self.limits, adapters=self.engine.lora_adapters)
            images: list[LoadedImage] = []
            if isinstance(inputs, str):
                ids, images = await self.prompt_ids(inputs, add_special_tokens, loaded_images)
            else:
                ids = self.tokenizer.known_ids(inputs)
                inputs = self.tokenizer.text_of(ids)
            input_length, max_new = validate_lengths(len(ids), params.truncate, params.max_new_tokens,
                                                     self.limits)
            cut = len(ids) - input_length
            # token ids given as they are may not hold image tokens either: no image stands behind them
            placed = self.images.place(ids, images, cut) if self.images is not None else []
            params = self._with_token_lists(params, max_new)
            if self.engine.dead_reason is not None:
                raise generation_error(self.engine.dead_reason)
            prepared = Prepared(inputs=inputs, input_ids=ids[cut:], params=params,
                                max_new_tokens=max_new, start_time=start_time, arrival_time=arrival_time,
                                prompt_logprobs=(parameters.decoder_input_details
                                                 and self.enable_prefill_logprobs), images=placed)
        except BaseException:
            self.release()
            raise
        return Generation(self, prepared)


async def run_all(gens: list["Generation"]) -> None:
    """Start every generation and run it to its end, concurrently. The first error cancels the others
    and is raised. Every generation is closed when this returns (unfinished ones aborted in the engine)."""
    async def run(gen: Generation) -> None:
        await gen.start()
        await gen.run_to_end()

    tasks = [asyncio.ensure_future(run(g)) for g in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_and_close(tasks, gens)


async def cancel_and_close(tasks: list[asyncio.Future], gens: list["Generation"]) -> None:
    """Stop the tasks driving ``gens``, then close every generation."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for gen in gens:
        gen.close()


@dataclass
class Timings:
    queued: float = 0.0  # monotonic: AddRequest sent
    first_token: float = 0.0  # monotonic: first token received
    queue_time: float | None = None  # seconds the scheduler reports the request waited
    end: float = 0.0

    def split(self, start: float) -> tuple[float, float, float, float]:
        """TGI's timing split in seconds: total, validation, queue, inference."""
        queue = self.queue_time if self.queue_time is not None else max(self.first_token - self.queued, 0.0)
        inference = max(self.end - min(self.queued + queue, self.end), 0.0)
        return max(self.end - start, 0.0), max(self.queued - start, 0.0), queue, inference

    def headers_ms(self, start: float, generated_tokens: int) -> dict[str, int]:
        """The split as TGI's response headers (ms)."""
        total, validation, queue, inference = self.split(start)
        return {
            "x-total-time": int(total * 1000),
            "x-validation-time": int(validation * 1000),
            "x-queue-time": int(queue * 1000),
            "x-inference-time": int(inference * 1000),
            "x-time-per-token": int(inference * 1000 / max(generated_tokens, 1)),
        }


@dataclass
class Generation:
    generator: Generator
    prepared: Prepared
    rid: str = ""
    tokens: list[TokenOut] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)  # texts of the non-special tokens
    finish_reason: str | None = None
    # the last allowed token also completed a stop sequence: TGI reports "length" (it checks the budget
    # first), the OpenAI-shaped routes the stop (their text never holds a stop sequence; vLLM's order)
    stop_at_length: bool = False
    prompt_logprobs: list | None = None
    prompt_top_tokens: list | None = None  # aligned with prompt_logprobs: [[ids], [logprobs]] per token
    speculation: tuple[int, int] | None = None  # (guessed tokens, kept), for the request log
    cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache saved
    timings: Timings = field(default_factory=Timings)
    _mailbox: Mailbox | None = None
    _closed: bool = False
    _stop_tail: str = ""

    def __post_init__(self) -> None:
        tok = self.generator.tokenizer
        self._detok = tok.detokenizer(self.prepared.input_ids)
        self._max_stop = max((len(s) for s in self.prepared.params.stop), default=0)

    @property
    def input_length(self) -> int:
        return len(self.prepared.input_ids)

    @property
    def seed(self) -> int | None:
        return self.prepared.params.seed

    @property
    def generated_text(self) -> str:
        return "".join(self.text_parts)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def start(self) -> None:
        engine = self.generator.engine
        p = self.prepared
        self.rid = engine.new_rid()
        request = m.AddRequest(
            rid=self.rid, frontend_id=engine.frontend_id, input_ids=p.input_ids, sampling=p.params.sampling,
            stopping=m.StoppingParams(max_new_tokens=p.max_new_tokens,
                                      stop_token_ids=list(self.generator.tokenizer.eos_token_ids),
                                      ignore_eos=p.params.ignore_eos, request_stop_ids=p.params.stop_token_ids),
            prompt_logprobs=p.prompt_logprobs, arrival_time=p.arrival_time,
            traceparent=tracing.current_traceparent(), grammar=p.params.grammar, adapter=p.params.adapter,
            images=p.images)
        self.timings.queued = time.monotonic()
        self._mailbox = await engine.submit(request)

    def close(self) -> None:
        """Release the permit; abort in the scheduler if the request did not finish there."""
        if self._closed:
            return
        self._closed = True
        if self.rid:
            self.generator.engine.release(self.rid, abort=not self.done)
        self.generator.release()

    async def next_tokens(self, timeout: float | None = None) -> list[TokenOut] | None:
        """The tokens of the next engine event ([] once done); None if ``timeout`` passed first.

        Raises ApiError when the engine fails the request. Safe to call again after a timeout or a
        cancellation: no event is lost.
        """
        if self.done:
            return []
        item = await self._mailbox.get(timeout)
        if item is TIMED_OUT:
            return None
        if isinstance(item, EngineFailure):
            self.finish_reason = "error"  # finished in the engine: nothing to abort
            if item.error.kind in (ErrorKind.GENERATION, ErrorKind.INCOMPLETE):
                self.generator.liveness_needed = True  # /health proves the engine with a real generation
            raise item.error
        return self._accept(item)

    async def run_to_end(self) -> None:
        while not self.done:
            await self.next_tokens()

    # --- turning engine tokens into TGI tokens ----------------------------------------------------

    def _accept(self, item: EngineTokens) -> list[TokenOut]:
        tok = self.generator.tokenizer
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = item.prompt_logprobs
            self.prompt_top_tokens = item.prompt_top_tokens
        if item.speculation is not None:
            self.speculation = item.speculation
        if item.cached_tokens:
            self.cached_tokens = item.cached_tokens
        if not self.timings.first_token:
            self.timings.first_token = time.monotonic()
            if item.tokens and item.tokens[0].queue_time:
                self.timings.queue_time = float(item.tokens[0].queue_time)
        out = []
        for ev in item.tokens:
            special = tok.is_special(ev.token_id)
            text = self._detok.step(ev.token_id)
            finish = self._finish(ev.finish_reason, text)
            if finish is not None:
                text += self._detok.flush()  # a last token that ends inside a character
            if not special:
                self.text_parts.append(text)
            top = self._top_tokens(ev.top_tokens) if ev.top_tokens else []
            token = TokenOut(id=ev.token_id, text=text, logprob=ev.logprob, special=special,
                             top_tokens=top, finish_reason=finish)
            self.tokens.append(token)
            out.append(token)
            if finish is not None:
                self.finish_reason = finish
                self.timings.end = time.monotonic()
                if self.generator.on_finished is not None and ev.finish_reason != FinishReason.ABORTED:
                    self.generator.on_finished(self)
                # When the frontend decided (stop sequence, budget), the scheduler still runs it.
                self.generator.engine.release(self.rid, abort=ev.finish_reason == FinishReason.NONE)
                if ev.finish_reason == FinishReason.ABORTED:
                    raise generation_error("request aborted by the engine")
                break
        return out

    def _finish(self, engine_reason: int, text: str) -> str | None:
        """TGI's order: length, then EOS (both decided by the scheduler), then stop sequences."""
        minimum = self.prepared.params.sampling.min_new_tokens
        if engine_reason == FinishReason.LENGTH:
            self.stop_at_length = bool(self._max_stop) and self._matches_stop(text) and len(self.tokens) + 1 > minimum
        if engine_reason in (FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE):
            return FinishReason(engine_reason).tgi_name
        if engine_reason == FinishReason.ABORTED:
            return "aborted"
        # vLLM's min_tokens: no stop sequence completes within the first that many tokens (the tail is kept all the
        # same), as rank 0 samples no stop id there
        if self._max_stop and self._matches_stop(text) and len(self.tokens) + 1 > minimum:
            return "stop_sequence"
        if len(self.tokens) + 1 >= self.prepared.max_new_tokens:
            return "length"  # the scheduler should have said so; never run past the budget
        return None

    def _matches_stop(self, text: str) -> bool:
        """A stop sequence that ends inside this token's text (TGI only looks at the very end; a stop
        sequence in the middle of a token counts too, so stops need not align with token boundaries)."""
        if not text:
            return False
        tail = self._stop_tail + text
        start = max(len(self._stop_tail) - self._max_stop + 1, 0)
        matched = any(tail.find(stop, start) != -1 for stop in self.prepared.params.stop if stop)
        self._stop_tail = tail[-self._max_stop:]
        return matched

    def _top_tokens(self, top) -> list[dict]:
        tok = self.generator.tokenizer
        try:
            ids, logprobs = top
        except (TypeError, ValueError):
            return []
        texts = tok.token_texts(list(ids))
        return [{"id": i, "text": t, "logprob": lp, "special": tok.is_special(i)}
                for i, t, lp in zip(ids, texts, logprobs)]
