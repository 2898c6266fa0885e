"""TGI's native routes: /generate, /generate_stream, POST / (compat), /tokenize, /chat_tokenize,
/invocations, /health, /ping, GET /, /info, /metrics; the OpenAI ones are in openai_routes.py.

Errors before a response starts are JSON ``{"error","error_type"}`` with TGI's status (middleware);
once an SSE stream has started they travel in-band with HTTP 200, as TGI does. A client that goes away
cancels its handler (the runner sets ``handler_cancellation``), and ``Generation.close`` in the
``finally`` aborts the request in the scheduler.
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from llmbus.frontend import responses
from llmbus.frontend.anthropic_messages import setup_anthropic_routes
from llmbus.frontend.errors import ApiError, ErrorKind, validation_error
from llmbus.frontend.generation import Generation, run_all
from llmbus.frontend.metrics import render
from llmbus.frontend.middleware import mark_failed
from llmbus.frontend.openapi import add_openapi_routes
from llmbus.frontend.openai_requests import parse_chat, read_json_object
from llmbus.frontend.openai_routes import chat_completions, chat_format, chat_prompt, completions, setup_openai_routes
from llmbus.frontend.responses_api import setup_responses_routes
from llmbus.frontend.state import STATE, VERSION, FrontendState, json_response
from llmbus.frontend.token_routes import detokenize, other_shape, tokenize_other
from llmbus.frontend.validation import GenerateRequest, generate_request, load_json, parse_request, validate_best_of
from llmbus.frontend.vertex import setup_vertex_routes

log = structlog.get_logger("llmbus.frontend")

LIVENESS_TIMEOUT_S = 30.0
_DISCONNECTED = ConnectionResetError  # aiohttp's ClientConnectionResetError is one


async def _read(request: web.Request, *, compat: bool) -> GenerateRequest:
    """The body, with the server's sampling defaults where a request that samples left them unset."""
    req = parse_request(await request.read(), compat=compat)
    req.parameters = request.app[STATE].sampling_defaults.fill_tgi(req.parameters)
    return req


# --- generation -----------------------------------------------------------------------------------


async def _generate_json(state: FrontendState, req: GenerateRequest, start: float, arrival: float,
                         *, as_list: bool) -> web.Response:
    p = req.parameters
    best_of = 1 if p.best_of is None else p.best_of
    if best_of != 1:
        validate_best_of(best_of, state.limits)
    gens = await state.generator.prepare_all([(req.inputs, p, True)] * best_of, start, arrival)
    await run_all(gens)
    others = None
    if best_of > 1:
        # TGI keeps the sequence with the highest mean token logprob
        gen = gens.pop(max(range(len(gens)), key=lambda i: _mean_logprob(gens[i])))
        others = gens
    else:
        gen = gens[0]
    body = responses.generate_body(gen, return_full_text=bool(p.return_full_text),
                                   details=p.details or p.decoder_input_details, others=others)
    headers = responses.generate_headers(gen, state.config.compute_type, len(req.inputs))
    return json_response([body] if as_list else body, headers=headers)


def _mean_logprob(gen: Generation) -> float:
    values = [t.logprob for t in gen.tokens if t.logprob is not None]
    return sum(values) / len(values) if values else float("-inf")


async def _stream(request: web.Request, state: FrontendState, req: GenerateRequest, start: float,
                  arrival: float) -> web.StreamResponse:
    p = req.parameters
    resp = web.StreamResponse(status=200, headers=responses.stream_headers(state.config.compute_type,
                                                                           len(req.inputs)))
    await resp.prepare(request)
    gen = None
    details = p.details
    return_full_text = bool(p.return_full_text)
    try:
        if (1 if p.best_of is None else p.best_of) != 1:
            raise validation_error("`best_of` != 1 is not supported when streaming tokens")
        if p.decoder_input_details:
            raise validation_error("`decoder_input_details` == true is not supported when streaming tokens")
        gen = await state.generator.prepare(req.inputs, p, start, arrival)
        await gen.start()
        index = 0
        keepalive = state.config.keepalive_s
        while not gen.done:
            tokens = await gen.next_tokens(timeout=keepalive)
            if tokens is None:
                await resp.write(responses.KEEPALIVE)
                continue
            chunk = []
            for token in tokens:
                index += 1
                chunk.append(responses.stream_event(index, token, gen, return_full_text=return_full_text,
                                                    details=details))
            if chunk:
                await resp.write(b"".join(chunk))
    except ApiError as e:
        mark_failed(request, e)
        try:
            await resp.write(responses.error_event(e))
        except _DISCONNECTED:
            return resp
    except _DISCONNECTED:
        mark_failed(request, None)
        return resp  # the finally aborts the request
    finally:
        if gen is not None:
            gen.close()
    try:
        await resp.write_eof()
    except _DISCONNECTED:
        pass
    return resp


# --- handlers -------------------------------------------------------------------------------------


async def _read_native(request: web.Request) -> tuple[FrontendState, GenerateRequest, float, float]:
    """State, parsed body and timestamps of a /generate or /generate_stream call (prompt not echoed
    unless asked)."""
    start, arrival = time.monotonic(), time.time()
    req = await _read(request, compat=False)
    if req.parameters.return_full_text is None:
        req.parameters.return_full_text = False
    return request.app[STATE], req, start, arrival


