"""Anthropic Messages request bodies (``/v1/messages``, ``/v1/messages/count_tokens``) translated into the
chat route's OpenAI body, so that one parser (``parse_chat``), one template rendering (``chat_prompt``), one
tool grammar and the same sampling defaults serve both APIs.

What is Anthropic's own is checked here, with Anthropic's rules: ``max_tokens`` is required, temperature is
within [0, 1], roles alternate between ``user`` and ``assistant`` (``system`` is a field of its own), content
is a string or blocks. Blocks map onto OpenAI's messages:

- ``text``: the message's text (several blocks joined);
- ``tool_use`` (assistant): one of the message's ``tool_calls``, ``input`` as the arguments;
- ``tool_result`` (user): a ``role: "tool"`` message answering ``tool_use_id``, which the tool machinery
  renders as the template allows; text after results becomes a user message of its own;
- ``thinking`` / ``redacted_thinking`` (assistant): dropped, as reasoning templates drop earlier turns' sections;
- ``image`` (user): for a vision-language model, the image as TGI writes one in a message's text
  (``![](<url>)``: a ``base64`` source as a data URL, a ``url`` source as it is), which validation loads; a
  text model refuses it, naming the block;
- ``document`` and anything else: refused, naming the block (the models served read text).

Structured outputs (``output_config.format``) become the chat route's ``response_format``; ``thinking`` sets
the template's thinking switch (thinking_controls.py) and ``chat_template_kwargs`` (vLLM's extension) passes
as on the chat route. Documented fields that are not served (``output_config.effort``, ...) are refused by
name (refused_fields.py); unknown top-level keys are ignored, as on the OpenAI routes.
"""

from __future__ import annotations

import json

from llmbus.frontend.chat import ChatFormat
from llmbus.frontend.config import Limits
from llmbus.frontend.errors import validation_error
from llmbus.frontend.images import markdown_image
from llmbus.frontend.openai_requests import ChatRequest, parse_chat
from llmbus.frontend.refused_fields import ANTHROPIC, ANTHROPIC_OUTPUT_CONFIG, refuse_unserved
from llmbus.frontend.sampling_defaults import SamplingDefaults
from llmbus.frontend.thinking_controls import anthropic_thinking

_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else "null")


def _bad(where: str, why: str, param: str):
    return validation_error(f"`{where}` {why}", param=param)


def _text_blocks(value, where: str, param: str) -> str:
    """A string, or an array of text blocks joined (``system``, a ``tool_result``'s content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, f"must be a string or an array of text blocks, not {_kind(value)}", param)
    texts = []
    for here, kind, block in _blocks(value, where):
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("image", "document"):
            raise _not_text(here, kind, param, in_text_only=True)
        else:
            raise _bad(here, "must be a text block ({\"type\": \"text\", \"text\": ...})", param)
    return "".join(texts)


def _blocks(content: list, where: str):
    """(where, type, block) of each block of a message's content."""
    for j, block in enumerate(content):
        yield f"{where}[{j}]", block.get("type") if isinstance(block, dict) else None, block


