"""OpenAI's routes: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Each choice (``n`` per prompt) is one generation in the engine; they run concurrently and a stream
interleaves their chunks as tokens arrive. Everything is validated and tokenized before a response
starts, so a bad request is an HTTP error the SDKs raise, never a broken stream; errors after that travel
in-band as ``data: {"error": ...}`` before ``data: [DONE]``.

A model's reasoning section (frontend/reasoning.py) comes back as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``), apart from ``content`` and ``tool_calls``, when its template has thinking markers.

Text follows OpenAI, not TGI: a matched stop sequence is cut from the text (so a stream holds back the
last characters that could still begin one), finish reasons are ``stop`` / ``length``, ids are unique.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from llmbus.frontend.engine_client import TIMED_OUT, Mailbox
from llmbus.frontend.errors import ApiError, ErrorKind, validation_error
from llmbus.frontend.generation import Generation, TokenOut, cancel_and_close, run_all
from llmbus.frontend.middleware import mark_failed
from llmbus.frontend.openai_requests import (ChatRequest, CompletionRequest, OpenAIOptions, parse_chat,
                                             parse_completion, read_json_object)
from llmbus.frontend.harmony import HarmonyPlan
from llmbus.frontend.reasoning import (AnswerParser, ReasoningPlan, grammar_after_reasoning, grammar_in_harmony,
                                       opening, parse_answer)
from llmbus.frontend.responses import KEEPALIVE, dumps, f32, prompt_tokens, stream_headers, summed_headers
from llmbus.frontend.state import STATE, FrontendState, json_response
from llmbus.frontend.tokenizer import ModelTokenizer
from llmbus.frontend.tools import new_call_id, prepare_messages, takes_tools
from llmbus.frontend.validation import GenerateParameters

_FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
_DISCONNECTED = ConnectionResetError
DONE = b"data: [DONE]\n\n"


@dataclass
class Job:
    """One choice to generate: the prompt text and its parameters."""

    index: int  # the choice's index in the response
    prompt_index: int
    text: str | list[int]  # a prompt's text, or its token ids (completions)
    params: GenerateParameters
    add_special_tokens: bool
    echo: str = ""  # completions with echo: the prompt, written before the generated text


class Choice:
    """A generation seen through OpenAI's eyes: the text it may show so far, and its logprobs."""

    def __init__(self, job: Job, gen: Generation, markers: frozenset[str] = frozenset()):
        self.job = job
        self.gen = gen
        self.sent = 0  # characters of visible_text() already streamed
        # special tokens shown in the text after all: the chat format's markers (Mistral's [TOOL_CALLS]),
        # which its parsers read; looked for once per token, and only while none has come
        self._markers = markers
        self._marked, self._scanned = False, 0
        stops = gen.prepared.params.stop
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1

    @property
    def index(self) -> int:
        return self.job.index

    @property
    def ended_by(self) -> str | None:
        """The generation's finish reason, a stop sequence winning over the budget when the last allowed
        token completed one (``Generation.stop_at_length``)."""
        return "stop_sequence" if self.gen.stop_at_length else self.gen.finish_reason

    def visible_text(self) -> str:
        """The generated text without a matched stop sequence; while running, minus the tail that might
        still turn into one."""
        text = self.gen.generated_text
        if self._markers and not self._marked:
            tokens = self.gen.tokens
            self._marked = any(t.special and t.text in self._markers for t in tokens[self._scanned:])
            self._scanned = len(tokens)
        if self._marked:
            text = "".join(t.text for t in self.gen.tokens if not t.special or t.text in self._markers)
        if self.ended_by == "stop_sequence":
            return self._cut_at_stop(text)
        if self.ended_by == "eos_token" and not self.gen.prepared.params.include_stop_str:
            # vLLM's stop_token_ids: the token that stopped the answer is counted but not shown (EOS, special,
            # never is), unless include_stop_str_in_output
            last = self.gen.tokens[-1]
            if not last.special and last.text and text.endswith(last.text):
                return text[:-len(last.text)]
        if not self.gen.done and self._hold:
            return text[:max(len(text) - self._hold, 0)]
        return text

    def _cut_at_stop(self, text: str) -> str:
        """``text`` up to the stop sequence that ended it (through it, with vLLM's ``include_stop_str_in_output``):
        the first one to end past the first ``min_tokens`` tokens, within which none could complete."""
        params = self.gen.prepared.params
        early = sum(len(t.text) for t in self.gen.tokens[:params.sampling.min_new_tokens] if not t.special)
        found = [(i, i + len(s)) for s in self._stops if (i := text.find(s, max(early - len(s) + 1, 0))) != -1]
        if not found:
            return text
        start, end = min(found)
        return text[:end] if params.include_stop_str else text[:start]

    def next_delta(self) -> str:
        text = self.visible_text()
        delta = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta

    @property
    def finish_reason(self) -> str | None:
        reason = self.ended_by
        return None if reason is None else _FINISH_REASONS.get(reason, reason)

    def finish_reason_of(self, tokens: list[TokenOut]) -> str | None:
        """The finish reason if ``tokens`` (an event's) hold the last token. A stream renders events
        after the generation may have moved on, so the live state cannot tell."""
        return self.finish_reason if tokens and tokens[-1].finish_reason is not None else None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _header(state: FrontendState, object_name: str, rid: str, created: int, choices: list[Choice]) -> dict:
    """An answer's fields before its choices; ``model`` names the LoRA adapter that answered, if one did."""
    return {"id": rid, "object": object_name, "created": created, "model": state.answering_model(choices[0].gen),
            "system_fingerprint": state.system_fingerprint}