async def generate(request: web.Request) -> web.StreamResponse:
    state, req, start, arrival = await _read_native(request)
    return await _generate_json(state, req, start, arrival, as_list=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    state, req, start, arrival = await _read_native(request)
    return await _stream(request, state, req, start, arrival)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    req = await _read(request, compat=True)
    if req.parameters.return_full_text is None:
        req.parameters.return_full_text = state.compat_return_full_text
    if req.stream:
        return await _stream(request, state, req, start, arrival)
    return await _generate_json(state, req, start, arrival, as_list=True)


def _token_spans(text: str, spans: list[tuple[int, int, int]]) -> list[dict]:
    return [{"id": i, "text": text[start:stop], "start": start, "stop": stop} for i, start, stop in spans]


async def tokenize(request: web.Request) -> web.Response:
    """The prompt's tokens with their character spans, as validation would tokenize it (vLLM's and llama.cpp's
    bodies get their own answers: token_routes.py)."""
    state = request.app[STATE]
    body = load_json(await request.read())
    if other_shape(body):
        return await tokenize_other(request, body)
    req = generate_request(body)
    # a vision model's images as their placeholder tokens, each with the placeholder's text (TGI's tokens too)
    text, _ = await state.generator.expand_images(req.inputs)
    spans = await state.generator.off_loop(state.tokenizer.encode_with_offsets, text)
    return json_response(_token_spans(text, spans))


async def chat_tokenize(request: web.Request) -> web.Response:
    """What /v1/chat/completions would feed the model: the templated text and its tokens."""
    state = request.app[STATE]
    chat = parse_chat(read_json_object(await request.read(), "ChatRequest"), state.limits,
                      state.config.max_client_batch_size, state.sampling_defaults, chat_format(state))
    text = chat_prompt(state, chat)
    expanded, _ = await state.generator.expand_images(text)  # the spans are of the text the tokens come from
    spans = await state.generator.off_loop(state.tokenizer.encode_with_offsets, expanded, False)
    return json_response({"tokenize_response": _token_spans(expanded, spans), "templated_text": text})


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's single route: TGI's generate body (``inputs``), a chat body (``messages``) or a completion
    body (``prompt``), tried in that order as TGI's untagged union does."""
    body = read_json_object(await request.read(), "a generate, chat or completion request")
    if "inputs" in body:
        return await compat_generate(request)
    if "messages" in body:
        return await chat_completions(request)  # aiohttp keeps the body: it can be read again
    if "prompt" in body:
        return await completions(request)
    return await compat_generate(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is None or not state.engine.healthy:
        raise ApiError(ErrorKind.UNHEALTHY)
    if state.generator is not None and state.generator.draining:
        raise ApiError(ErrorKind.SHUTTING_DOWN)  # load balancers stop sending here
    problem = await state.engine.check_ranks(state.config.health_check_timeout_s)
    if problem is not None:
        log.warning("health check failed", reason=problem)
        raise ApiError(ErrorKind.UNHEALTHY)
    if state.generator is not None and state.generator.liveness_needed:
        # after a failed generation, as TGI: only a real generation says the engine is well again
        if not await state.generator.liveness(LIVENESS_TIMEOUT_S):
            raise ApiError(ErrorKind.UNHEALTHY)
    return web.Response(status=200)


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    c, limits = state.config, state.limits
    return json_response({
        "model_id": c.model_id,
        "model_sha": None,
        "model_pipeline_tag": c.model_pipeline_tag,
        "max_concurrent_requests": c.max_concurrent_requests,
        "max_best_of": c.max_best_of,
        "max_stop_sequences": c.max_stop_sequences,
        "max_input_tokens": limits.max_input_tokens if limits else c.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens if limits else c.max_total_tokens,
        "validation_workers": c.validation_workers,
        "max_client_batch_size": c.max_client_batch_size,
        "router": "text-generation-router",
        "version": VERSION,
        "sha": None,
        "docker_label": None,
        "quantize": state.quantization,  # llmbus's: after TGI's own fields, which keep their order
        **engine_compute(state),
        # what a sampled request's unset parameters take (flags over generation_config.json)
        "sampling_defaults": state.sampling_defaults.values(),
    })


def engine_compute(state: FrontendState) -> dict:
    """/info's llmbus keys on what the ranks compute with, as the scheduler's hello told them (null before
    it, or from a scheduler that did not say)."""
    hello = state.engine.hello if state.engine is not None else None
    return {"dtype": getattr(hello, "dtype", "") or None,
            "attention_backend": getattr(hello, "attention_backend", "") or None,
            "devices": list(getattr(hello, "devices", []))}


async def metrics(request: web.Request) -> web.Response:
    body, content_type = render(request.app[STATE].metrics)
    return web.Response(body=body, headers={"Content-Type": content_type})


def setup_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/", compat_generate)
    app.router.add_get("/", health)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/chat_tokenize", chat_tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/invocations", invocations)
    setup_openai_routes(app)
    setup_anthropic_routes(app)
    setup_responses_routes(app)
    config = app[STATE].config
    setup_vertex_routes(app, config.aip_predict_route, config.aip_health_route, health)
    add_openapi_routes(app, VERSION, lambda: app[STATE].config.model_id)
