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

SPEC_PATH = "/api-doc/openapi.json"
DOCS_PATH = "/docs"
# pinned: an unpinned CDN URL would change the page under us
SWAGGER_UI_VERSION = "5.17.14"

TGI_TAG, OPENAI_TAG, SAGEMAKER_TAG, INFO_TAG, DOCS_TAG = (
    "Text Generation Inference", "OpenAI compatible", "SageMaker", "Health and info", "Documentation")

# ------------------------------------------------------------------------------------------------
# Schema building blocks
# ------------------------------------------------------------------------------------------------


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _t(type_: str, description: str | None = None, *, nullable: bool = False, **extra) -> dict:
    schema: dict = {"type": [type_, "null"] if nullable else type_}
    if description:
        schema["description"] = description
    schema.update(extra)
    return schema


def _maybe(schema: dict, description: str | None = None) -> dict:
    """``schema`` or null: a referenced schema cannot carry a null type itself."""
    out: dict = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def _array(items: dict, description: str | None = None, **extra) -> dict:
    return _t("array", description, items=items, **extra)


def _obj(properties: dict, required: tuple[str, ...] = (), description: str | None = None,
         **extra) -> dict:
    schema: dict = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    schema.update(extra)
    return schema


def _string_or_list(description: str, *, nullable: bool = False, **list_extra) -> dict:
    options = [{"type": "string"}, _array({"type": "string"}, **list_extra)]
    return {"description": description, "anyOf": (options + [{"type": "null"}]) if nullable else options}


# ------------------------------------------------------------------------------------------------
# Component schemas
# ------------------------------------------------------------------------------------------------

_FINISH_REASON = {"type": "string", "enum": ["length", "eos_token", "stop_sequence"],
                  "description": "Why generation stopped: the token budget ran out, the model emitted an "
                                 "end-of-sequence token, or the text ended with a stop sequence."}


def _grammar_schema() -> dict:
    def variant(kind: str, value: dict, description: str) -> dict:
        return _obj({"type": {"type": "string", "const": kind}, "value": value}, ("type", "value"),
                    description)

    json_value = {"description": "A JSON Schema, as an object or as a JSON string.",
                  "anyOf": [{"type": "object"}, {"type": "string"}]}
    return {
        "description": "Constrained decoding. llmbus accepts the shape but has no constrained decoding "
                       "yet, so any grammar is answered with 422 `grammar is not supported` (TGI with "
                       "--disable-grammar-support does the same).",
        "oneOf": [
            variant("json", json_value, "Output must match a JSON Schema."),
            variant("json_object", json_value, "Alias of `json`."),
            variant("regex", {"type": "string"}, "Output must match a regular expression."),
            variant("json_schema", _obj({"name": _t("string", nullable=True), "schema": {"type": "object"}},
                                        ("schema",)), "OpenAI-style named JSON Schema."),
        ],
    }


