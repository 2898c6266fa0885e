"""A Responses API request body (``POST /v1/responses``) translated into the chat completions body that
``parse_chat`` reads, so a response runs exactly as a chat completion does: the same chat template, tool
grammar, ``response_format`` grammar, sampling defaults and limits. Only the shapes differ:

- ``instructions`` is a system message first; ``input`` (a string, or items) and a previous response's
  stored conversation follow it. Message items of role ``developer`` are system messages (the chat
  templates know no developer role); content parts ``input_text``/``output_text`` are joined text, and for a
  vision-language model ``input_image`` parts (an ``image_url``, a URL or a data URL) join it as TGI writes an
  image in a message's text, ``![](<url>)``, which validation loads.
- ``function_call`` items become an assistant message's ``tool_calls`` (consecutive ones, and a message
  of the assistant's just before them, one message), ``function_call_output`` items ``role: "tool"``
  messages.
- flat function tools (``{"type": "function", "name", "parameters"}``) become chat tools; a named
  ``tool_choice`` ``{"type": "function", "name"}`` the chat shape. Built-in tools (web search, file search,
  code interpreter, MCP, ...) are refused with a 400: nothing here can run them.
- ``text.format`` becomes ``response_format``, ``max_output_tokens`` ``max_tokens``; ``chat_template_kwargs``
  (vLLM's extension) passes as it is, and ``reasoning`` sets the template's thinking switch
  (thinking_controls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmbus.frontend.errors import ApiError, ErrorKind, validation_error
from llmbus.frontend.images import markdown_image
from llmbus.frontend.refused_fields import RESPONSES, refuse_unserved
from llmbus.frontend.thinking_controls import ThinkingAsk, responses_reasoning

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# keys passed to the chat parser as they are: OpenAI's sampling keys, and the extensions the chat route takes
_CHAT_KEYS = ("temperature", "top_p", "stop", "seed", "top_k", "min_p", "repetition_penalty",
              "frequency_penalty", "presence_penalty", "model", "chat_template_kwargs")


def unsupported(detail: str, param: str) -> ApiError:
    return ApiError(ErrorKind.UNSUPPORTED, detail, param=param)


@dataclass
class ResponsesRequest:
    chat_body: dict  # what parse_chat reads
    history: list[dict]  # the conversation as chat messages, instructions left out (what the store keeps)
    echo: dict  # the request's fields the response object repeats
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict] = field(default_factory=list)  # flat, as given
    thinking: ThinkingAsk | None = None  # what `reasoning` asks of the template's thinking switch


def _check(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise validation_error(f"`{name}` must be {what}. Given: {json.dumps(value)}", param=name)
    return value


def _image_url(part: dict, named: str) -> str:
    if part.get("file_id") is not None:
        raise unsupported(f"`{named}`: input_image parts by `file_id` are not supported (no files are stored); "
                          f"give an `image_url`", param="input")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise validation_error(f"`{named}` input_image parts must have a string `image_url`", param="input")
    return url


def _text(content, where: str, whole: bool = False, images: bool = False) -> str:
    """A message's content (``where``: the message; ``whole``: the field itself), a string or text parts
    joined, with its images where the model reads ``images``."""
    named = where if whole else f"{where}.content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise validation_error(f"`{named}` must be a string or an array of content parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "input_image" and images:
            texts.append(markdown_image(_image_url(part, named)))
        elif kind in ("input_image", "input_file", "input_audio"):
            readable = "text and input_image parts are" if images else "only text parts are"
            raise unsupported(f"`{named}`: {kind} parts are not supported by this model; {readable}",
                              param="input")
        else:
            raise validation_error(f"`{named}` parts must be input_text or output_text parts with a "
                                   f"string `text`", param="input")
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise validation_error(f"`{where}.{key}` must be a string", param="input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def input_messages(raw, images: bool = False) -> list[dict]:
    """``input`` as chat messages; ``images``: the model reads images."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise validation_error("`input` must be a string or an array of input items", param="input")
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise validation_error(f"`{where}` must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise validation_error(f"`{where}.role` must be one of user, assistant, system, developer",
                                       param="input")
            out.append({"role": role, "content": _text(item.get("content"), where, images=images)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise validation_error(f"`{where}.call_id` must be a string", param="input")
            output = item.get("output")
            output = output if isinstance(output, str) else _text(output, f"{where}.output", whole=True)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # a reasoning model's notes, fed back by clients: nothing this model can read
        else:
            raise unsupported(f"`{where}`: input items of type {json.dumps(kind)} are not supported; "
                              f"messages, function_call and function_call_output are", param="input")
    return out


def _tool(tool, i: int) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        if isinstance(kind, str):
            raise unsupported(f"`tools[{i}]`: built-in tools ({kind}) are not supported; only function tools "
                              f"are", param="tools")
        raise validation_error(f'`tools[{i}]` must be an object with `type: "function"`', param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        # the Responses API's function tools are flat (not the chat API's {"function": {...}})
        raise validation_error(f"`tools[{i}].name` must be a non-empty string", param="tools")
    fn = {"name": tool.get("name"), "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    # strict or not, the grammar holds every call to its parameters schema
    return {"type": "function", "function": fn}


def _tool_choice(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str):
        raise unsupported(f"`tool_choice` of type {json.dumps(kind)} is not supported; only auto, none, "
                          f"required and function are", param="tool_choice")
    raise validation_error('`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": '
                           '...}', param="tool_choice")


def _response_format(text) -> dict | None:
    """``text.format`` as a chat ``response_format``; None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise validation_error("`text` must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise validation_error("`text.format.schema` must be a JSON Schema object", param="text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict")
                                                       if k in fmt}}
    raise validation_error('`text.format.type` must be "text", "json_object" or "json_schema"', param="text")


def parse_responses(body: dict, previous: list[dict] | None, images: bool = False) -> ResponsesRequest:
    """The chat body and the echoed fields of a Responses request; ``previous`` is the stored conversation
    of ``previous_response_id`` (looked up by the caller), or None; ``images``: the model reads images."""
    refuse_unserved(body, RESPONSES)
    thinking = responses_reasoning(body.get("reasoning"))
    instructions = _check(body, "instructions", (str,), "a string")
    if "input" not in body or body["input"] is None:
        raise validation_error("`input` is required", param="input")
    history = list(previous or []) + input_messages(body["input"], images)
    if not history:
        raise validation_error("`input` must hold a message or a function call output (reasoning items alone "
                               "give the model nothing to answer)", param="input")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = _check(body, "tools", (list,), "an array") or []
    chat = {"messages": messages, "tools": [_tool(t, i) for i, t in enumerate(tools)] or None,
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": _response_format(body.get("text"))}
    max_output = _check(body, "max_output_tokens", (int,), "an integer")
    if max_output is not None:
        if max_output < 1:
            raise validation_error(f"`max_output_tokens` must be >= 1. Given: {max_output}",
                                   param="max_output_tokens")
        chat["max_tokens"] = max_output
    chat.update({k: body[k] for k in _CHAT_KEYS if k in body})
    metadata = _check(body, "metadata", (dict,), "an object") or {}
    if not all(isinstance(v, str) for v in metadata.values()):
        raise validation_error("`metadata` values must be strings", param="metadata")
    user = _check(body, "user", (str,), "a string")
    stream = _check(body, "stream", (bool,), "a boolean") or False
    store = _check(body, "store", (bool,), "a boolean")
    reasoning = body.get("reasoning") or {}
    echo = {"instructions": instructions, "max_output_tokens": max_output, "metadata": metadata, "user": user,
            "reasoning": {"effort": reasoning.get("effort"),
                          "summary": reasoning.get("summary") or reasoning.get("generate_summary")},
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": body.get("text", {}).get("format") or {"type": "text"}}
            if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}}
    return ResponsesRequest(chat_body=chat, history=history, echo=echo, stream=stream,
                            store=True if store is None else store,
                            previous_response_id=body.get("previous_response_id"), tools=tools,
                            thinking=thinking)


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages the next turn's template sees."""
    return input_messages([item for item in output if item.get("type") in ("message", "function_call")])
