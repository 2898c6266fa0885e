"""The APIs' reasoning controls set on the chat template's thinking switch (issue #38): OpenAI's chat
``reasoning_effort``, the Responses API's ``reasoning`` and Anthropic's ``thinking`` each ask for thinking
on or off, and a model whose template has a switch (Qwen3's ``enable_thinking``, reasoning.py
``THINKING_SWITCHES``) gets it set in the request's template variables, as if the client had sent
``chat_template_kwargs``.

- ``reasoning_effort`` / ``reasoning.effort``: ``"none"`` and ``"minimal"`` turn thinking off; ``"low"``,
  ``"medium"``, ``"high"`` and ``"xhigh"`` turn it on. A switch has no degrees: every effort that asks for
  reasoning is on, and ``"minimal"`` (OpenAI's "very few reasoning tokens", for the fastest first token) is
  off, the nearest a switch comes to it. The section's length is the model's.
- A template that reads an effort (gpt-oss's ``reasoning_effort``: "low", "medium", "high") gets the effort
  itself: ``"xhigh"`` is its "high" and ``"minimal"`` its "low" (such a model always reasons, so ``"none"`` is
  refused, as below).
- ``reasoning.summary`` (and the deprecated ``generate_summary``): a no-op where the model reasons; no
  summary is written, the whole section comes back as ``reasoning_text`` content instead (as vLLM answers).
- ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` and ``{"type": "adaptive"}`` on,
  ``{"type": "disabled"}`` off. ``budget_tokens`` must be an integer >= 1 but is not enforced: the section
  ends when the model ends it, within ``max_tokens`` (vLLM's Messages route ignores ``thinking`` whole).

A model reasons when its template writes thinking markers or has a switch (``ChatFormat.reasons``). For one
that does not, asking for reasoning is refused as before (400 naming the field) and "off" is accepted; a
template with markers but no switch always reasons (DeepSeek-R1), so "off" is refused there. A control and a
``chat_template_kwargs`` value of the switch that disagree are a validation error naming both. Values
outside an API's own are validation errors naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmbus.frontend.chat import ChatFormat
from llmbus.frontend.errors import ApiError, ErrorKind, validation_error

# reasoning_effort's values (OpenAI's), as thinking on or off
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}
# ... as the degree a template with an effort variable takes (gpt-oss's three), where it reasons at all
TEMPLATE_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
SUMMARIES = ("auto", "concise", "detailed")
THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


@dataclass(frozen=True)
class ThinkingAsk:
    """What a request's reasoning control asks for: thinking ``on`` (True), off (False), or reasoning output
    without a say on the switch (None: a summary alone); ``field`` names the control as the client wrote it,
    ``value`` its value as JSON."""

    on: bool | None
    field: str
    value: str
    effort: str | None = None  # an effort control's value ("low", ...), for a template that takes a degree


def _choice(value, field: str, allowed) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise validation_error(f"`{field}` must be one of {', '.join(json.dumps(a) for a in allowed)}. Given: "
                               f"{json.dumps(value)}", param=field)
    return value


def openai_effort(value, field: str = "reasoning_effort") -> ThinkingAsk | None:
    """OpenAI's ``reasoning_effort`` (chat completions), or the Responses API's ``reasoning.effort``."""
    if value is None:
        return None
    effort = _choice(value, field, EFFORTS)
    return ThinkingAsk(EFFORTS[effort], field, json.dumps(effort), effort)


def responses_reasoning(value) -> ThinkingAsk | None:
    """The Responses API's ``reasoning`` object: ``effort``, and ``summary`` (or ``generate_summary``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise validation_error(f"`reasoning` must be an object. Given: {json.dumps(value)}", param="reasoning")
    ask = openai_effort(value.get("effort"), "reasoning.effort")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            summary = _choice(value[key], f"reasoning.{key}", SUMMARIES)
            if ask is None:
                ask = ThinkingAsk(None, f"reasoning.{key}", json.dumps(summary))
    return ask


def anthropic_thinking(value) -> ThinkingAsk | None:
    """Anthropic's ``thinking``: ``{"type": "enabled", "budget_tokens": N}``, ``adaptive`` or ``disabled``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise validation_error(f'`thinking` must be an object ({{"type": "enabled", "budget_tokens": N}} or '
                               f'{{"type": "disabled"}}). Given: {json.dumps(value)}', param="thinking")
    kind = _choice(value.get("type"), "thinking.type", THINKING_TYPES)
    budget = value.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise validation_error(f"`thinking.budget_tokens` must be an integer >= 1 with `thinking.type` "
                               f'"enabled". Given: {json.dumps(budget)}', param="thinking.budget_tokens")
    return ThinkingAsk(THINKING_TYPES[kind], "thinking.type", json.dumps(kind))


def apply_thinking(ask: ThinkingAsk | None, chat_format: ChatFormat | None,
                   template_kwargs: dict | None) -> dict | None:
    """The request's template variables with its control set on the model's thinking switch; refused where
    the model cannot do what it asks. ``chat_format`` None: a model that does not reason."""
    if ask is None:
        return template_kwargs
    if chat_format is None or not chat_format.reasons:
        if ask.on is False:
            return template_kwargs
        raise ApiError(ErrorKind.UNSUPPORTED, f"`{ask.field}`: the served model does not reason (its chat template "
                                              f"has no thinking markers or switch)", param=ask.field)
    degree = TEMPLATE_EFFORTS.get(ask.effort) if chat_format.effort_variable else None
    if degree is not None and chat_format.thinking_switch is None:
        return _set_variable(template_kwargs, chat_format.effort_variable, degree, ask)
    switch = chat_format.thinking_switch
    if ask.on is None or switch is None and ask.on:
        return template_kwargs
    if switch is None:
        raise ApiError(ErrorKind.UNSUPPORTED, f"`{ask.field}` {ask.value} asks for no reasoning, but the served "
                                              f"model always reasons: its chat template has no switch to turn "
                                              f"thinking off", param=ask.field)
    given = (template_kwargs or {}).get(switch, ask.on)
    if given is not ask.on:
        raise validation_error(f"`{ask.field}` {ask.value} turns thinking {'on' if ask.on else 'off'}, but "
                               f"`chat_template_kwargs.{switch}` is {json.dumps(given)}: set one of them",
                               param=ask.field)
    return {**(template_kwargs or {}), switch: ask.on}


def _set_variable(template_kwargs: dict | None, name: str, value: str, ask: ThinkingAsk) -> dict:
    """The request's template variables with ``name`` set to ``value``; a ``chat_template_kwargs`` value that
    disagrees is a validation error naming both."""
    given = (template_kwargs or {}).get(name, value)
    if given != value:
        raise validation_error(f"`{ask.field}` {ask.value} sets the template's {name} to {json.dumps(value)}, but "
                               f"`chat_template_kwargs.{name}` is {json.dumps(given)}: set one of them",
                               param=ask.field)
    return {**(template_kwargs or {}), name: value}
