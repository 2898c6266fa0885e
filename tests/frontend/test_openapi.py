"""The OpenAPI document: valid OpenAPI, every route documented, samples match the schemas, /docs serves."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import jsonschema
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate

from llmbus.frontend.middleware import auth_middleware, cors_middleware
from llmbus.frontend.openapi import DOCS_ASSETS_PATH, DOCS_PATH, SPEC_PATH, add_openapi_routes, build_spec

MODEL_ID = "demo/tiny"

DOCUMENTED_ROUTES = [
    ("POST", "/"), ("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/tokenize"),
    ("POST", "/chat_tokenize"), ("POST", "/detokenize"), ("POST", "/invocations"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/info"), ("GET", "/health"),
    ("GET", "/ping"), ("GET", "/"), ("GET", "/metrics"), ("GET", SPEC_PATH), ("GET", DOCS_PATH),
]
SECURED = {("POST", p) for p in ("/", "/generate", "/generate_stream", "/tokenize", "/detokenize", "/invocations",
                                  "/v1/chat/completions", "/v1/completions")}


@pytest.fixture(scope="module")
def spec() -> dict:
    return build_spec("1.2.3", MODEL_ID)


def _operations(spec: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in spec["paths"].items() for method in item}


def test_spec_is_valid_openapi(spec):
    validate(spec)
    assert spec["info"]["version"] == "1.2.3"
    assert MODEL_ID in spec["info"]["description"]


@pytest.mark.parametrize("method,path", DOCUMENTED_ROUTES)
def test_route_is_documented(spec, method, path):
    op = spec["paths"][path][method.lower()]
    assert op["responses"]
    assert (op.get("security") == [{"bearer": []}, {}]) == ((method, path) in SECURED)


def test_streaming_routes_document_event_streams(spec):
    for path in ("/", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/invocations"):
        assert "text/event-stream" in spec["paths"][path]["post"]["responses"]["200"]["content"], path


def test_error_shapes_per_family(spec):
    def error_schema(path: str, status: str) -> str:
        ref = spec["paths"][path]["post"]["responses"][status]["$ref"].rsplit("/", 1)[1]
        return spec["components"]["responses"][ref]["content"]["application/json"]["schema"]["$ref"]

    assert error_schema("/generate", "422").endswith("/ErrorResponse")
    assert error_schema("/v1/chat/completions", "422").endswith("/OpenAIError")
    assert error_schema("/v1/completions", "429").endswith("/OpenAIError")


def test_generate_headers_documented(spec):
    headers = spec["paths"]["/generate"]["post"]["responses"]["200"]["headers"]
    assert set(headers) == {"x-compute-time", "x-compute-type", "x-compute-characters", "x-total-time",
                            "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token",
                            "x-prompt-tokens", "x-generated-tokens"}


def test_generate_parameters_match_the_dataclass(spec):
    from llmbus.frontend.validation import GenerateParameters

    documented = set(spec["components"]["schemas"]["GenerateParameters"]["properties"])
    assert documented == {f.name for f in dataclasses.fields(GenerateParameters) if f.metadata.get("body", True)}


def test_number_bounds_are_what_the_server_reads():
    """The f32 bounds in the document are the edges of what validation reads as a positive f32 below the
    overflow (and below 1 for top_p): 5e-324 passed `exclusiveMinimum: 0` but reads as 0 and was refused."""
    from llmbus.frontend.openapi_schemas import F32_BELOW_ONE, F32_MAX, F32_TINY
    from llmbus.frontend.validation import to_f32

    assert to_f32(F32_TINY) > 0 and to_f32(F32_TINY / 2) == 0 and to_f32(5e-324) == 0
    assert to_f32(F32_BELOW_ONE) == F32_BELOW_ONE < 1 and to_f32(1 - 2**-25 + 2**-40) == 1
    assert to_f32(F32_MAX) == F32_MAX and to_f32(F32_MAX * (1 + 2**-23)) is None


def test_every_served_route_is_documented(tiny_model_dir, spec):
    """The app and the document agree both ways: a route served but not described fails, and so does a
    described route the app does not serve."""
    from llmbus.frontend.app import make_app
    from llmbus.frontend.config import FrontendConfig
    from llmbus.frontend.tokenizer import load_tokenizer

    config = FrontendConfig(model_dir=str(tiny_model_dir), requests_endpoint="ipc:///tmp/x",
                            events_endpoint="ipc:///tmp/y")
    app = make_app(config, tokenizer=load_tokenizer(tiny_model_dir))
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = _operations(spec)
    assert served - documented == set(), "served but not in the OpenAPI document"
    assert documented - served == set(), "in the OpenAPI document but not served"


# --- sample bodies against the component schemas ----------------------------------------------------


def _check(spec: dict, name: str, body) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


TOKEN = {"id": 363, "text": " for", "logprob": -1.53, "special": False}

VALID_SAMPLES = {
    "GenerateResponse": {"generated_text": " test", "details": {
        "finish_reason": "length", "generated_tokens": 1, "seed": None,
        "prefill": [{"id": 1, "text": "<s>", "logprob": None}], "tokens": [TOKEN],
        "top_tokens": [[TOKEN]],
        "best_of_sequences": [{"generated_text": " x", "finish_reason": "eos_token", "generated_tokens": 1,
                               "seed": 7, "prefill": [], "tokens": [TOKEN]}]}},
    "StreamResponse": {"index": 1, "token": TOKEN, "generated_text": " for",
                       "details": {"finish_reason": "stop_sequence", "generated_tokens": 1, "seed": None,
                                   "input_length": 3}},
    "GenerateRequest": {"inputs": "Hi", "parameters": {"top_p": 0.9, "stop": ["\n"], "seed": 2**64 - 1,
                                                        "grammar": None, "ignore_eos_token": True}},
    "ChatCompletion": {"object": "chat.completion", "id": "", "created": 1741372335, "model": MODEL_ID,
                       "system_fingerprint": "0.1.0-native",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                    "logprobs": {"content": [{"token": "Hello", "logprob": -0.1,
                                                              "top_logprobs": [{"token": "Hi",
                                                                                "logprob": -2.3}]}]},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
    "ChatCompletionChunk": {"object": "chat.completion.chunk", "id": "", "created": 1, "model": MODEL_ID,
                            "system_fingerprint": "x", "choices": [{"index": 0, "delta": {
                                "role": "assistant", "content": "OK"}, "logprobs": None,
                                "finish_reason": None}], "usage": None},
    "Completion": {"object": "text_completion", "id": "", "created": 1, "model": MODEL_ID,
                   "choices": [{"index": 0, "text": " there", "logprobs": None, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
    "ChatRequest": {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "stop": "\n", "top_p": 1,
                    "stream": True, "stream_options": {"include_usage": True}},
    "CompletionRequest": {"prompt": ["a", "b"], "logprobs": 2, "echo": True, "stop": ["x"]},
    "ErrorResponse": {"error": "Input validation error: `top_p` must be > 0.0 and < 1.0",
                      "error_type": "validation"},
    "CompletionChunk": {"object": "text_completion", "id": "cmpl-1", "created": 1, "model": MODEL_ID,
                        "choices": [{"index": 1, "text": "a", "logprobs": None, "finish_reason": None}]},
    "OpenAIError": {"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p",
                              "code": "validation"}, "error_type": "validation"},
}

INVALID_SAMPLES = [
    ("GenerateRequest", {"inputs": "Hi", "parameters": {"top_p": 1.0}}),
    ("GenerateRequest", {"parameters": {}}),
    ("GenerateResponse", {"generated_text": "x", "details": {"finish_reason": "done"}}),
    ("ChatRequest", {"messages": []}),
    ("OpenAIError", {"error": "flat", "error_type": "validation"}),
]


@pytest.mark.parametrize("name", sorted(VALID_SAMPLES))
def test_sample_matches_schema(spec, name):
    _check(spec, name, VALID_SAMPLES[name])


@pytest.mark.parametrize("name,body", INVALID_SAMPLES)
def test_bad_sample_is_rejected(spec, name, body):
    with pytest.raises(jsonschema.ValidationError):
        _check(spec, name, body)


# --- the routes -------------------------------------------------------------------------------------


def test_docs_and_spec_routes():
    async def main():
        app = web.Application()
        add_openapi_routes(app, "1.2.3", lambda: MODEL_ID)
        async with TestClient(TestServer(app)) as client:
            docs = await client.get(DOCS_PATH)
            html = await docs.text()
            served = await client.get(SPEC_PATH)
            # every file the page loads comes from this server (offline machines have no CDN)
            links = re.findall(r'(?:src|href)="([^"]+)"', html)
            assets = {}
            for link in links:
                resp = await client.get(link)
                assets[link] = (resp.status, resp.content_type, len(await resp.read()))
            missing = (await client.get(DOCS_ASSETS_PATH + "/swagger-editor-bundle.js")).status
            return docs.status, docs.content_type, html, served.status, await served.json(), assets, missing

    status, content_type, html, spec_status, served, assets, missing = asyncio.run(main())
    assert (status, content_type) == (200, "text/html")
    assert SPEC_PATH in html and "http://" not in html and "https://" not in html
    assert set(assets) == {f"{DOCS_ASSETS_PATH}/swagger-ui.css", f"{DOCS_ASSETS_PATH}/swagger-ui-bundle.js"}
    assert assets[f"{DOCS_ASSETS_PATH}/swagger-ui-bundle.js"][:2] == (200, "text/javascript")
    assert assets[f"{DOCS_ASSETS_PATH}/swagger-ui.css"][:2] == (200, "text/css")
    assert all(size > 10_000 for _, _, size in assets.values())
    assert missing == 404  # only the page's two files, not the package's whole folder
    assert spec_status == 200
    assert served == build_spec("1.2.3", MODEL_ID)


def test_docs_stay_public_with_api_key_and_cors():
    """--api-key and --cors-allow-origin leave the page, its files and the document open (as TGI does);
    the files carry a cache header."""
    async def main():
        app = web.Application(middlewares=[cors_middleware(["http://allowed.example"]),
                                           auth_middleware("Secret")])
        add_openapi_routes(app, "1.2.3", lambda: MODEL_ID)
        async with TestClient(TestServer(app)) as client:
            out = {}
            for path in (DOCS_PATH, SPEC_PATH, f"{DOCS_ASSETS_PATH}/swagger-ui-bundle.js",
                         f"{DOCS_ASSETS_PATH}/swagger-ui.css"):
                resp = await client.get(path, headers={"Origin": "http://elsewhere.example"})
                await resp.read()
                out[path] = (resp.status, resp.headers.get("Cache-Control"))
            return out

    out = asyncio.run(main())
    assert {path: status for path, (status, _) in out.items()} == dict.fromkeys(out, 200)
    assert out[f"{DOCS_ASSETS_PATH}/swagger-ui-bundle.js"][1] == "public, max-age=86400"
    assert out[f"{DOCS_ASSETS_PATH}/swagger-ui.css"][1] == "public, max-age=86400"
