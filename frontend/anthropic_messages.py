"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body becomes the chat route's request (``anthropic_requests.py``) and runs on the chat path as it
is: the same template rendering, tool grammar, sampling defaults, admission, limits and metrics. What is
Anthropic's is the answer's shape:

- a message with ``content`` blocks: ``thinking`` (a reasoning model's section, frontend/reasoning.py; no
  signature), ``text``, then ``tool_use`` (``input`` an object) for each call the chat path's parser finds
  in the model's syntax; ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` (with
  the sequence) or ``tool_use``; ``usage`` with ``cache_read_input_tokens`` from the prefix cache;
- with ``stream: true``, named SSE events: ``message_start``, ``ping``, per block ``content_block_start``,
  ``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
  ``message_delta`` (stop reason, cumulative usage) and ``message_stop``; ``ping`` keeps an idle stream open;
- errors in Anthropic's envelope (``errors.ANTHROPIC_ERRORS``): before the answer starts an HTTP error
  (middleware), after it an ``event: error``.
"""

from __future__ import annotations

import json
import secrets
import time

from aiohttp import web

from llmbus.frontend.anthropic_requests import parse_messages
from llmbus.frontend.engine_client import TIMED_OUT
from llmbus.frontend.errors import ApiError
from llmbus.frontend.generation import run_all
from llmbus.frontend.middleware import mark_failed
from llmbus.frontend.openai_requests import ChatRequest, read_json_object
# the chat route's choice machinery: one choice, read directly from the engine as its streams are
from llmbus.frontend.openai_routes import Choice, Job, answer_parser, chat_format, chat_prompt, one_choice_events, \
    prepare_choices, tools_format
from llmbus.frontend.reasoning import parse_answer
from llmbus.frontend.responses import dumps, stream_headers
from llmbus.frontend.state import STATE, FrontendState, json_response

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# the engine's finish reasons as Anthropic's stop reasons ("tool_use" when the answer called tools)
_STOP_REASONS = {"eos_token": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens"}
_DISCONNECTED = ConnectionResetError


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _tool_use_id() -> str:
    return _new_id("toolu_")


def _read(request_body: bytes, state: FrontendState, *, count_only: bool = False) -> ChatRequest:
    return parse_messages(read_json_object(request_body, "a Messages request"), state.limits,
                          state.sampling_defaults, count_only=count_only, chat_format=chat_format(state))


def _matched_stop(c: Choice) -> str | None:
    """The stop sequence that ended the text: the one found first (where ``Choice`` cuts the text)."""
    if c.ended_by != "stop_sequence":
        return None
    text = c.gen.generated_text
    found = [(text.find(s), i) for i, s in enumerate(c.gen.prepared.params.stop) if s and s in text]
    return c.gen.prepared.params.stop[min(found)[1]] if found else None


def _stop_reason(c: Choice, called: bool) -> str:
    reason = _STOP_REASONS.get(c.ended_by, "end_turn")
    return "tool_use" if called and reason != "max_tokens" else reason


def _usage(c: Choice) -> dict:
    """Anthropic counts a prompt as its uncached tokens plus those read from the cache."""
    cached = c.gen.cached_tokens
    return {"input_tokens": c.gen.input_length - cached, "output_tokens": len(c.gen.tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(state: FrontendState, c: Choice, rid: str, content: list[dict], stop_reason, stop_sequence,
             usage: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": state.answering_model(c.gen),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def _content(c: Choice, chat: ChatRequest) -> tuple[list[dict], bool]:
    """A finished choice's content blocks, and whether it called tools."""
    thought, text, calls = parse_answer(c.visible_text(), chat.reasoning, tools_format(chat), _tool_use_id)
    text = text or ""
    blocks = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    blocks += [{"type": "text", "text": text}] if text or not calls else []
    blocks += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"])} for call in calls]
    return blocks, bool(calls)


# --- streaming ---------------------------------------------------------------------------------------


