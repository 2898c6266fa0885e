"""What wraps every route: errors to JSON, the ``--api-key`` check and CORS.

Errors are answered in one place, from ``errors.ERROR_TABLE``: TGI's ``{"error","error_type"}`` body, or
OpenAI's envelope on the ``/v1/`` routes. The API key guards the routes that generate or tokenize, as in
TGI (``/health``, ``/info``, ``/metrics`` and the docs stay open for probes and scrapers).
"""

from __future__ import annotations

import asyncio
import hmac

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from llmbus.bus import tracing
from llmbus.frontend.errors import ApiError, ErrorKind
from llmbus.frontend.request_metrics import DROPPED, failure_label
from llmbus.frontend.state import STATE, json_response

GENERATION_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions",
                              "/invocations", "/vertex", "/v1/responses", "/v1/messages"})
# TGI leaves /chat_tokenize open; every route that tokenizes is guarded here (it costs the server as much)
AUTH_PATHS = GENERATION_PATHS | {"/tokenize", "/detokenize", "/chat_tokenize", "/v1/messages/count_tokens"}
# stored responses (GET and DELETE /v1/responses/{id}) hold conversations: the key guards them too
AUTH_PREFIXES = ("/v1/responses/",)
# a streaming handler that answered 200 but then failed in-band (or lost its client) says so here
OUTCOME = web.RequestKey("llmbus_outcome", str)
OPENAI_PREFIX = "/v1/"
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's routes: its error envelope and statuses
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: what tracing and access logs see; never sent
CORS_METHODS = "GET,POST,DELETE"
CORS_HEADERS = "content-type,authorization,x-api-key,anthropic-version"  # the last two: Anthropic's SDKs

log = structlog.get_logger("llmbus.frontend")

# paths that stand for one of llmbus's routes (Vertex AI's AIP_PREDICT_ROUTE for /vertex, AIP_HEALTH_ROUTE for
# /health): the middlewares treat a request on one as a request on the route
ROUTE_ALIASES = web.AppKey("llmbus_route_aliases", dict)


def route_path(request: web.Request) -> str:
    """The route a request is for: its path, or the route a Vertex-named path stands for."""
    aliases = request.app.get(ROUTE_ALIASES)
    return aliases.get(request.path, request.path) if aliases else request.path


