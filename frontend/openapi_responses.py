"""The OpenAPI component schemas of OpenAI's Responses API (``/v1/responses``): the request, the response
object, its output items and its stream events, as llmbus takes and answers them (the subset of OpenAI's
that responses_requests.py reads; OpenAI's other fields are accepted and ignored)."""

from __future__ import annotations

from llmbus.frontend.openapi_schemas import CHAT_TEMPLATE_KWARGS, EFFORT_NOTE, F32_TINY, THINKING_SWITCH_NOTE, \
    array, ref
from llmbus.frontend.thinking_controls import EFFORTS, SUMMARIES

_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}


def _nullable(schema: dict, description: str) -> dict:
    return {"anyOf": [schema, {"type": "null"}], "description": description}


def _obj(properties: dict, required: tuple[str, ...] = (), description: str | None = None) -> dict:
    out: dict = {"type": "object", "properties": properties, "required": list(required)}
    if description:
        out["description"] = description
    return out


def _const(value: str) -> dict:
    return {"type": "string", "const": value}


def _text_parts(images: bool = False) -> dict:
    """A string or parts: text, and where ``images`` an ``input_image``."""
    part = _obj({"type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": _STR},
                ("type", "text"))
    image = _obj({"type": _const("input_image"), "image_url": {
        "type": "string", "description": "An http(s) URL or a base64 data URL (`data:image/png;base64,...`)."},
        "detail": {"type": "string", "description": "Accepted and ignored."}}, ("type", "image_url"),
        "An image: read by a vision-language model (LLaVA); a text model refuses it (400).")
    return {"anyOf": [_STR, array({"anyOf": [part, image]} if images else part)]}


def _request_items() -> dict:
    message = _obj({"type": _const("message"), "role": {"type": "string", "enum": [
        "user", "assistant", "system", "developer"]}, "content": _text_parts(images=True)}, ("role", "content"),
        "A message (developer messages are system messages to the model).")
    call = _obj({"type": _const("function_call"), "call_id": _STR, "name": _STR, "arguments": _STR},
                ("type", "call_id", "name", "arguments"), "A function call of an earlier turn.")
    output = _obj({"type": _const("function_call_output"), "call_id": _STR, "output": _text_parts()},
                  ("type", "call_id", "output"), "The result of a function call.")
    return {"anyOf": [message, call, output]}


def _function_tool() -> dict:
    return _obj({"type": _const("function"), "name": {"type": "string", "minLength": 1},
                 "description": _nullable(_STR, "What the function does."),
                 "parameters": _nullable({"type": "object"}, "The arguments' JSON Schema."),
                 "strict": _nullable(_BOOL, "Calls always follow the schema here (a grammar holds them).")},
                ("type", "name"))


def _text_config() -> dict:
    fmt = {"anyOf": [
        _obj({"type": {"type": "string", "enum": ["text", "json_object"]}}, ("type",)),
        _obj({"type": _const("json_schema"), "name": _STR, "schema": {"type": "object"},
              "strict": _nullable(_BOOL, "Always held to the schema here.")}, ("type", "schema"))]}
    return _obj({"format": fmt}, (), "The answer's format: text, any JSON object, or JSON of a schema.")


def _reasoning() -> dict:
    summary = _nullable({"type": "string", "enum": list(SUMMARIES)}, "Accepted; no summary is written.")
    return _obj({"effort": _nullable({"type": "string", "enum": list(EFFORTS)}, "Thinking on or off."),
                 "summary": summary, "generate_summary": summary})


def _request() -> dict:
    tool_choice = {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                             _obj({"type": _const("function"), "name": _STR}, ("type", "name"))]}
    return _obj({
        "model": _nullable(_STR, "Echoed by OpenAI; this server answers with the model it serves."),
        "input": {"anyOf": [_STR, array(_request_items())],
                  "description": "A user message, or input items (messages, function calls and their outputs)."},
        "instructions": _nullable(_STR, "A system message before the input (not carried to the next turn)."),
        "previous_response_id": _nullable(_STR, "Continue the conversation of a stored response."),
        "tools": _nullable(array(_function_tool()), "Function tools (built-in tools are refused with a 400)."),
        "tool_choice": _nullable(tool_choice, "auto (default), none, required or a named function."),
        "parallel_tool_calls": _nullable(_BOOL, "More than one call per answer (default true)."),
        "text": _nullable(_text_config(), "Output format."),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1}, "Most tokens to generate."),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2},
                                 "Sampling temperature; 0 is greedy. Unset: the server's default."),
        "top_p": _nullable({"type": "number", "minimum": F32_TINY, "maximum": 1}, "Nucleus sampling mass."),
        "stop": _nullable({"anyOf": [_STR, array(_STR)]}, "Stop sequences (llmbus extension)."),
        "seed": _nullable(_INT, "Random seed for sampling (llmbus extension)."),
        "metadata": _nullable({"type": "object", "additionalProperties": _STR}, "Echoed and stored."),
        "user": _nullable(_STR, "Echoed and stored."),
        "store": _nullable(_BOOL, "Keep the response for previous_response_id and GET (default true); in "
                                  "this server process's memory only."),
        "stream": _nullable(_BOOL, "Answer with Responses SSE events."),
        "reasoning": _nullable(_reasoning(), "The reasoning controls: `effort` " + EFFORT_NOTE + THINKING_SWITCH_NOTE
                               + " `summary` is accepted where the model reasons, and no summary is written: the "
                                 "whole section comes back as a reasoning item's `reasoning_text`."),
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
    }, ("input",))


