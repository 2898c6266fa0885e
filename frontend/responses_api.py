"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: the body is translated into a chat body
(``responses_requests.py``) that ``parse_chat`` reads, the prompt is rendered by ``chat_prompt`` and the
generation runs as the chat route's does (one choice), so templates, tool and ``text.format`` grammars,
sampling defaults, limits, the API key and the request metrics are the chat route's. Only the answer's
shape is this module's: ``output`` items and, streamed, Responses events (``responses_output.py``) in
OpenAI's SSE form (``event: <type>`` and ``data: <json>``, no ``[DONE]``).

Everything is validated before a response starts, so a bad request is an HTTP error in OpenAI's envelope
(the middleware's, for every ``/v1/`` route); an engine error after the stream started is an in-band
``error`` event. With ``store`` (OpenAI's default) the finished response and its conversation are kept in
this process's ``ResponseStore`` for ``previous_response_id``.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from llmbus.frontend.errors import ApiError, validation_error
from llmbus.frontend.generation import run_all
from llmbus.frontend.middleware import mark_failed
from llmbus.frontend.openai_requests import ChatRequest, parse_chat, read_json_object
from llmbus.frontend.openai_routes import Choice, Job, answer_parser, chat_format, chat_prompt
from llmbus.frontend.responses import KEEPALIVE, dumps, stream_headers
from llmbus.frontend.responses_output import OutputBuilder
from llmbus.frontend.responses_requests import ResponsesRequest, output_messages, parse_responses
from llmbus.frontend.responses_store import ResponseStore, StoredResponse
from llmbus.frontend.state import STATE, FrontendState, json_response
from llmbus.frontend.tools import EMPTY_PARAMETERS

PATH = "/v1/responses"
STORE = web.AppKey("llmbus_responses_store", ResponseStore)
_DISCONNECTED = ConnectionResetError


def _store(request: web.Request) -> ResponseStore:
    return request.app[STORE]


def _sampling_stated(echo: dict, sampling) -> tuple[float, float]:
    """(temperature, top_p) as OpenAI's response object states them, never null: the request's, else what
    the generation used (the model's defaults, or OpenAI's 1); a greedy generation's temperature is 0."""
    temperature = echo["temperature"] if echo["temperature"] is not None else (
        sampling.temperature if sampling.do_sample else 0.0)
    return temperature, echo["top_p"] if echo["top_p"] is not None else sampling.top_p


class _Answer:
    """One response being answered: its request, the chat request it runs as, and its generation."""

    def __init__(self, state: FrontendState, req: ResponsesRequest, chat: ChatRequest, choice: Choice,
                 created: int):
        self.state, self.req, self.chat, self.choice = state, req, chat, choice
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = created

    def body(self, status: str, output: list[dict], *, usage: bool) -> dict:
        """The response object (OpenAI's field order); usage only once the generation ended."""
        gen, req, chat = self.choice.gen, self.req, self.chat
        temperature, top_p = _sampling_stated(req.echo, gen.prepared.params.sampling)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        tool_choice = req.chat_body.get("tool_choice") or "auto"
        if isinstance(tool_choice, dict):
            tool_choice = {"type": "function", "name": tool_choice["function"]["name"]}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete,
            "instructions": req.echo["instructions"], "max_output_tokens": req.echo["max_output_tokens"],
            "model": self.state.answering_model(gen), "output": output,
            "parallel_tool_calls": chat.plan.parallel if chat.plan is not None
            else req.chat_body.get("parallel_tool_calls") is not False,
            "previous_response_id": req.previous_response_id, "reasoning": req.echo["reasoning"],
            "store": req.store, "temperature": temperature,
            "text": req.echo["text"],
            "tool_choice": tool_choice,
            "tools": [{"type": "function", "name": t["name"], "description": t.get("description"),
                       "parameters": t.get("parameters") or EMPTY_PARAMETERS, "strict": t.get("strict", True)}
                      for t in req.tools],
            "top_p": top_p, "truncation": "disabled",
            "usage": {"input_tokens": gen.input_length,
                      # the prompt tokens the scheduler's prefix cache held (their prefill skipped)
                      "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                      "output_tokens": len(gen.tokens), "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": gen.input_length + len(gen.tokens)} if usage else None,
            "user": req.echo["user"], "metadata": req.echo["metadata"],
        }

    def status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def finished(self, request: web.Request, output: list[dict]) -> dict:
        body = self.body(self.status(), output, usage=True)
        if self.req.store:
            _store(request).put(self.id, StoredResponse(body, self.req.history + output_messages(output)))
        return body


async def _prepare(request: web.Request) -> _Answer:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    body = read_json_object(await request.read(), "a Responses API request")
    previous_id = body.get("previous_response_id")
    if previous_id is not None and not isinstance(previous_id, str):
        raise validation_error("`previous_response_id` must be a string", param="previous_response_id")
    previous = _store(request).get(previous_id).messages if previous_id is not None else None
    fmt = chat_format(state)
    req = parse_responses(body, previous, images=fmt.reads_images)
    chat = parse_chat(req.chat_body, state.limits, 1, state.sampling_defaults, fmt, req.thinking)
    prompt = chat_prompt(state, chat)
    # the rendered template already holds the BOS and other special tokens
    job = Job(0, 0, prompt, chat.params, add_special_tokens=False)
    gen, = await state.generator.prepare_all([(prompt, chat.params, False)], start, arrival)
    return _Answer(state, req, chat, Choice(job, gen, chat_format(state).markers), int(arrival))


async def create_response(request: web.Request) -> web.StreamResponse:
    answer = await _prepare(request)
    if answer.req.stream:
        return await _stream(request, answer)
    choice = answer.choice
    await run_all([choice.gen])
    builder = OutputBuilder(parser=answer_parser(answer.chat))
    builder.feed(choice.visible_text())
    builder.finish(answer.status())
    return json_response(answer.finished(request, builder.output))


def _sse(events: list[dict]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n" for e in events)


async def _stream(request: web.Request, answer: _Answer) -> web.StreamResponse:
    state, choice = answer.state, answer.choice
    resp = web.StreamResponse(status=200, headers=stream_headers(state.config.compute_type, len(choice.job.text)))
    builder = OutputBuilder(parser=answer_parser(answer.chat))
    try:
        await resp.prepare(request)
        opening = answer.body("in_progress", [], usage=False)
        builder.event("response.created", response=opening)
        builder.event("response.in_progress", response=opening)
        await resp.write(_sse(builder.take_events()))
        gen = choice.gen
        try:
            await gen.start()
            while not gen.done:
                tokens = await gen.next_tokens(timeout=state.config.keepalive_s)
                if tokens is None:
                    await resp.write(KEEPALIVE)
                    continue
                builder.feed(choice.next_delta())
                if builder.events:
                    await resp.write(_sse(builder.take_events()))
        except ApiError as e:
            mark_failed(request, e)
            builder.event("error", code=e.error_type, message=e.message, param=e.param)
            await resp.write(_sse(builder.take_events()))
            return resp
        builder.feed(choice.next_delta())  # what was held back for a stop sequence that never came
        status = answer.status()
        builder.finish(status)
        final = answer.finished(request, builder.output)
        builder.event("response.completed" if status == "completed" else "response.incomplete", response=final)
        await resp.write(_sse(builder.take_events()))
        await resp.write_eof()
    except _DISCONNECTED:
        mark_failed(request, None)  # the finally aborts the generation
    finally:
        choice.gen.close()
    return resp


async def get_response(request: web.Request) -> web.Response:
    return json_response(_store(request).get(request.match_info["response_id"]).body)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    _store(request).delete(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def setup_responses_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore(app[STATE].config.responses_store_size)  # the state is set before the routes
    app.router.add_post(PATH, create_response)
    app.router.add_get(PATH + "/{response_id}", get_response)
    app.router.add_delete(PATH + "/{response_id}", delete_response)
