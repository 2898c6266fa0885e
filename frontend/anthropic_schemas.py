"""The OpenAPI component schemas of Anthropic's Messages API as llmbus serves it (``anthropic_messages.py``):
the request, the message, the stream's events, ``count_tokens`` and Anthropic's error envelope. Shapes follow
the ``anthropic`` SDK's types (what clients parse); fields llmbus never sends are left out."""

from __future__ import annotations

from llmbus.frontend.openapi_schemas import CHAT_TEMPLATE_KWARGS, THINKING_SWITCH_NOTE, _obj, _t, array, ref

STOP_REASONS = ["end_turn", "max_tokens", "stop_sequence", "tool_use"]
# the HTTP errors of the routes: (status, description); all in Anthropic's envelope
ERRORS = {
    "400": "invalid_request_error: the body is not a valid request, or a parameter broke a rule (prompt "
           "longer than --max-total-tokens, an unknown tool, an image, ...).",
    "401": "authentication_error: --api-key is set and neither `x-api-key` nor `Authorization: Bearer` "
           "carries it.",
    "413": "request_too_large: the body is larger than --payload-limit.",
    "429": "rate_limit_error: --max-concurrent-requests are already in flight.",
    "500": "api_error: the engine failed the request.",
    "529": "overloaded_error: the server is shutting down (SIGTERM) and takes no new requests.",
}


def _text_block() -> dict:
    return _obj({"type": _t("string", const="text"), "text": _t("string")}, ("type", "text"))


def _tool_use_block() -> dict:
    return _obj({"type": _t("string", const="tool_use"), "id": _t("string"), "name": _t("string"),
                 "input": _t("object", "The arguments; valid against the tool's input_schema.")},
                ("type", "id", "name", "input"))


def _usage(*, delta: bool) -> dict:
    counts = {"input_tokens": _t("integer", "Prompt tokens not read from the prefix cache.", minimum=0),
              "output_tokens": _t("integer", "Generated tokens.", minimum=0),
              "cache_creation_input_tokens": _t("integer", "Always 0: the prefix cache fills by itself.",
                                                nullable=True, minimum=0),
              "cache_read_input_tokens": _t("integer", "Prompt tokens whose prefill the prefix cache saved.",
                                            nullable=True, minimum=0)}
    return _obj(counts, ("output_tokens",) if delta else ("input_tokens", "output_tokens"))


def _event(name: str, properties: dict, required: tuple[str, ...] = ()) -> dict:
    return _obj({"type": _t("string", const=name), **properties}, ("type", *required))


def _stream_events() -> dict:
    index = _t("integer", minimum=0)
    delta = {"anyOf": [
        _obj({"type": _t("string", const="text_delta"), "text": _t("string")}, ("type", "text")),
        _obj({"type": _t("string", const="input_json_delta"),
              "partial_json": _t("string", "A fragment; a block's fragments join into its input's JSON.")},
             ("type", "partial_json"))]}
    return {"anyOf": [
        _event("message_start", {"message": ref("AnthropicMessage")}, ("message",)),
        _event("ping", {}),
        _event("content_block_start", {"index": index, "content_block": {"anyOf": [
            _text_block(), _tool_use_block()]}}, ("index", "content_block")),
        _event("content_block_delta", {"index": index, "delta": delta}, ("index", "delta")),
        _event("content_block_stop", {"index": index}, ("index",)),
        _event("message_delta", {"delta": _obj({
            "stop_reason": _t("string", enum=STOP_REASONS), "stop_sequence": _t("string", nullable=True)},
            ("stop_reason",)), "usage": _usage(delta=True)}, ("delta", "usage")),
        _event("message_stop", {}),
        ref("AnthropicError"),
    ]}