def _generate_parameters() -> dict:
    f32 = "number"
    return _obj({
        "best_of": _t("integer", "Run this many sampled generations and return the one with the highest "
                      "mean token logprob (the others go to `details.best_of_sequences`). Needs sampling, "
                      "no `seed`, and no streaming; at most --max-best-of.", nullable=True, minimum=1),
        "temperature": _t(f32, "Divide the logits by this before sampling; below 1 sharpens, above 1 "
                          "flattens. Setting it turns sampling on.", nullable=True, exclusiveMinimum=0),
        "repetition_penalty": _t(f32, "Penalty for tokens already in the prompt or output (1.0 = none; "
                                 "above 1 discourages repeats).", nullable=True, exclusiveMinimum=0),
        "frequency_penalty": _t(f32, "TGI's frequency penalty: the logit loses penalty x (occurrences in "
                                "prompt and output / their length); 0 = none.", nullable=True, minimum=-2,
                                maximum=2),
        "presence_penalty": _t(f32, "llmbus extension (OpenAI's): subtracted from the logit of every token "
                               "already generated; 0 = none.", nullable=True, minimum=-2, maximum=2),
        "top_k": _t("integer", "Sample only among the k most likely tokens.", nullable=True, minimum=1),
        "top_p": _t(f32, "Nucleus sampling: keep the smallest set of tokens whose probabilities add up to "
                    "top_p. 1.0 itself is rejected, as in TGI.", nullable=True,
                    exclusiveMinimum=0, exclusiveMaximum=1),
        "typical_p": _t(f32, "Locally typical sampling mass (same bounds as top_p).", nullable=True,
                        exclusiveMinimum=0, exclusiveMaximum=1),
        "do_sample": _t("boolean", "Sample instead of greedy decoding. Defaults to false when `parameters` "
                        "is given, but to true when the body has no `parameters` at all (TGI's quirk).",
                        default=False),
        "max_new_tokens": _t("integer", "Most tokens to generate. Unset: up to --max-total-tokens minus the "
                             "prompt.", nullable=True, minimum=1),
        "return_full_text": _t("boolean", "Prepend the prompt to `generated_text`. Unset: false on "
                               "/generate, the model's pipeline default on POST /.", nullable=True),
        "stop": _array({"type": "string"}, "Stop when the output ends with any of these; the stop text "
                       "stays in the output. At most --max-stop-sequences (default 4).", default=[]),
        "truncate": _t("integer", "Keep only the last `truncate` prompt tokens (at most "
                       "--max-input-tokens).", nullable=True, minimum=1),
        "watermark": _t("boolean", "Bias sampling with a Kirchenbauer et al. watermark.", default=False),
        "details": _t("boolean", "Return `details`: finish reason, token ids, logprobs and seed.",
                      default=False),
        "decoder_input_details": _t("boolean", "Also return the prompt tokens in `details.prefill` (their "
                                    "logprobs only with --enable-prefill-logprobs). Not with streaming.",
                                    default=False),
        "seed": _t("integer", "Random seed for sampling (unsigned 64-bit); random when unset.",
                   nullable=True, minimum=0, maximum=2**64 - 1),
        "top_n_tokens": _t("integer", "Also return the n most likely alternatives at each step (at most "
                           "--max-top-n-tokens, default 5).", nullable=True, minimum=0),
        "grammar": _maybe(_ref("GrammarType")),
        "adapter_id": _t("string", "LoRA adapter to use (accepted; llmbus serves the base model).",
                         nullable=True),
        "ignore_eos_token": _t("boolean", "llmbus extension: do not stop at end-of-sequence tokens, so "
                               "every request generates exactly max_new_tokens (fixed-length benchmarks).",
                               default=False),
    }, description="Generation settings. Unknown keys are ignored.")


def _token(*, special: bool = True) -> dict:
    props = {"id": _t("integer", "Token id.", minimum=0), "text": _t("string", "Decoded text."),
             "logprob": _t("number", "Log probability; null where unknown.", nullable=True)}
    if special:
        props["special"] = _t("boolean", "A special token (its text is not part of generated_text).")
    return _obj(props, tuple(props))


def _sequence_props() -> dict:
    tokens = _array(_ref("Token"), "The generated tokens.")
    return {
        "finish_reason": _ref("FinishReason"),
        "generated_tokens": _t("integer", "Number of generated tokens.", minimum=0),
        "seed": _t("integer", "Seed used for sampling; null for greedy decoding.", nullable=True, minimum=0),
        "prefill": _array(_ref("PrefillToken"), "Prompt tokens (empty unless decoder_input_details)."),
        "tokens": tokens,
        "top_tokens": _array(_array(_ref("Token")), "Per step, the top_n_tokens alternatives; left out "
                             "when top_n_tokens was not asked for."),
    }


_SEQUENCE_REQUIRED = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens")