def _headers(state: FrontendState, choices: list[Choice]) -> dict[str, str]:
    """TGI's timing and token headers of a whole answer."""
    return summed_headers([c.gen for c in choices], state.config.compute_type, [c.job.prompt_index for c in choices])


def _usage(choices: list[Choice]) -> dict:
    prompts = {c.job.prompt_index: c.gen.input_length for c in choices}
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(len(c.gen.tokens) for c in choices)
    # a prompt counts once: of its choices' prefills, what the prefix cache served each of them
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.job.prompt_index] = min(cached.get(c.job.prompt_index, c.gen.cached_tokens), c.gen.cached_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


# --- logprobs ---------------------------------------------------------------------------------------


def _pieces(tokenizer: ModelTokenizer, ids: list[int]) -> tuple[list[str], list[list[int]]]:
    """Tokens as OpenAI's logprobs name them: each one's own bytes, and the text they read as (a token that
    ends inside a character shows U+FFFD, its ``bytes`` what it holds), the same for a chosen token and for
    its entry among another's top tokens."""
    raw = tokenizer.token_bytes(ids)
    return [b.decode("utf-8", errors="replace") for b in raw], [list(b) for b in raw]


def _chat_logprob(token: TokenOut, tokenizer: ModelTokenizer) -> dict:
    texts, raw = _pieces(tokenizer, [token.id, *(t["id"] for t in token.top_tokens)])
    return {"token": texts[0], "logprob": f32(token.logprob), "bytes": raw[0],
            "top_logprobs": [{"token": text, "logprob": f32(t["logprob"]), "bytes": b}
                             for t, text, b in zip(token.top_tokens, texts[1:], raw[1:])]}


def _chat_logprobs(tokens: list[TokenOut], options: OpenAIOptions, tokenizer: ModelTokenizer) -> dict | None:
    if options.top_logprobs is None:
        return None
    return {"content": [_chat_logprob(t, tokenizer) for t in tokens]}


def _completion_logprobs(tokens: list[TokenOut], options: OpenAIOptions, tokenizer: ModelTokenizer, offset: int,
                         prompt: list[dict] | None = None) -> dict | None:
    """The legacy shape: parallel lists, ``text_offset`` counting from ``offset`` characters of the text
    (``shown``: what a token added to it)."""
    if options.top_logprobs is None:
        return None
    rows = list(prompt or [])
    for t in tokens:
        texts, _ = _pieces(tokenizer, [t.id, *(x["id"] for x in t.top_tokens)])
        rows.append({"text": texts[0], "shown": t.text, "logprob": t.logprob,
                     "top": {text: f32(x["logprob"]) for x, text in zip(t.top_tokens, texts[1:])}})
    offsets = []
    for row in rows:
        offsets.append(offset)
        offset += len(row["shown"])
    return {"tokens": [r["text"] for r in rows], "token_logprobs": [f32(r["logprob"]) for r in rows],
            "top_logprobs": [r["top"] if options.top_logprobs else None for r in rows],
            "text_offset": offsets}


def _prompt_rows(gen: Generation) -> list[dict]:
    """Prompt tokens for ``echo`` with ``logprobs``: their logprobs, and their positions' most likely tokens,
    when the engine computed them (the first token has neither). Special tokens (a BOS) are listed but take no
    room in the echoed text (``shown``)."""
    tokenizer = gen.generator.tokenizer
    rows = prompt_tokens(gen)
    texts, _ = _pieces(tokenizer, [i for i, _, _ in rows])
    tops: list = [None] * len(rows)
    given = gen.prompt_top_tokens or []
    if len(given) <= len(rows):  # aligned to the end, as the logprobs are
        tops[len(rows) - len(given):] = [dict(zip(_pieces(tokenizer, list(ids))[0], map(f32, lps)))
                                         for ids, lps in given]
    return [{"text": text, "shown": "" if tokenizer.is_special(i) else text, "logprob": lp, "top": top}
            for (i, _, lp), text, top in zip(rows, texts, tops)]


# --- running choices ---------------------------------------------------------------------------------


def _choice_params(params: GenerateParameters, choice: int) -> GenerateParameters:
    """Choice i of a seeded request gets seed + i: n identical samples would be of no use."""
    if choice == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + choice) % 2**64)