def anthropic_schemas(model_id: str) -> dict:
    content_block = {"anyOf": [
        _text_block(),
        _obj({"type": _t("string", const="tool_use"), "id": _t("string"), "name": _t("string"),
              "input": _t("object")}, ("type", "id", "name"), "An assistant's earlier call."),
        _obj({"type": _t("string", const="tool_result"), "tool_use_id": _t("string"),
              "content": {"anyOf": [{"type": "string"}, array(_text_block())]},
              "is_error": _t("boolean")}, ("type", "tool_use_id"), "A user's answer to a call."),
        _obj({"type": _t("string", const="image"), "source": _obj({
            "type": _t("string", enum=["base64", "url"]), "media_type": _t("string", "With a base64 source."),
            "data": _t("string", "With a base64 source."), "url": _t("string", "With a url source.")}, ("type",))},
            ("type",), "A user message's image: read by a vision-language model (LLaVA); a text model refuses "
                       "it (400)."),
    ]}
    tool = _obj({"name": _t("string", minLength=1), "description": _t("string"),
                 "input_schema": _t("object", "A JSON Schema of the tool's input."),
                 "type": _t("string", const="custom")}, ("name", "input_schema"))
    tool_choice = _obj({"type": _t("string", enum=["auto", "any", "tool", "none"]),
                        "name": _t("string", "The tool, with type `tool`."),
                        "disable_parallel_tool_use": _t("boolean", "At most one call.")}, ("type",))
    prompt = {
        "model": _t("string", f"Model name; echoed back. This server serves `{model_id}`.", example=model_id),
        "messages": array(_obj({"role": _t("string", enum=["user", "assistant"]),
                                "content": {"anyOf": [{"type": "string"}, array(content_block)]}},
                               ("role", "content")), "The conversation; rendered with the model's chat "
                          "template. A last assistant message is continued.", minItems=1),
        "system": {"description": "The system prompt.", "anyOf": [{"type": "string"}, array(_text_block())]},
        "tools": array(tool, "Client tools the model may call; its calls always parse and their input "
                             "validates against `input_schema`."),
        "tool_choice": tool_choice,
        "thinking": _obj({"type": _t("string", enum=["enabled", "adaptive", "disabled"]),
                          "budget_tokens": _t("integer", "Required with `enabled`; not enforced (the model ends "
                                                         "its section, within max_tokens).", minimum=1)},
                         ("type",), "enabled and adaptive turn thinking on, disabled off: " + THINKING_SWITCH_NOTE),
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
    }
    return {
        "AnthropicMessagesRequest": _obj({
            **prompt,
            "max_tokens": _t("integer", "Most tokens to generate.", minimum=1),
            "stop_sequences": array({"type": "string"}, "Stop sequences; the matched one is not shown."),
            "temperature": _t("number", "Sampling temperature; 0 is greedy. Unset: the server's default "
                              "(/info `sampling_defaults`).", minimum=0, maximum=1),
            "top_p": _t("number", "Nucleus sampling mass.", minimum=0, maximum=1),
            "top_k": _t("integer", "Sample among the k most likely tokens (0: off).", minimum=0),
            "stream": _t("boolean", "Answer with Anthropic's SSE events.", default=False),
            "metadata": _t("object", "Accepted, not used."),
        }, ("messages", "max_tokens"), example={"model": model_id, "max_tokens": 20, "messages": [
            {"role": "user", "content": "What is deep learning?"}]}),
        "AnthropicCountTokensRequest": _obj(prompt, ("messages",)),
        "AnthropicMessage": _obj({
            "id": _t("string"), "type": _t("string", const="message"), "role": _t("string", const="assistant"),
            "model": _t("string"),
            "content": array({"anyOf": [_text_block(), _tool_use_block()]}),
            "stop_reason": _t("string", "Null only in message_start.", nullable=True, enum=[*STOP_REASONS, None]),
            "stop_sequence": _t("string", "The stop sequence that ended the answer.", nullable=True),
            "usage": _usage(delta=False)},
            ("id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage")),
        "AnthropicStreamEvent": _stream_events(),
        "AnthropicTokenCount": _obj({"input_tokens": _t("integer", "The prompt's tokens, template and tools "
                                                        "included.", minimum=0)}, ("input_tokens",)),
        "AnthropicError": _obj({"type": _t("string", const="error"), "error": _obj({
            "type": _t("string", "invalid_request_error, authentication_error, not_found_error, "
                                 "request_too_large, rate_limit_error, api_error or overloaded_error."),
            "message": _t("string")}, ("type", "message"))}, ("type", "error"), "Anthropic's error body."),
    }