def _tgi_schemas() -> dict:
    seq = _sequence_props()
    text = _t("string", "The generated text (with the prompt in front when return_full_text).")
    return {
        "ErrorResponse": _obj({"error": _t("string", "Human-readable message."),
                               "error_type": _t("string", "validation, overloaded, generation, "
                                                "incomplete_generation, healthcheck, ...")},
                              ("error", "error_type"), "TGI's error body."),
        "FinishReason": _FINISH_REASON,
        "GrammarType": _grammar_schema(),
        "GenerateParameters": _generate_parameters(),
        "GenerateRequest": _obj({"inputs": _t("string", "The prompt.", minLength=1),
                                 "parameters": _ref("GenerateParameters")}, ("inputs",),
                                example={"inputs": "My name is Olivier and I",
                                         "parameters": {"max_new_tokens": 20, "details": True}}),
        "CompatGenerateRequest": _obj({"inputs": _t("string", "The prompt.", minLength=1),
                                       "parameters": _ref("GenerateParameters"),
                                       "stream": _t("boolean", "Answer with an SSE stream.", default=False)},
                                      ("inputs",)),
        "Token": _token(),
        "PrefillToken": _token(special=False),
        "BestOfSequence": _obj({"generated_text": text, **seq}, ("generated_text", *_SEQUENCE_REQUIRED)),
        "Details": _obj({**seq, "best_of_sequences": _array(_ref("BestOfSequence"), "The sequences best_of "
                                                             "did not pick; left out without best_of.")},
                        _SEQUENCE_REQUIRED),
        "GenerateResponse": _obj({"generated_text": text, "details": _ref("Details")}, ("generated_text",),
                                 "`details` only when details or decoder_input_details was asked for."),
        "StreamDetails": _obj({"finish_reason": _ref("FinishReason"),
                               "generated_tokens": _t("integer", minimum=0),
                               "seed": _t("integer", nullable=True, minimum=0),
                               "input_length": _t("integer", "Prompt tokens.", minimum=0)},
                              ("finish_reason", "generated_tokens", "seed", "input_length")),
        "StreamResponse": _obj({
            "index": _t("integer", "1-based position of this token.", minimum=1),
            "token": _ref("Token"),
            "top_tokens": _array(_ref("Token"), "Alternatives; left out unless top_n_tokens."),
            "generated_text": _t("string", "The whole text, on the last event only.", nullable=True),
            "details": _maybe(_ref("StreamDetails"), "On the last event, when details was asked for."),
        }, ("index", "token", "generated_text", "details"), "One SSE event per generated token."),
        "SimpleToken": _obj({"id": _t("integer", minimum=0), "text": _t("string", "The prompt slice."),
                             "start": _t("integer", "Character offset where the token starts.", minimum=0),
                             "stop": _t("integer", "Character offset where it ends.", minimum=0)},
                            ("id", "text", "start", "stop")),
        "TokenizeResponse": _array(_ref("SimpleToken")),
        "ChatTokenizeResponse": _obj({"tokenize_response": _ref("TokenizeResponse"),
                                      "templated_text": _t("string", "The prompt the chat template made.")},
                                     ("tokenize_response", "templated_text")),
        "Info": _obj({
            "model_id": _t("string"), "model_sha": _t("string", nullable=True),
            "model_pipeline_tag": _t("string", nullable=True),
            **{k: _t("integer", minimum=0) for k in (
                "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_input_tokens",
                "max_total_tokens", "validation_workers", "max_client_batch_size")},
            "router": _t("string"), "version": _t("string"), "sha": _t("string", nullable=True),
            "docker_label": _t("string", nullable=True),
        }, ("model_id", "max_concurrent_requests", "max_input_tokens", "max_total_tokens", "router",
            "version"), "The served model and the server's limits."),
    }


def _openai_common(model_id: str) -> dict:
    """Fields /v1/chat/completions and /v1/completions share."""
    return {
        "model": _t("string", f"Model name; echoed back. This server serves `{model_id}`.", nullable=True,
                    example=model_id),
        "max_tokens": _t("integer", "Most tokens to generate.", nullable=True, minimum=1),
        "temperature": _t("number", "Sampling temperature; 0 means greedy decoding.", nullable=True,
                          minimum=0, maximum=2),
        "top_p": _t("number", "Nucleus sampling mass; unlike TGI's native routes, 1 is accepted and means "
                    "no cut.", nullable=True, exclusiveMinimum=0, maximum=1),
        "top_k": _t("integer", "Sample among the k most likely tokens (vLLM's extension; 0 or less means "
                    "off).", nullable=True),
        "repetition_penalty": _t("number", "TGI's repetition penalty (1.0 = none).", nullable=True,
                                 exclusiveMinimum=0),
        "stop": _string_or_list("Stop sequences (a string or a list); a matched one is cut from the text.",
                                nullable=True),
        "seed": _t("integer", "Random seed for sampling (OpenAI's signed 64-bit seed; taken modulo 2^64).",
                   nullable=True),
        "n": _t("integer", "Choices to generate per prompt (at most --max-client-batch-size).",
                nullable=True, minimum=1, default=1),
        "frequency_penalty": _t("number", "Penalise tokens by how often they already occurred.",
                                nullable=True, minimum=-2, maximum=2),
        "presence_penalty": _t("number", "Subtracted from the logit of every token already generated.",
                               nullable=True, minimum=-2, maximum=2),
        "stream": _t("boolean", "Answer with an SSE stream ending with `data: [DONE]`.", default=False),
        "stream_options": _maybe(_ref("StreamOptions")),
        "ignore_eos": _t("boolean", "llmbus extension: keep generating past end-of-sequence tokens until "
                         "max_tokens.", default=False),
    }