async def prepare_choices(state: FrontendState, jobs: list[Job], start: float, arrival: float,
                          markers: frozenset[str] = frozenset()) -> list[Choice]:
    """The jobs' generations, validated and tokenized (not started), as Choices."""
    gens = await state.generator.prepare_all([(j.text, j.params, j.add_special_tokens) for j in jobs],
                                             start, arrival)
    return [Choice(job, gen, markers) for job, gen in zip(jobs, gens)]


async def _stream(request: web.Request, state: FrontendState, choices: list[Choice], options: OpenAIOptions,
                  render) -> web.StreamResponse:
    """SSE: ``render(choice, tokens)`` gives the chunks (dicts) for a choice's new tokens; ``render(c,
    None)`` its opening chunks. Then the usage chunk when asked, then ``[DONE]``."""
    resp = web.StreamResponse(status=200, headers=stream_headers(state.config.compute_type,
                                                                 sum(len(c.job.text) for c in choices)))
    tasks: list[asyncio.Future] = []
    try:
        await resp.prepare(request)
        opening = [chunk for c in choices for chunk in render(c, None)]
        if opening:
            await resp.write(b"".join(_event(chunk) for chunk in opening))
        if len(choices) == 1:
            next_event = one_choice_events(choices[0], state.config.keepalive_s)
        else:
            next_event, tasks = _many_choices(choices, state.config.keepalive_s)
        running = len(choices)
        while running:
            c, item = await next_event()
            if item is TIMED_OUT:
                await resp.write(KEEPALIVE)
                continue
            if item is None:
                running -= 1
            elif isinstance(item, ApiError):
                mark_failed(request, item)
                await resp.write(_event(item.openai_body()) + DONE)
                return resp
            elif item:
                chunks = render(c, item)
                if chunks:
                    await resp.write(b"".join(_event(chunk) for chunk in chunks))
        if options.include_usage:
            await resp.write(_event({**render.header, "choices": [], "usage": _usage(choices)}))
        await resp.write(DONE)
        await resp.write_eof()
    except _DISCONNECTED:
        mark_failed(request, None)  # the finally aborts what is still running
    finally:
        await cancel_and_close(tasks, [c.gen for c in choices])
    return resp


def one_choice_events(c: Choice, keepalive_s: float):
    """``next_event`` for a request of one choice, read directly: (choice, tokens), (choice, TIMED_OUT) when
    a keep-alive interval passed, (choice, ApiError) or, once done, (choice, None). No task or queue between
    engine and response: at one stream their hops were a fifth of the frontend's CPU a token."""
    started = False

    async def next_event():
        nonlocal started
        try:
            if not started:
                started = True
                await c.gen.start()
            if c.gen.done:
                return c, None
            tokens = await c.gen.next_tokens(timeout=keepalive_s)
        except ApiError as e:
            return c, e
        return c, TIMED_OUT if tokens is None else tokens

    return next_event