def _output_item() -> dict:
    status = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
    part = _obj({"type": _const("output_text"), "text": _STR, "annotations": array({}),
                 "logprobs": array({})}, ("type", "text", "annotations"))
    message = _obj({"id": _STR, "type": _const("message"), "status": status, "role": _const("assistant"),
                    "content": array(part)}, ("id", "type", "status", "role", "content"))
    call = _obj({"id": _STR, "type": _const("function_call"), "status": status, "call_id": _STR, "name": _STR,
                 "arguments": {"type": "string", "description": "JSON text (whole once the item is done)."}},
                ("id", "type", "call_id", "name", "arguments"))
    return {"oneOf": [message, call]}


def _response() -> dict:
    usage = _obj({"input_tokens": _INT, "input_tokens_details": _obj({"cached_tokens": _INT}, ("cached_tokens",)),
                  "output_tokens": _INT, "output_tokens_details": _obj({"reasoning_tokens": _INT}),
                  "total_tokens": _INT},
                 ("input_tokens", "input_tokens_details", "output_tokens", "total_tokens"))
    return _obj({
        "id": _STR, "object": _const("response"), "created_at": _INT,
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
        "error": {"type": "null"},
        "incomplete_details": _nullable(_obj({"reason": _const("max_output_tokens")}, ("reason",)),
                                        "Why the answer is incomplete."),
        "instructions": _nullable(_STR, "As sent."), "max_output_tokens": _nullable(_INT, "As sent."),
        "model": _STR, "output": array(ref("ResponseOutputItem")), "parallel_tool_calls": _BOOL,
        "previous_response_id": _nullable(_STR, "As sent."), "store": _BOOL,
        "reasoning": _obj({"effort": _nullable(_STR, "As sent."), "summary": _nullable(_STR, "As sent.")}),
        "temperature": _nullable({"type": "number"}, "As sent."), "top_p": _nullable({"type": "number"}, "As sent."),
        "text": {"type": "object"}, "tool_choice": {"anyOf": [_STR, {"type": "object"}]},
        "tools": array({"type": "object"}), "truncation": _STR,
        "usage": _nullable(usage, "Null until the answer is done (the stream's first events)."),
        "user": _nullable(_STR, "As sent."), "metadata": {"type": "object", "additionalProperties": _STR},
    }, ("id", "object", "created_at", "status", "model", "output", "parallel_tool_calls", "tool_choice", "tools"))


def _stream_event() -> dict:
    def event(types: list[str], fields: dict, required: tuple[str, ...]) -> dict:
        return _obj({"type": {"type": "string", "enum": types}, "sequence_number": _INT, **fields},
                    ("type", "sequence_number", *required))

    at = {"item_id": _STR, "output_index": _INT}
    return {"oneOf": [
        event(["response.created", "response.in_progress", "response.completed", "response.incomplete"],
              {"response": ref("ResponseObject")}, ("response",)),
        event(["response.output_item.added", "response.output_item.done"],
              {"output_index": _INT, "item": ref("ResponseOutputItem")}, ("output_index", "item")),
        event(["response.content_part.added", "response.content_part.done"],
              {**at, "content_index": _INT, "part": {"type": "object"}}, ("item_id", "part")),
        event(["response.output_text.delta", "response.function_call_arguments.delta"],
              {**at, "delta": _STR}, ("item_id", "delta")),
        event(["response.output_text.done"], {**at, "content_index": _INT, "text": _STR}, ("item_id", "text")),
        event(["response.function_call_arguments.done"], {**at, "arguments": _STR}, ("item_id", "arguments")),
        event(["error"], {"code": _STR, "message": _STR, "param": _nullable(_STR, "The field at fault.")},
              ("message",)),
    ]}


def responses_schemas() -> dict:
    return {
        "ResponsesRequest": _request(),
        "ResponseObject": _response(),
        "ResponseOutputItem": _output_item(),
        "ResponseStreamEvent": _stream_event(),
        "ResponseDeleted": _obj({"id": _STR, "object": _const("response.deleted"), "deleted": _BOOL},
                                ("id", "object", "deleted")),
    }
