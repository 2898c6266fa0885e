"""The OpenAPI 3.1 description of every route, served at /api-doc/openapi.json, and Swagger UI at /docs.

Written for llmbus (not copied from TGI's docs/openapi.json), but it keeps TGI's schema names so clients
generated from either document look alike. 3.1 rather than 3.0 because its schemas are plain JSON Schema
2020-12: nullable fields are ``type: [..., "null"]`` and the component schemas can check sample bodies
with ``jsonschema`` directly.
"""

from __future__ import annotations

import json
from typing import Callable

from aiohttp import web

from llmbus.frontend import anthropic_schemas
from llmbus.frontend.openapi_responses import responses_schemas
from llmbus.frontend.openapi_schemas import array, openai_schemas, ref, tgi_schemas

SPEC_PATH = "/api-doc/openapi.json"
DOCS_PATH = "/docs"
# Swagger UI's own files, served from the swagger-ui-py package so /docs works on a machine with no
# internet (a CDN link is a blank page offline); only the two the page loads, never the whole folder.
DOCS_ASSETS_PATH = "/docs/assets"
DOCS_ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript"}

TGI_TAG, OPENAI_TAG, SAGEMAKER_TAG, INFO_TAG, DOCS_TAG = (
    "Text Generation Inference", "OpenAI compatible", "SageMaker", "Health and info", "Documentation")
ANTHROPIC_TAG = "Anthropic compatible"

_TIMING_HEADERS = {
    "x-compute-type": ("string", "What served the request (COMPUTE_TYPE; e.g. gpu+optimized)."),
    "x-compute-time": ("number", "Seconds from arrival to the last token."),
    "x-compute-characters": ("integer", "Characters in the prompt."),
    "x-total-time": ("integer", "Milliseconds in total."),
    "x-validation-time": ("integer", "Milliseconds spent validating and tokenizing."),
    "x-queue-time": ("integer", "Milliseconds waiting for the scheduler to admit the request."),
    "x-inference-time": ("integer", "Milliseconds from admission to the last token."),
    "x-time-per-token": ("integer", "Mean milliseconds per generated token."),
    "x-prompt-tokens": ("integer", "Prompt tokens."),
    "x-generated-tokens": ("integer", "Generated tokens."),
}
_STREAM_HEADERS = ("x-compute-type", "x-compute-characters")

# (status, description) of each error a TGI route can answer before its response starts
_TGI_ERRORS = {
    "ValidationError": ("422", "The body is not a valid request, or a parameter broke a rule "
                               "(error_type `validation`)."),
    "GenerationError": ("424", "The engine failed the request (error_type `generation`)."),
    "Overloaded": ("429", "--max-concurrent-requests are already in flight (error_type `overloaded`)."),
    "IncompleteGeneration": ("500", "The engine ended the request without a finish reason."),
    "PayloadTooLarge": ("413", "The body is larger than --payload-limit (error_type `payload_too_large`)."),
    "ShuttingDown": ("503", "The server got SIGTERM and finishes the requests in flight without taking "
                            "new ones (error_type `shutting_down`)."),
}
_ENGINE_ERRORS = ("GenerationError", "Overloaded", "IncompleteGeneration", "ShuttingDown")
# the Responses API's own (OpenAI's envelope): a feature refused outright, a stored response not found
_RESPONSES_ERRORS = {
    "Unsupported": ("400", "A built-in tool (web search, file search, code interpreter, MCP, ...), a tool_choice "
                           "naming one, an input item or content part this server cannot take, or a documented "
                           "field it does not serve, named (error_type `unsupported`)."),
    "NotFound": ("404", "No stored response has this id (`previous_response_id`, or the path's): it was never "
                        "stored, was deleted or dropped from the store, or another server process answered it "
                        "(error_type `not_found`)."),
}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _headers(names) -> dict:
    return {n: {"description": _TIMING_HEADERS[n][1], "schema": {"type": _TIMING_HEADERS[n][0]}}
            for n in names}


def _response(description: str, content: dict | None = None, headers: dict | None = None) -> dict:
    out: dict = {"description": description}
    if content:
        out["content"] = content
    if headers:
        out["headers"] = headers
    return out