def _many_choices(choices: list[Choice], keepalive_s: float):
    """``next_event`` (as ``one_choice_events``'s) for several choices, each driven by a task of its own into
    one mailbox, and the tasks."""
    events = Mailbox()

    async def pump(c: Choice) -> None:
        try:
            await c.gen.start()
            while not c.gen.done:
                events.put_nowait((c, await c.gen.next_tokens()))
        except ApiError as e:
            events.put_nowait((c, e))
        finally:
            events.put_nowait((c, None))

    async def next_event():
        item = await events.get(keepalive_s)
        return (None, item) if item is TIMED_OUT else item

    return next_event, [asyncio.ensure_future(pump(c)) for c in choices]


def _event(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


# --- chat ------------------------------------------------------------------------------------------


class _Chunks:
    """Renders a stream's chunks: ``self(choice, None)`` opens a choice, ``self(choice, tokens)`` carries
    an event's tokens. With include_usage, every chunk has ``usage: null`` until the usage chunk."""

    def __init__(self, header: dict, options: OpenAIOptions):
        self.header = header
        self.options = options
        self.usage_null = {"usage": None} if options.include_usage else {}

    def _chunk(self, choice: dict) -> dict:
        return {**self.header, "choices": [choice], **self.usage_null}


class _ChatChunks(_Chunks):
    def __init__(self, header: dict, options: OpenAIOptions, chat: ChatRequest):
        super().__init__(header, options)
        # with tools, each choice's text goes through a parser that turns calls into tool_calls deltas;
        # with a reasoning section, first through one that takes it apart
        self.chat = chat
        self.parsers: dict[int, AnswerParser] | None = {} if chat.plan or chat.reasoning else None

    def _delta(self, c: Choice, delta: dict, logprobs, finish) -> dict:
        return self._chunk({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def __call__(self, c: Choice, tokens: list[TokenOut] | None) -> list[dict]:
        if tokens is None:  # OpenAI opens every choice with its role
            return [self._delta(c, {"role": "assistant", "content": ""}, None, None)]
        text = c.next_delta()
        logprobs = _chat_logprobs(tokens, self.options, c.gen.generator.tokenizer)
        finish = c.finish_reason_of(tokens)
        if self.parsers is not None:
            return self._parsed_deltas(c, text, logprobs, finish)
        if not text and logprobs is None and finish is None:
            return []  # a token whose text is held back, or a special token
        return [self._delta(c, {"content": text} if text or finish is None else {}, logprobs, finish)]

    def _parsed_deltas(self, c: Choice, text: str, logprobs, finish) -> list[dict]:
        parser = self.parsers.get(c.index)
        if parser is None:
            parser = self.parsers[c.index] = answer_parser(self.chat)
        deltas = parser.feed(text) if text else []
        if finish is not None:
            deltas += parser.finish()
            finish = _tool_finish_reason(finish, parser.has_calls, self.chat)
        if not deltas and (logprobs is not None or finish is not None):
            deltas = [{}]
        chunks = [self._delta(c, d, None, None) for d in deltas]
        if chunks:  # the event's logprobs ride on its first chunk, the finish reason on its last
            chunks[0]["choices"][0]["logprobs"] = logprobs
            chunks[-1]["choices"][0]["finish_reason"] = finish
        return chunks


def _tool_finish_reason(finish: str, has_calls: bool, chat: ChatRequest) -> str:
    """OpenAI's "tool_calls" when the answer called tools and ended by itself (not cut by max_tokens), but
    "stop" when ``tool_choice`` named the function, as OpenAI answers (and vLLM, after it), streamed or not."""
    named = chat.plan is not None and chat.plan.choice == "function"
    return "tool_calls" if has_calls and finish == "stop" and not named else finish


def _chat_message(c: Choice, chat: ChatRequest) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, and its finish reason."""
    reasoning, content, calls = parse_answer(c.visible_text(), chat.reasoning, tools_format(chat))
    head = {"role": "assistant"}
    if chat.reasoning is not None:  # the template knows reasoning: say whether there was any
        head["reasoning_content"] = reasoning
    if not calls:
        return {**head, "content": content}, c.finish_reason
    return {**head, "content": content, "tool_calls": calls}, _tool_finish_reason(c.finish_reason, True, chat)


def tools_format(chat: ChatRequest):
    """The syntax the request's answer may call tools in (None: no tools offered)."""
    return chat.plan.format if chat.plan is not None else None


def answer_parser(chat: ChatRequest, new_id=new_call_id) -> AnswerParser:
    """The stream parser of one of the request's answers (reasoning, content, tool calls)."""
    return AnswerParser(chat.reasoning, tools_format(chat), new_id)


def chat_format(state: FrontendState):
    """The served model's ``ChatFormat`` (its tool syntax and thinking markers)."""
    return state.chat_template.chat_format(state.config.tool_call_parser, state.tokenizer.tokenizer,
                                           state.tokenizer.special_ids, reads_images=state.vision is not None)


def chat_prompt(state: FrontendState, chat: ChatRequest) -> str:
    """The conversation through the model's template, tools shown to the model as the template allows.
    Where the template has thinking markers, it also settles ``chat.reasoning`` (where the generation
    starts) and lets the request's grammar begin after the reasoning section; where it writes harmony, the
    answer is read as harmony and a grammar holds its final message (a tool plan's grammar is harmony's
    already)."""
    source = state.chat_template.source
    messages = prepare_messages(chat.messages, chat.plan, source, chat.tool_prompt)
    if chat.plan is not None:
        tools = chat.plan.template_tools(source)
    else:  # tool_choice "none": a template that declares tools still sees them
        tools = chat.tools if chat.tools and takes_tools(source) else None
    prompt = state.chat_template.render(messages, tools, chat.template_kwargs,
                                        image_token=state.vision.template_token if state.vision is not None else None)
    fmt = chat_format(state)
    if fmt.harmony and chat.reasoning is None:
        chat.reasoning = HarmonyPlan(calls=chat.plan is not None)
        if chat.plan is None:
            chat.params.constraint = grammar_in_harmony(chat.params.constraint, fmt.token_of)
    elif fmt.reasoning is not None and chat.reasoning is None:  # (rendered once: the grammar is wrapped once)
        chat.reasoning = ReasoningPlan(fmt.reasoning, opening(fmt.reasoning, prompt))
        others = set(fmt.added_tokens.values()) - set(state.tokenizer.eos_token_ids)
        chat.params.constraint = grammar_after_reasoning(chat.params.constraint, chat.reasoning, fmt.token_of,
                                                         others)
    return prompt


async def chat_completions(request: web.Request) -> web.StreamResponse:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    chat = parse_chat(read_json_object(await request.read(), "ChatRequest"), state.limits,
                      state.config.max_client_batch_size, state.sampling_defaults, chat_format(state))
    prompt = chat_prompt(state, chat)
    # the rendered template already holds the BOS and other special tokens
    jobs = [Job(i, 0, prompt, _choice_params(chat.params, i), add_special_tokens=False)
            for i in range(chat.options.n)]
    choices = await prepare_choices(state, jobs, start, arrival, chat_format(state).markers)
    header = _header(state, "chat.completion", _new_id("chatcmpl"), int(arrival), choices)
    if chat.options.stream:
        render = _ChatChunks({**header, "object": "chat.completion.chunk"}, chat.options, chat)
        return await _stream(request, state, choices, chat.options, render)
    await run_all([c.gen for c in choices])
    answers = [(c, *_chat_message(c, chat)) for c in choices]
    return json_response({**header, "choices": [
        {"index": c.index, "message": message,
         "logprobs": _chat_logprobs(c.gen.tokens, chat.options, c.gen.generator.tokenizer), "finish_reason": finish}
        for c, message, finish in answers], "usage": _usage(choices)}, headers=_headers(state, choices))


# --- completions -----------------------------------------------------------------------------------


class _CompletionChunks(_Chunks):
    def __init__(self, header: dict, options: OpenAIOptions):
        super().__init__(header, options)
        # echo with logprobs: the prompt's logprobs come with a choice's first tokens, and the echo with them
        self.echo_waits = options.top_logprobs is not None
        self.echoed: set[int] = set()

    def __call__(self, c: Choice, tokens: list[TokenOut] | None) -> list[dict]:
        tokenizer = c.gen.generator.tokenizer
        if tokens is None:
            if not c.job.echo or self.echo_waits:
                return []
            return [self._text(c, c.job.echo, None, None)]
        chunks = []
        if c.job.echo and self.echo_waits and c.index not in self.echoed:
            self.echoed.add(c.index)
            prompt = _completion_logprobs([], self.options, tokenizer, 0, _prompt_rows(c.gen))
            chunks.append(self._text(c, c.job.echo, prompt, None))
        offset = len(c.job.echo) + c.sent
        text = c.next_delta()
        logprobs = _completion_logprobs(tokens, self.options, tokenizer, offset)
        finish = c.finish_reason_of(tokens)
        if text or logprobs is not None or finish is not None:
            chunks.append(self._text(c, text, logprobs, finish))
        return chunks

    def _text(self, c: Choice, text: str, logprobs, finish) -> dict:
        return self._chunk({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish})


def _completion_choice(c: Choice, options: OpenAIOptions) -> dict:
    prompt = _prompt_rows(c.gen) if c.job.echo and options.top_logprobs is not None else None
    return {"index": c.index, "text": c.job.echo + c.visible_text(),
            "logprobs": _completion_logprobs(c.gen.tokens, options, c.gen.generator.tokenizer,
                                             0 if prompt else len(c.job.echo), prompt),
            "finish_reason": c.finish_reason}


async def completions(request: web.Request) -> web.StreamResponse:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    req: CompletionRequest = parse_completion(read_json_object(await request.read(), "CompletionRequest"),
                                              state.limits, state.config.max_client_batch_size,
                                              state.sampling_defaults)
    n = req.options.n
    params = req.params
    if req.echo and req.options.top_logprobs is not None:
        if not state.config.enable_prefill_logprobs:  # (not nulls in their place: lm-eval would read them)
            raise validation_error("`echo` with `logprobs` lists the prompt's logprobs, which this server "
                                   "computes only when started with --enable-prefill-logprobs", param="echo")
        params = dataclasses.replace(params, decoder_input_details=True)
    jobs = [Job(p * n + i, p, prompt, _choice_params(params, i), add_special_tokens=True)
            for p, prompt in enumerate(req.prompts) for i in range(n)]
    choices = await prepare_choices(state, jobs, start, arrival)
    if req.echo:  # the prompt's text (a prompt of token ids: as decoded, once they passed validation)
        for c in choices:
            c.job.echo = c.gen.prepared.inputs
    header = _header(state, "text_completion", _new_id("cmpl"), int(arrival), choices)
    if req.options.stream:
        return await _stream(request, state, choices, req.options, _CompletionChunks(header, req.options))
    await run_all([c.gen for c in choices])
    return json_response({**header, "choices": [_completion_choice(c, req.options) for c in choices],
                          "usage": _usage(choices)}, headers=_headers(state, choices))


def _model_cards(state: FrontendState) -> list[dict]:
    """The served model, then each LoRA adapter with the base as its ``parent`` (as vLLM lists them): a
    client selects one by naming it as ``model``. Each says its ``max_model_len`` (--max-total-tokens), as
    vLLM's cards do: clients size their prompts by it."""
    model_id = state.config.model_id
    adapters = state.engine.lora_adapters if state.engine is not None else []
    card = {"object": "model", "created": 0, "owned_by": model_id, "max_model_len": state.limits.max_total_tokens}
    return [{"id": model_id, **card}, *({"id": name, **card, "parent": model_id} for name in adapters)]


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def model(request: web.Request) -> web.Response:
    """One of ``models``' cards by its id (OpenAI's ``models.retrieve``); an id with slashes is taken whole."""
    name = request.match_info["model"]
    for card in _model_cards(request.app[STATE]):
        if card["id"] == name:
            return json_response(card)
    raise ApiError(ErrorKind.NOT_FOUND, f"The model `{name}` does not exist", param="model")


def setup_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