def _image_url(block: dict, where: str) -> str:
    """An image block's source as a URL: a ``base64`` source's data URL, a ``url`` source's URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(f"{where}.source", 'must be {"type": "base64", "media_type": ..., "data": ...} or {"type": "url", '
                                  '"url": ...}', "messages")


def _user_messages(content, where: str, images: bool) -> list[dict]:
    """A user turn as OpenAI messages: each tool_result a ``tool`` message, text runs ``user`` messages (with
    their images, for a model that reads ``images``)."""
    out: list[dict] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for here, kind, block in _blocks(content, where):
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "image" and images:
            text.append(markdown_image(_image_url(block, here)))
        elif kind == "tool_result":
            flush()
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise _bad(here, "must have a string `tool_use_id`", "messages")
            result = block.get("content")
            result = "" if result is None else _text_blocks(result, f"{here}.content", "messages")
            if block.get("is_error") is True:
                result = f"Error: {result}"  # the template has no field for it: the model reads it here
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        else:
            raise _unsupported(here, kind, "user")
    flush()
    return out


def _assistant_message(content, where: str) -> dict:
    text: list[str] = []
    calls: list[dict] = []
    for here, kind, block in _blocks(content, where):
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(block.get("id"), str):
                raise _bad(here, "must have a string `id` and a non-empty string `name`", "messages")
            if not isinstance(arguments, dict):
                raise _bad(f"{here}.input", f"must be an object, not {_kind(arguments)}", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported(here, kind, "assistant")
    message = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    return message | ({"tool_calls": calls} if calls else {})


def _not_text(where: str, kind: str, param: str, in_text_only: bool = False):
    """``in_text_only``: a field that holds text whatever the model reads (the system prompt, a tool result)."""
    if in_text_only and kind == "image":
        return _bad(where, "is image content, which only a user message's own blocks may hold", param)
    return _bad(where, f"is {kind} content, which this model does not read: only text is supported", param)


def _unsupported(where: str, kind, role: str):
    if kind in ("image", "document"):
        return _not_text(where, kind, "messages")
    allowed = "text and tool_result" if role == "user" else "text and tool_use"
    return _bad(where, f"has a block of type {json.dumps(kind)}; {role} messages take {allowed} blocks",
                "messages")


def _messages(body: dict, images: bool) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system", "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad(where, 'must be an object with `role` "user" or "assistant" (the system prompt is '
                              "the top-level `system`)", "messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif not isinstance(content, list):
            raise _bad(f"{where}.content", f"must be a string or an array of blocks, not {_kind(content)}",
                       "messages")
        elif message["role"] == "user":
            out += _user_messages(content, f"{where}.content", images)
        else:
            out.append(_assistant_message(content, f"{where}.content"))
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array, not {_kind(tools)}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}]", "must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]", f"is a server tool ({json.dumps(tool.get('type'))}), which this server "
                                      "does not run: only client tools (name, input_schema) are supported",
                       "tools")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name", "must be a non-empty string", "tools")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{i}].input_schema", "must be a JSON Schema object", "tools")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"tools[{i}].description", "must be a string", "tools")
        function = {"name": name} | ({"description": description} if description is not None else {})
        out.append({"type": "function", "function": function | {"parameters": schema}})
    return out


def _tool_choice(body: dict, openai: dict) -> None:
    """``tool_choice`` onto OpenAI's ``tool_choice`` and ``parallel_tool_calls``."""
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    kind = kind if isinstance(kind, str) else None  # a dict here cannot be looked up in _TOOL_CHOICES
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "must name a tool", "tool_choice")
        openai["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        openai["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise _bad("tool_choice", 'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} '
                                  'or {"type": "none"}', "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean", "tool_choice")
        openai["parallel_tool_calls"] = not disable


def _number(body: dict, name: str, low: float, high: float):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(name, f"must be a number >= {low} and <= {high}. Given: {json.dumps(value)}", name)
    return value


def _output_format(body: dict, openai: dict) -> None:
    """Structured outputs, ``output_config.format`` (or the beta's ``output_format``): ``{"type":
    "json_schema", "schema": ...}``, served as the chat route's ``response_format``."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _bad("output_config", f"must be an object, not {_kind(config)}", "output_config")
    refuse_unserved(config or {}, ANTHROPIC_OUTPUT_CONFIG, "output_config.")
    fmt = (config or {}).get("format", body.get("output_format"))
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", 'must be {"type": "json_schema", "schema": {...}}',
                   "output_config.format")
    openai["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_openai(body: dict, *, count_only: bool = False, images: bool = False) -> dict:
    """The chat route's OpenAI body for an Anthropic Messages body (``count_only``: count_tokens', which
    has no ``max_tokens`` and generates nothing; ``images``: the model reads images)."""
    refuse_unserved(body, ANTHROPIC)
    openai: dict = {"messages": _messages(body, images)}
    if body.get("chat_template_kwargs") is not None:
        openai["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = _tools(body)
    if tools is not None:
        openai["tools"] = tools
    _tool_choice(body, openai)
    if count_only:
        return openai
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _bad("max_tokens", "is required", "max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens", f"must be an integer >= 1. Given: {json.dumps(max_tokens)}", "max_tokens")
    openai["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):  # Anthropic's ranges are [0, 1] both
        value = _number(body, name, 0, 1)
        if value is not None:
            openai[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise _bad("top_k", f"must be an integer >= 0. Given: {json.dumps(top_k)}", "top_k")
        openai["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences", "must be an array of strings", "stop_sequences")
        openai["stop"] = stops
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"must be a boolean, not {_kind(stream)}", "stream")
    openai["stream"] = bool(stream)
    metadata = body.get("metadata")  # accepted (user_id is for Anthropic's abuse checks), not used
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", f"must be an object, not {_kind(metadata)}", "metadata")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", f"must be a string, not {_kind(body['model'])}", "model")
    if body.get("model") is not None:
        openai["model"] = body["model"]  # a LoRA adapter's name selects it, as on the OpenAI routes
    _output_format(body, openai)
    return openai


def parse_messages(body: dict, limits: Limits, defaults: SamplingDefaults, *,
                   count_only: bool = False, chat_format: ChatFormat | None = None) -> ChatRequest:
    """The chat route's request for an Anthropic body: one choice, no logprobs; ``chat_format``: the
    model's tool syntax and thinking switch."""
    images = chat_format is not None and chat_format.reads_images
    return parse_chat(to_openai(body, count_only=count_only, images=images), limits, 1, defaults, chat_format,
                      anthropic_thinking(body.get("thinking")))