def _openai_envelope(object_: str, choice: dict, *, usage_nullable: bool) -> dict:
    usage = _maybe(_ref("Usage")) if usage_nullable else _ref("Usage")
    return _obj({"id": _t("string"), "object": _t("string", const=object_),
                 "created": _t("integer", "Unix time in seconds."), "model": _t("string"),
                 "system_fingerprint": _t("string"), "choices": _array(choice), "usage": usage},
                ("id", "object", "created", "model", "choices"))


def _openai_schemas(model_id: str) -> dict:
    role = _t("string", "system, user, assistant or tool.")
    # the models served are text-only: image parts are refused with 422
    content_part = _obj({"type": _t("string", const="text"), "text": _t("string")}, ("type", "text"))
    finish = _t("string", "`stop` (end-of-sequence token or stop sequence) or `length`; null until the "
                "choice ends.", nullable=True)
    choice_logprobs = _maybe(_ref("ChatLogprobs"))
    top = _obj({"token": _t("string"), "logprob": _t("number")}, ("token", "logprob"))
    text_choice = {"index": _t("integer", minimum=0), "text": _t("string"),
                   "logprobs": _maybe(_ref("CompletionLogprobs")), "finish_reason": finish}
    return {
        "OpenAIError": _obj({"error": _obj({
            "message": _t("string"), "type": _t("string", "The error kind, e.g. invalid_request_error."),
            "param": _t("string", "The request field at fault, if any.", nullable=True),
            "code": _t("string", "TGI's error_type.", nullable=True)}, ("message", "type", "param", "code")),
            "error_type": _t("string", "TGI's error_type again, for TGI clients.")},
            ("error",), "OpenAI's error body."),
        "StreamOptions": _obj({"include_usage": _t("boolean", "Send one last chunk with `usage` and no "
                                                   "choices before [DONE].", default=False)}),
        "Message": _obj({"role": role,
                         "content": {"anyOf": [{"type": "string"}, _array(content_part), {"type": "null"}]},
                         "name": _t("string", nullable=True)}, ("role",)),
        "ChatRequest": _obj({
            **_openai_common(model_id),
            "messages": _array(_ref("Message"), "The conversation; rendered with the model's chat "
                               "template.", minItems=1),
            "max_completion_tokens": _t("integer", "Alias of max_tokens.", nullable=True, minimum=1),
            "logprobs": _t("boolean", "Return the logprob of each output token.", nullable=True),
            "top_logprobs": _t("integer", "Also the n most likely alternatives per token (at most "
                               "--max-top-n-tokens); needs logprobs true.", nullable=True, minimum=0),
        }, ("messages",), example={"model": model_id, "max_tokens": 20,
                                   "messages": [{"role": "user", "content": "What is deep learning?"}]}),
        "CompletionRequest": _obj({
            **_openai_common(model_id),
            "prompt": _string_or_list("One prompt or a non-empty list (at most --max-client-batch-size).",
                                      minItems=1),
            "max_tokens": _t("integer", "Most tokens to generate.", nullable=True, minimum=1, default=16),
            "logprobs": _t("integer", "Return each token's logprob and this many most likely alternatives "
                           "(at most --max-top-n-tokens).", nullable=True, minimum=0),
            "echo": _t("boolean", "Put the prompt in front of the completion text.", default=False),
            "best_of": _t("integer", "Accepted only equal to n: choosing among extra samples is not "
                          "supported.", nullable=True, minimum=1),
        }, ("prompt",), example={"model": model_id, "prompt": "What is deep learning?", "max_tokens": 20}),
        "Usage": _obj({k: _t("integer", minimum=0) for k in ("prompt_tokens", "completion_tokens",
                                                              "total_tokens")},
                      ("prompt_tokens", "completion_tokens", "total_tokens")),
        "ChatLogprobs": _obj({"content": _array(_obj({
            "token": _t("string"), "logprob": _t("number"), "top_logprobs": _array(top)},
            ("token", "logprob")))}, ("content",)),
        "CompletionLogprobs": _obj({
            "tokens": _array({"type": "string"}),
            "token_logprobs": _array({"type": ["number", "null"]}),
            "top_logprobs": _array({"anyOf": [{"type": "object",
                                               "additionalProperties": {"type": "number"}},
                                              {"type": "null"}]}),
            "text_offset": _array({"type": "integer"})}, description="OpenAI's legacy logprobs layout."),
        "ChatCompletion": _openai_envelope("chat.completion", _obj({
            "index": _t("integer", minimum=0),
            "message": _obj({"role": _t("string", const="assistant"),
                             "content": _t("string", nullable=True)}, ("role", "content")),
            "logprobs": choice_logprobs, "finish_reason": finish},
            ("index", "message", "finish_reason")), usage_nullable=False),
        "ChatCompletionChunk": _openai_envelope("chat.completion.chunk", _obj({
            "index": _t("integer", minimum=0),
            "delta": _obj({"role": _t("string"), "content": _t("string", nullable=True)}),
            "logprobs": choice_logprobs, "finish_reason": finish},
            ("index", "delta", "finish_reason")), usage_nullable=True),
        "Completion": _openai_envelope("text_completion",
                                       _obj(text_choice, ("index", "text", "finish_reason")),
                                       usage_nullable=False),
        "CompletionChunk": _openai_envelope("text_completion", _obj(text_choice, ("index", "text")),
                                            usage_nullable=True),
        "Model": _obj({"id": _t("string"), "object": _t("string", const="model"),
                       "created": _t("integer"), "owned_by": _t("string")},
                      ("id", "object", "created", "owned_by")),
        "ModelList": _obj({"object": _t("string", const="list"), "data": _array(_ref("Model"))},
                          ("object", "data")),
    }