def _components_responses() -> dict:
    out = {"Unauthorized": _response("--api-key is set and the `Authorization: Bearer` header is "
                                     "missing or wrong (empty body).")}
    for name, (_, description) in _TGI_ERRORS.items():
        out[name] = _response(description, _json(ref("ErrorResponse")))
        out["OpenAI" + name] = _response(description, _json(ref("OpenAIError")))
    for name, (_, description) in _RESPONSES_ERRORS.items():
        out["OpenAI" + name] = _response(description, _json(ref("OpenAIError")))
    # the TGI-enveloped routes that take a chat body (/chat_tokenize, /invocations) refuse what the chat route does
    out["Unsupported"] = _response("A documented field this server does not serve, named (error_type "
                                   "`unsupported`), e.g. a reasoning control that asks a model that does not "
                                   "reason to think.", _json(ref("ErrorResponse")))
    for status, description in anthropic_schemas.ERRORS.items():
        out[f"Anthropic{status}"] = _response(description, _json(ref("AnthropicError")))
    return out


def _anthropic_op(op_id: str, summary: str, ok: dict, body: str, statuses) -> dict:
    """An Anthropic route: either key header, and its errors in Anthropic's envelope."""
    op = _op(op_id, ANTHROPIC_TAG, summary, {
        "200": ok, **{s: {"$ref": f"#/components/responses/Anthropic{s}"} for s in statuses}}, body=ref(body))
    op["security"] = [{"bearer": []}, {"x_api_key": []}, {}]  # checked only with --api-key, as elsewhere
    return op


def _errors(*, openai: bool = False, secured: bool = True, engine: bool = True) -> dict:
    """The error responses of a POST route, in TGI's or OpenAI's body.

    ``engine``: the engine's errors (424, 429, 500) can come before the response starts; a stream
    reports them in-band instead, and the tokenize routes never reach the engine.
    """
    names = [n for n in _TGI_ERRORS if engine or n not in _ENGINE_ERRORS]
    family = "OpenAI" if openai else ""
    out = {_TGI_ERRORS[n][0]: {"$ref": f"#/components/responses/{family}{n}"} for n in names}
    if secured:
        out["401"] = {"$ref": "#/components/responses/Unauthorized"}
    return dict(sorted(out.items()))


def _sse(data: dict, *, done: bool = False) -> dict:
    """An SSE stream, schema'd one event at a time (as schemathesis and OpenAPI 3.2 read them): an event
    whose ``data`` is JSON matching ``data``, or with ``done`` (the OpenAI routes) the literal ``[DONE]``."""
    payload = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    if done:
        payload = {"anyOf": [{"const": "[DONE]"}, payload]}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": payload, "event": {"type": "string"}, "id": {"type": "string"}}}}}


_TGI_STREAM_TEXT = ("An SSE stream: one `data: <StreamResponse>` event per token, the last with "
                    "generated_text (and details when asked for); `:` comments keep an idle connection "
                    "open. Errors after the stream started arrive in-band as `data: <ErrorResponse>` with "
                    "HTTP 200. No [DONE] event.")


def _openai_ok(body: str, chunk: str) -> dict:
    return _response(f"A {body}; with `stream: true`, an SSE stream of `data: <{chunk}>` events ending "
                     "with `data: [DONE]` (an error after the stream started arrives in-band as "
                     "`data: <OpenAIError>`).",
                     {**_json(ref(body)), **_sse({"oneOf": [ref(chunk), ref("OpenAIError")]}, done=True)},
                     _headers(_TIMING_HEADERS))  # summed over the answer's choices; a stream: the first two


def _op(op_id: str, tag: str, summary: str, responses: dict, *, body: dict | None = None,
        secured: bool = False, description: str | None = None) -> dict:
    op: dict = {"tags": [tag], "summary": summary, "operationId": op_id}
    if description:
        op["description"] = description
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body)}
    if secured:
        # the key is checked only when the server runs with --api-key: either requirement holds
        op["security"] = [{"bearer": []}, {}]
    op["responses"] = responses
    return op