def _event(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"


PING = _event({"type": "ping"})


class _Blocks:
    """A choice's text as Anthropic's block events: reasoning goes into a thinking block, text into a text
    block, each tool call (from the chat path's ``AnswerParser`` deltas) into a tool_use block of its own; a
    block stops when the next begins, or at the end."""

    def __init__(self, chat: ChatRequest):
        self.parser = answer_parser(chat, _tool_use_id) if chat.plan or chat.reasoning else None
        self.answered = False  # a text or tool_use block began
        self.index = -1
        self.open: str | None = None  # the type of the block being written
        self.called = False

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        self.answered = True
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return events + [{"type": "content_block_delta", "index": self.index,
                          "delta": {"type": "text_delta", "text": text}}]

    def _delta(self, delta: dict) -> list[dict]:
        if "reasoning_content" in delta:
            events = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "",
                                                                       "signature": ""})
            return events + [{"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}}]
        if "content" in delta:
            return self._text(delta["content"])
        call = delta["tool_calls"][0]
        if "id" in call:  # a call's first delta names it; its arguments follow
            self.called = self.answered = True
            return self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                "input": {}})
        return [{"type": "content_block_delta", "index": self.index,
                 "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}}]

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self.parser is None:
            events = self._text(text)
        else:
            deltas = self.parser.feed(text) if text else []
            if finished:
                deltas += self.parser.finish()
            events = [e for d in deltas for e in self._delta(d)]
        if finished:
            if not self.answered:  # nothing was said: one empty text block, as the whole answer has
                events += self._start({"type": "text", "text": ""})
            events += self.close()
        return events


async def _stream(request: web.Request, state: FrontendState, c: Choice, chat: ChatRequest,
                  rid: str) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=stream_headers(state.config.compute_type, len(c.job.text)))
    blocks = _Blocks(chat)
    next_event = one_choice_events(c, state.config.keepalive_s)
    started = False

    def opening() -> bytes:
        """message_start (held until the engine's first answer, which says how much of the prompt the cache
        held, or until a keep-alive is due), and a ping, as Anthropic's API sends one."""
        nonlocal started
        started = True
        usage = _usage(c) | {"output_tokens": 0}
        return _event({"type": "message_start", "message": _message(state, c, rid, [], None, None, usage)}) + PING

    try:
        await resp.prepare(request)
        while True:
            _, item = await next_event()
            out = b"" if started else opening()
            if item is TIMED_OUT:
                await resp.write(out + PING)
                continue
            if isinstance(item, ApiError):
                mark_failed(request, item)
                await resp.write(out + _event(item.anthropic_body()))
                return resp
            if item is None:
                break
            finished = bool(item) and item[-1].finish_reason is not None
            events = blocks.feed(c.next_delta(), finished)
            if finished:
                delta = {"stop_reason": _stop_reason(c, blocks.called), "stop_sequence": _matched_stop(c)}
                events += [{"type": "message_delta", "delta": delta, "usage": _usage(c)},
                           {"type": "message_stop"}]
            if out or events:
                await resp.write(out + b"".join(_event(e) for e in events))
        await resp.write_eof()
    except _DISCONNECTED:
        mark_failed(request, None)  # the finally aborts the generation
    finally:
        c.gen.close()
    return resp


# --- handlers ----------------------------------------------------------------------------------------


async def messages(request: web.Request) -> web.StreamResponse:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    chat = _read(await request.read(), state)
    # the rendered template already holds the BOS and other special tokens
    job = Job(0, 0, chat_prompt(state, chat), chat.params, add_special_tokens=False)
    (choice,) = await prepare_choices(state, [job], start, arrival, chat_format(state).markers)
    rid = _new_id("msg_")
    if chat.options.stream:
        return await _stream(request, state, choice, chat, rid)
    await run_all([choice.gen])
    content, called = _content(choice, chat)
    return json_response(_message(state, choice, rid, content, _stop_reason(choice, called), _matched_stop(choice),
                                  _usage(choice)))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as ``/v1/messages`` would feed them to the model (template, tools, images' tokens
    and all)."""
    state = request.app[STATE]
    chat = _read(await request.read(), state, count_only=True)
    ids, _ = await state.generator.prompt_ids(chat_prompt(state, chat), add_special_tokens=False)
    return json_response({"input_tokens": len(ids)})


def setup_anthropic_routes(app: web.Application) -> None:
    app.router.add_post(MESSAGES_PATH, messages)
    app.router.add_post(COUNT_TOKENS_PATH, count_tokens)