# ------------------------------------------------------------------------------------------------
# Responses, headers, operations
# ------------------------------------------------------------------------------------------------

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
}
_ENGINE_ERRORS = ("GenerationError", "Overloaded", "IncompleteGeneration")


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
        out[name] = _response(description, _json(_ref("ErrorResponse")))
        out["OpenAI" + name] = _response(description, _json(_ref("OpenAIError")))
    return out


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
                     {**_json(_ref(body)), **_sse({"oneOf": [_ref(chunk), _ref("OpenAIError")]}, done=True)})


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
        "503": _response("The engine is gone (`unhealthy`, error_type `healthcheck`).",
                         _json(_ref("ErrorResponse")))})


def _paths() -> dict:
    stream_event = {"oneOf": [_ref("StreamResponse"), _ref("ErrorResponse")]}
    generate_ok = _response("The generation.", _json(_ref("GenerateResponse")), _headers(_TIMING_HEADERS))
    return {
        "/": {
            "get": _health_op("root_health", "Health check (same as /health)"),
            "post": _op("compat_generate", TGI_TAG, "Generate, or stream when `stream` is true",
                        {"200": _response(
                            "A JSON array holding one GenerateResponse; with `stream: true`: "
                            + _TGI_STREAM_TEXT,
                            {**_json(_array(_ref("GenerateResponse"), minItems=1, maxItems=1)),
                             **_sse(stream_event)}, _headers(_TIMING_HEADERS)),
                         **_errors()},
                        body=_ref("CompatGenerateRequest"), secured=True,
                        description="return_full_text defaults to the model's pipeline default (true for "
                                    "text-generation models) here, unlike /generate."),
        },
        "/generate": {"post": _op("generate", TGI_TAG, "Generate text", {"200": generate_ok, **_errors()},
                                  body=_ref("GenerateRequest"), secured=True)},
        "/generate_stream": {"post": _op(
            "generate_stream", TGI_TAG, "Generate text as a stream of tokens",
            {"200": _response(_TGI_STREAM_TEXT, _sse(stream_event), _headers(_STREAM_HEADERS)),
             **_errors(engine=False)},
            body=_ref("GenerateRequest"), secured=True,
            description="best_of > 1 and decoder_input_details are not supported when streaming.")},
        "/tokenize": {"post": _op("tokenize", TGI_TAG, "Tokenize a prompt",
                                  {"200": _response("The prompt's tokens with their character offsets.",
                                                    _json(_ref("TokenizeResponse"))),
                                   **_errors(engine=False)}, body=_ref("GenerateRequest"), secured=True)},
        "/chat_tokenize": {"post": _op("chat_tokenize", TGI_TAG, "Apply the chat template and tokenize",
                                       {"200": _response("The templated prompt and its tokens.",
                                                         _json(_ref("ChatTokenizeResponse"))),
                                        **_errors(secured=False, engine=False)}, body=_ref("ChatRequest"))},
        "/invocations": {"post": _op(
            "sagemaker_invocations", SAGEMAKER_TAG, "SageMaker entry point",
            {"200": _response("The answer of the route the body's shape selects (POST /, "
                              "/v1/chat/completions or /v1/completions), JSON or SSE as that route would.",
                              {**_json({"anyOf": [_array(_ref("GenerateResponse")), _ref("ChatCompletion"),
                                                  _ref("Completion")]}),
                               **_sse({"anyOf": [_ref(n) for n in (
                                   "StreamResponse", "ChatCompletionChunk", "CompletionChunk",
                                   "ErrorResponse", "OpenAIError")]}, done=True)}),
             **_errors()},
            body={"anyOf": [_ref("CompatGenerateRequest"), _ref("ChatRequest"), _ref("CompletionRequest")]},
            secured=True, description="The body is a CompatGenerateRequest (has `inputs`), a ChatRequest "
                                      "(has `messages`) or a CompletionRequest (has `prompt`). HTTP errors "
                                      "are TGI's ErrorResponse; in-band stream errors take the shape of "
                                      "the selected route.")},
        "/v1/chat/completions": {"post": _op(
            "chat_completions", OPENAI_TAG, "OpenAI chat completions",
            {"200": _openai_ok("ChatCompletion", "ChatCompletionChunk"),
             **_errors(openai=True)},
            body=_ref("ChatRequest"), secured=True)},
        "/v1/completions": {"post": _op(
            "completions", OPENAI_TAG, "OpenAI (legacy) completions",
            {"200": _openai_ok("Completion", "CompletionChunk"),
             **_errors(openai=True)},
            body=_ref("CompletionRequest"), secured=True)},
        "/v1/models": {"get": _op("list_models", OPENAI_TAG, "The served model",
                                  {"200": _response("A list holding the one served model.",
                                                    _json(_ref("ModelList")))})},
        "/info": {"get": _op("info", INFO_TAG, "Model and server limits",
                             {"200": _response("Server info.", _json(_ref("Info")))})},
        "/health": {"get": _health_op("health", "Health check")},
        "/ping": {"get": _health_op("ping", "Health check (SageMaker's name)")},
        "/metrics": {"get": _op("metrics", INFO_TAG, "Prometheus metrics", {"200": _response(
            "Prometheus text exposition format.", {"text/plain": {"schema": {"type": "string"}}})})},
        SPEC_PATH: {"get": _op("openapi_spec", DOCS_TAG, "This OpenAPI document", {"200": _response(
            "The OpenAPI 3.1 document.", _json({"type": "object"}))})},
        DOCS_PATH: {"get": _op("swagger_ui", DOCS_TAG, "Swagger UI for this document", {"200": _response(
            "An HTML page.", {"text/html": {"schema": {"type": "string"}}})})},
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
        "tags": [{"name": t} for t in (TGI_TAG, OPENAI_TAG, SAGEMAKER_TAG, INFO_TAG, DOCS_TAG)],
        "paths": _paths(),
        "components": {
            "schemas": {**_tgi_schemas(), **_openai_schemas(model_id)},
            "responses": _components_responses(),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "Checked only when the server runs with --api-key; the key is compared "
                               "case-insensitively."}},
        },
    }


# ------------------------------------------------------------------------------------------------
# Routes
# ------------------------------------------------------------------------------------------------

_CDN = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"


def swagger_ui_html(spec_url: str = SPEC_PATH, title: str = "llmbus - Swagger UI") -> str:
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{_CDN}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{_CDN}/swagger-ui-bundle.js"></script>
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

    app.router.add_get(SPEC_PATH, spec)
    app.router.add_get(DOCS_PATH, docs)