def answer_for(e: Exception) -> ApiError:
    """The error answer for what a handler raised (not a 404 or 405 of aiohttp's routing)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return ApiError(ErrorKind.PAYLOAD_TOO_LARGE, "length limit exceeded")
    if isinstance(e, RequestPayloadError):  # a body its Content-Encoding does not decode, a broken chunk
        reason = getattr(e.__cause__, "message", None) or str(e)
        return ApiError(ErrorKind.BODY, f"Failed to read the request body: {reason}")
    return ApiError(ErrorKind.INTERNAL)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPNotFound:
        if not _anthropic(request):
            raise  # aiohttp's own 404 elsewhere, as TGI's router answers an empty one
        error = ApiError(ErrorKind.NOT_FOUND, f"Not found: {request.method} {request.path}")
    except ConnectionResetError:
        # the client left before the response started (a stream's headers found the socket closing): no
        # one to answer, and not the server's fault, so no traceback from aiohttp's 500 path either
        log.info("client disconnected before the response", method=request.method, path=request.path)
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except web.HTTPException as e:
        if not isinstance(e, web.HTTPRequestEntityTooLarge):
            raise  # aiohttp's other answers (405 and the like) as they are
        error = answer_for(e)
    except Exception as e:
        error = answer_for(e)
        if error.kind is ErrorKind.INTERNAL:  # the client gets the route's error body; the log, why
            log.exception("request failed", method=request.method, path=request.path)
    if _anthropic(request):
        return json_response(error.anthropic_body(), status=error.anthropic_status)
    body = error.openai_body() if route_path(request).startswith(OPENAI_PREFIX) else error.body()
    return json_response(body, status=error.status)


def _anthropic(request: web.Request) -> bool:
    path = route_path(request)
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


@web.middleware
async def request_metrics_middleware(request: web.Request, handler):
    """tgi_request_count / _success / _failure{err}: once per generation request, whatever its route."""
    path = route_path(request)
    if request.method != "POST" or path not in GENERATION_PATHS:
        return await handler(request)
    metrics = request.app[STATE].request_metrics
    metrics.started(path)
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):
        metrics.failed(DROPPED)  # the client went away before the answer
        raise
    except Exception as e:
        metrics.failed(failure_label(answer_for(e).kind))
        raise
    outcome = request.get(OUTCOME)
    if outcome is None:
        metrics.succeeded()
    else:
        metrics.failed(outcome)
    return response


# the route span's name, as TGI names its handlers' spans
SPAN_NAMES = {"/": "compat_generate", "/generate": "generate", "/generate_stream": "generate_stream",
              "/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
              "/invocations": "invocations", "/vertex": "vertex_compatibility", "/tokenize": "tokenize",
              "/v1/responses": "create_response",
              "/v1/messages": "messages"}


@web.middleware
async def tracing_middleware(request: web.Request, handler):
    """A server span per generation request (only installed with tracing on), in the client's trace when
    it sent a ``traceparent`` header; what runs inside (validation, the scheduler's spans) joins it."""
    name = SPAN_NAMES.get(route_path(request)) if request.method == "POST" else None
    if name is None:
        return await handler(request)
    from opentelemetry.trace import SpanKind, Status, StatusCode

    with tracing.tracer().start_as_current_span(
            name, context=tracing.parent_context(request.headers.get("traceparent")), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": request.path}) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 400 or request.get(OUTCOME) is not None:
            span.set_status(Status(StatusCode.ERROR, request.get(OUTCOME)))
        return response


def mark_failed(request: web.Request, error: ApiError | None) -> None:
    """A stream's outcome after its 200: failed in-band with ``error``, or dropped (None)."""
    request[OUTCOME] = DROPPED if error is None else failure_label(error.kind)


def auth_middleware(api_key: str):
    # TGI compares the whole header case-insensitively; Anthropic's SDKs send the key alone, as x-api-key,
    # compared the same way so that one key works whichever header carries it
    expected = f"bearer {api_key}".lower().encode()
    expected_key = api_key.lower().encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if (request.method == "POST" and route_path(request) in AUTH_PATHS
                or request.path.startswith(AUTH_PREFIXES) and request.method != "OPTIONS"):
            given = request.headers.get("Authorization", "").lower().encode()
            given_key = request.headers.get("x-api-key", "").lower().encode()
            # both compared every time: how long the check takes says nothing about which one was sent
            key_ok = hmac.compare_digest(given_key, expected_key)
            if not (hmac.compare_digest(given, expected) | key_ok):
                if _anthropic(request):  # Anthropic's SDKs raise AuthenticationError from its envelope
                    error = ApiError(ErrorKind.UNAUTHORIZED)
                    return json_response(error.anthropic_body(), status=error.anthropic_status)
                return web.Response(status=401)
        return await handler(request)

    return check


def cors_middleware(allowed_origins: list[str]):
    """TGI's CORS layer: GET and POST from the ``--cors-allow-origin`` origins, or from any origin when
    none is given; preflight requests are answered here."""
    allowed = frozenset(allowed_origins)

    def allow_origin(origin: str) -> str | None:
        if not allowed:
            return "*"
        return origin if origin in allowed else None

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            response = web.Response(status=200)
            response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
        else:
            response = await handler(request)
        granted = allow_origin(origin)
        if granted is not None:
            response.headers["Access-Control-Allow-Origin"] = granted
        if allowed:
            response.headers.add("Vary", "Origin")
        return response

    return cors