def _health_op(op_id: str, summary: str) -> dict:
    return _op(op_id, INFO_TAG, summary, {
        "200": _response("The engine is up (empty body)."),
        "503": _response("The engine is gone (`unhealthy`, error_type `healthcheck`), or the server is "
                         "draining after SIGTERM (error_type `shutting_down`).",
                         _json(ref("ErrorResponse")))})


def _paths() -> dict:
    stream_event = {"oneOf": [ref("StreamResponse"), ref("ErrorResponse")]}
    generate_ok = _response("The generation.", _json(ref("GenerateResponse")), _headers(_TIMING_HEADERS))
    return {
        "/": {
            "get": _health_op("root_health", "Health check (same as /health)"),
            "post": _op("compat_generate", TGI_TAG, "Generate, or stream when `stream` is true",
                        {"200": _response(
                            "A JSON array holding one GenerateResponse; with `stream: true`: "
                            + _TGI_STREAM_TEXT,
                            {**_json(array(ref("GenerateResponse"), minItems=1, maxItems=1)),
                             **_sse(stream_event)}, _headers(_TIMING_HEADERS)),
                         **_errors()},
                        body=ref("CompatGenerateRequest"), secured=True,
                        description="return_full_text defaults to the model's pipeline default (true for "
                                    "text-generation models) here, unlike /generate."),
        },
        "/generate": {"post": _op("generate", TGI_TAG, "Generate text", {"200": generate_ok, **_errors()},
                                  body=ref("GenerateRequest"), secured=True)},
        "/generate_stream": {"post": _op(
            "generate_stream", TGI_TAG, "Generate text as a stream of tokens",
            {"200": _response(_TGI_STREAM_TEXT, _sse(stream_event), _headers(_STREAM_HEADERS)),
             **_errors(engine=False)},
            body=ref("GenerateRequest"), secured=True,
            description="best_of > 1 and decoder_input_details are not supported when streaming.")},
        "/tokenize": {"post": _op("tokenize", TGI_TAG, "Tokenize a prompt",
                                  {"200": _response("The prompt's tokens with their character offsets (TGI's body), "
                                                    "or vLLM's or llama.cpp's answer to their bodies.",
                                                    _json({"anyOf": [ref("TokenizeResponse"),
                                                                     ref("OtherTokenizeResponse")]})),
                                   **_errors(engine=False)},
                                  body={"anyOf": [ref("GenerateRequest"), ref("OtherTokenizeRequest")]},
                                  secured=True)},
        "/detokenize": {"post": _op("detokenize", TGI_TAG, "Token ids to text (vLLM's and llama.cpp's route)",
                                    {"200": _response("The ids' text, special tokens kept.",
                                                      _json(ref("DetokenizeResponse"))),
                                     **_errors(engine=False)}, body=ref("DetokenizeRequest"), secured=True)},
        "/chat_tokenize": {"post": _op("chat_tokenize", TGI_TAG, "Apply the chat template and tokenize",
                                       {"200": _response("The templated prompt and its tokens.",
                                                         _json(ref("ChatTokenizeResponse"))),
                                        "400": {"$ref": "#/components/responses/Unsupported"},
                                        **_errors(secured=False, engine=False)}, body=ref("ChatRequest"))},
        "/invocations": {"post": _op(
            "sagemaker_invocations", SAGEMAKER_TAG, "SageMaker entry point",
            {"200": _response("The answer of the route the body's shape selects (POST /, "
                              "/v1/chat/completions or /v1/completions), JSON or SSE as that route would.",
                              {**_json({"anyOf": [array(ref("GenerateResponse")), ref("ChatCompletion"),
                                                  ref("Completion")]}),
                               **_sse({"anyOf": [ref(n) for n in (
                                   "StreamResponse", "ChatCompletionChunk", "CompletionChunk",
                                   "ErrorResponse", "OpenAIError")]}, done=True)}),
             "400": {"$ref": "#/components/responses/Unsupported"}, **_errors()},
            body={"anyOf": [ref("CompatGenerateRequest"), ref("ChatRequest"), ref("CompletionRequest")]},
            secured=True, description="The body is a CompatGenerateRequest (has `inputs`), a ChatRequest "
                                      "(has `messages`) or a CompletionRequest (has `prompt`). HTTP errors "
                                      "are TGI's ErrorResponse; in-band stream errors take the shape of "
                                      "the selected route.")},
        "/vertex": {"post": _op(
            "vertex_compatibility", TGI_TAG, "Google Vertex AI predictions",
            {"200": _response("One generated text per instance.", _json(ref("VertexResponse"))),
             "400": {"$ref": "#/components/responses/Unsupported"}, **_errors()},
            body=ref("VertexRequest"), secured=True,
            description="A generate instance samples unless its parameters set `do_sample`; a chat instance's "
                        "text is the chat route's answer. Also served at AIP_PREDICT_ROUTE when set.")},
        "/v1/chat/completions": {"post": _op(
            "chat_completions", OPENAI_TAG, "OpenAI chat completions",
            {"200": _openai_ok("ChatCompletion", "ChatCompletionChunk"),
             # documented fields that are not served (reasoning_effort, audio, ...): refused by name
             "400": {"$ref": "#/components/responses/OpenAIUnsupported"}, **_errors(openai=True)},
            body=ref("ChatRequest"), secured=True)},
        "/v1/completions": {"post": _op(
            "completions", OPENAI_TAG, "OpenAI (legacy) completions",
            {"200": _openai_ok("Completion", "CompletionChunk"),
             **_errors(openai=True)},
            body=ref("CompletionRequest"), secured=True)},
        "/v1/messages": {"post": _anthropic_op(
            "anthropic_messages", "Anthropic Messages", _response(
                "An AnthropicMessage; with `stream: true`, Anthropic's SSE events (`event: <type>` and `data: "
                "<AnthropicStreamEvent>`): message_start, ping, content_block_start / _delta / _stop per "
                "block, message_delta, message_stop; an error after the stream started arrives as `event: "
                "error`.", {**_json(ref("AnthropicMessage")), **_sse(ref("AnthropicStreamEvent"))}),
            "AnthropicMessagesRequest", anthropic_schemas.ERRORS)},
        "/v1/messages/count_tokens": {"post": _anthropic_op(
            "anthropic_count_tokens", "Anthropic token count", _response(
                "The tokens /v1/messages would feed the model for this prompt.",
                _json(ref("AnthropicTokenCount"))),
            "AnthropicCountTokensRequest", ("400", "401", "413"))},
        **_responses_paths(),
        "/v1/models": {"get": _op("list_models", OPENAI_TAG, "The served model",
                                  {"200": _response("A list holding the one served model.",
                                                    _json(ref("ModelList")))})},
        "/v1/models/{model}": {"get": {**_op(
            "retrieve_model", OPENAI_TAG, "One served model or LoRA adapter",
            {"200": _response("Its card, as /v1/models lists it.", _json(ref("Model"))),
             "404": _response("No served model or adapter has this id.", _json(ref("OpenAIError")))},
            description="An id with slashes (`org/name`) is taken whole."),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/info": {"get": _op("info", INFO_TAG, "Model and server limits",
                             {"200": _response("Server info.", _json(ref("Info")))})},
        "/health": {"get": _health_op("health", "Health check")},
        "/ping": {"get": _health_op("ping", "Health check (SageMaker's name)")},
        "/metrics": {"get": _op("metrics", INFO_TAG, "Prometheus metrics", {"200": _response(
            "Prometheus text exposition format.", {"text/plain": {"schema": {"type": "string"}}})})},
        SPEC_PATH: {"get": _op("openapi_spec", DOCS_TAG, "This OpenAPI document", {"200": _response(
            "The OpenAPI 3.1 document.", _json({"type": "object"}))})},
        DOCS_PATH: {"get": _op("swagger_ui", DOCS_TAG, "Swagger UI for this document", {"200": _response(
            "An HTML page.", {"text/html": {"schema": {"type": "string"}}})})},
        DOCS_ASSETS_PATH + "/{name}": {"get": {
            **_op("swagger_ui_asset", DOCS_TAG, "Swagger UI's stylesheet and script, served locally",
                  {"200": _response("The file.", {m: {"schema": {"type": "string"}}
                                                  for m in sorted(set(DOCS_ASSETS.values()))}),
                   "404": _response("Not one of Swagger UI's files.")}),
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string", "enum": sorted(DOCS_ASSETS)}}]}},
    }


def _responses_paths() -> dict:
    """OpenAI's Responses API: create (JSON, or its SSE events), and read or delete a stored response."""
    refs = {status: {"$ref": f"#/components/responses/OpenAI{name}"} for name, (status, _) in _RESPONSES_ERRORS.items()}
    stored = {"parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]}
    auth = {"401": {"$ref": "#/components/responses/Unauthorized"}, "404": refs["404"]}
    return {
        "/v1/responses": {"post": _op(
            "create_response", OPENAI_TAG, "OpenAI Responses", {"200": _response(
                "A ResponseObject; with `stream: true`, OpenAI's Responses SSE events (`event: <type>` and "
                "`data: <ResponseStreamEvent>`, no [DONE]): response.created, response.in_progress, per output "
                "item output_item.added, its content part or function call arguments events, output_item.done, "
                "then response.completed (or response.incomplete); an error after the stream started arrives "
                "as `event: error`.", {**_json(ref("ResponseObject")), **_sse(ref("ResponseStreamEvent"))}),
                **dict(sorted({**_errors(openai=True), **refs}.items()))},
            body=ref("ResponsesRequest"), secured=True)},
        "/v1/responses/{response_id}": {
            "get": {**_op("get_response", OPENAI_TAG, "A stored response", {
                "200": _response("The response as it was answered.", _json(ref("ResponseObject"))), **auth},
                secured=True), **stored},
            "delete": {**_op("delete_response", OPENAI_TAG, "Delete a stored response", {
                "200": _response("It is gone.", _json(ref("ResponseDeleted"))), **auth}, secured=True),
                **stored}},
    }


def build_spec(version: str, model_id: str) -> dict:
    """The OpenAPI 3.1 document for a server of ``version`` serving ``model_id``."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmbus", "version": version,
                 "description": f"Text generation for `{model_id}`, compatible with Hugging Face "
                                "text-generation-inference's HTTP API and OpenAI's chat and completions "
                                "routes.",
                 "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}},
        "tags": [{"name": t} for t in (TGI_TAG, OPENAI_TAG, ANTHROPIC_TAG, SAGEMAKER_TAG, INFO_TAG, DOCS_TAG)],
        "paths": _paths(),
        "components": {
            "schemas": {**tgi_schemas(), **openai_schemas(model_id), **responses_schemas(),
                        **anthropic_schemas.anthropic_schemas(model_id)},
            "responses": _components_responses(),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "Checked only when the server runs with --api-key; the key is compared "
                               "case-insensitively."},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                              "description": "The same key as Anthropic's SDKs send it."}},
        },
    }


# ------------------------------------------------------------------------------------------------
# Routes
# ------------------------------------------------------------------------------------------------

def swagger_ui_static_dir():
    from importlib import resources

    return resources.files("swagger_ui") / "static"


def swagger_ui_html(spec_url: str = SPEC_PATH, title: str = "llmbus - Swagger UI") -> str:
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{DOCS_ASSETS_PATH}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{DOCS_ASSETS_PATH}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: {json.dumps(spec_url)},
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  layout: "BaseLayout",
}});
</script>
</body>
</html>
"""


def add_openapi_routes(app: web.Application, version: str, model_id_getter: Callable[[], str]) -> None:
    """GET /api-doc/openapi.json and GET /docs. The model id is read on the first request, so the
    routes can be added before whatever knows it is set up."""
    cache: dict[str, bytes] = {}

    async def spec(request: web.Request) -> web.Response:
        if "spec" not in cache:
            cache["spec"] = json.dumps(build_spec(version, model_id_getter()), ensure_ascii=False).encode()
        return web.Response(body=cache["spec"], content_type="application/json")

    page = swagger_ui_html()

    async def docs(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    static = swagger_ui_static_dir()

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in DOCS_ASSETS:
            raise web.HTTPNotFound()
        return web.Response(body=(static / name).read_bytes(), content_type=DOCS_ASSETS[name],
                            headers={"Cache-Control": "public, max-age=86400"})

    app.router.add_get(SPEC_PATH, spec)
    app.router.add_get(DOCS_PATH, docs)
    app.router.add_get(DOCS_ASSETS_PATH + "/{name}", asset)
