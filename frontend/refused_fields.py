"""Documented request fields llmbus does not serve, refused by name instead of silently ignored (issue #37).

A client migrating to llmbus must not get a plain answer where it asked for audio or a built-in tool (nor
the base model's answer where it named a LoRA adapter that is not loaded: validation.served_adapter). Each
API's documented fields are either honoured by its parser, accepted as documented no-ops (below, with why),
or listed here: a request that sets one to anything but its "off" values gets 400 (``ErrorKind.UNSUPPORTED``)
naming the field. Unknown keys stay ignored, as OpenAI's SDKs add new ones freely.

vLLM's extensions are refused the same way where llmbus does not serve them (``VLLM_EXTRAS``).

Accepted as no-ops, since they change nothing a client sees in the answer: OpenAI's ``user``,
``safety_identifier``, ``prompt_cache_key`` (prefix caching is automatic), ``metadata``, ``store`` on chat
completions (OpenAI's own dashboard), ``service_tier``, ``prediction`` (a latency hint: the output is the
same), ``stream_options.include_obfuscation``; Anthropic's ``metadata`` and ``service_tier``.

The reasoning controls (OpenAI's ``reasoning_effort``, the Responses API's ``reasoning``, Anthropic's
``thinking``) are not listed: they set the chat template's thinking switch where the model reasons, and are
refused like these, by name, where it does not (thinking_controls.py).
"""

from __future__ import annotations

from typing import Callable

from llmbus.frontend.errors import ApiError, ErrorKind

# a field's value that asks for nothing: None always, and per field the values that mean "off"
_Off = Callable[[object], bool]


def _empty(value) -> bool:
    return value in (None, False, 0, "", [], {})


def _text_only(value) -> bool:
    return value is None or value == ["text"]


# field -> (why it is refused, what counts as off)
OPENAI_CHAT: dict[str, tuple[str, _Off]] = {
    "functions": ("the deprecated `functions` are not supported: pass them as `tools`", _empty),
    "function_call": ("the deprecated `function_call` is not supported: use `tool_choice`", _empty),
    "audio": ("audio output is not supported", _empty),
    "modalities": ('only the "text" modality is served', _text_only),
    "verbosity": ("`verbosity` is not supported", _empty),
    "web_search_options": ("built-in web search is not supported", _empty),
}
# vLLM's sampling extensions (sent in the OpenAI SDK's extra_body) that llmbus does not serve, on both OpenAI routes;
# those it serves (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, guided_*, ...) are read
# by openai_requests.py
VLLM_EXTRAS: dict[str, tuple[str, _Off]] = {
    "skip_special_tokens": ("`skip_special_tokens: false` is not supported: special tokens are never shown in the "
                            "text", lambda v: v in (None, True)),
    "spaces_between_special_tokens": ("`spaces_between_special_tokens: false` is not supported",
                                      lambda v: v in (None, True)),
    "prompt_logprobs": ("`prompt_logprobs` is not supported: use /v1/completions with `echo` and `logprobs` "
                        "(--enable-prefill-logprobs)", lambda v: v is None),
    "allowed_token_ids": ("`allowed_token_ids` is not supported: use `guided_choice` or `logit_bias`", _empty),
    "bad_words": ("`bad_words` is not supported: use `logit_bias` to ban tokens", _empty),
    "use_beam_search": ("beam search is not supported", _empty),
    "logits_processors": ("custom logits processors are not supported", _empty),
}
RESPONSES: dict[str, tuple[str, _Off]] = {
    "include": ("`include` is not supported: no extra output data (logprobs, reasoning, tool results) is "
                "served", _empty),
    "truncation": ('only `truncation: "disabled"` is served: a too-long input is an error, never cut',
                   lambda v: v in (None, "disabled")),
    "top_logprobs": ("`top_logprobs` is not supported on /v1/responses (use /v1/chat/completions)", _empty),
    "background": ("background responses are not supported", _empty),
    "prompt": ("stored prompt templates are not supported", _empty),
    "conversation": ("conversations are not supported: use `previous_response_id`", _empty),
    "max_tool_calls": ("`max_tool_calls` is not supported", lambda v: v is None),
}
ANTHROPIC: dict[str, tuple[str, _Off]] = {
    "container": ("containers are not supported", _empty),
    "mcp_servers": ("MCP servers are not supported", _empty),
    "context_management": ("`context_management` is not supported", _empty),
}
# output_config's keys (Anthropic): `format` is honoured (anthropic_requests.py), others refused
ANTHROPIC_OUTPUT_CONFIG: dict[str, tuple[str, _Off]] = {
    "effort": ("`output_config.effort` is not supported", lambda v: v is None),
}


def refuse_unserved(body: dict, table: dict[str, tuple[str, _Off]], prefix: str = "") -> None:
    """Raise UNSUPPORTED for the first field of ``table`` that ``body`` sets to something other than off."""
    for name, (why, off) in table.items():
        if name in body and not off(body[name]):
            raise ApiError(ErrorKind.UNSUPPORTED, f"`{prefix}{name}`: {why}", param=prefix + name)

