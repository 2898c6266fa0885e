"""The APIs' reasoning controls (frontend/thinking_controls.py): OpenAI's ``reasoning_effort``, the Responses
API's ``reasoning`` and Anthropic's ``thinking`` set a Qwen3 template's ``enable_thinking``, and
``chat_template_kwargs`` reaches the template on /v1/responses and /v1/messages as on chat completions.

Through the whole stack (``llmbus up`` on the tiny model with the Qwen3-like template of
``llmbus.testing.chat_formats``), with the ``openai`` and ``anthropic`` SDKs: the prompt each control renders
(``/chat_tokenize``'s text, and the routes' prompt token counts: thinking off adds the template's empty
section), what comes back (no reasoning when off), contradictions with ``chat_template_kwargs`` and bad
values. The templates without a switch (one that always reasons, one that does not reason) are checked on
the request parser, which the routes share."""

from __future__ import annotations

import json

import pytest

from llmbus.frontend.chat import ChatFormat
from llmbus.frontend.config import Limits
from llmbus.frontend.errors import ApiError
from llmbus.frontend.openai_requests import parse_chat
from llmbus.frontend.reasoning import find_markers, find_thinking_switch
from llmbus.frontend.sampling_defaults import SamplingDefaults
from llmbus.frontend.tool_formats import tool_format
from llmbus.testing.chat_formats import LLAMA31_TEMPLATE, QWEN3_TEMPLATE
from llmbus.testing.http import post

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
EMPTY_SECTION = "<think>\n\n</think>\n\n"  # what the Qwen3 template writes with thinking off
# a DeepSeek-R1-like template: it opens the section itself and has no switch (it always reasons)
ALWAYS_REASONS = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1] }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
# a Granite-like template: a switch and no markers llmbus reads
SWITCH_ONLY = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
               "{% if thinking %}Think first.{% endif %}<|assistant|>")
OFF = [("reasoning_effort", "none"), ("reasoning_effort", "minimal")]
ON = [("reasoning_effort", e) for e in ("low", "medium", "high", "xhigh")]


# --- the parser, on each kind of template ------------------------------------------------------------


def chat_format(template: str) -> ChatFormat:
    return ChatFormat(tool_format("auto", template), find_markers(template), {}, frozenset(),
                      find_thinking_switch(template))


def parse(template: str, **body):
    return parse_chat({"messages": QUESTION, **body}, Limits(100, 200, 1, 4, 5), 1, SamplingDefaults(),
                      chat_format(template))


def test_the_switch_is_what_the_template_reads():
    assert find_thinking_switch(QWEN3_TEMPLATE) == "enable_thinking"
    assert find_thinking_switch(SWITCH_ONLY) == "thinking"
    assert find_thinking_switch(ALWAYS_REASONS) is None and find_thinking_switch(LLAMA31_TEMPLATE) is None
    # a variable the template sets itself, or a message's field, is no switch
    assert find_thinking_switch("{% set thinking = true %}{{ thinking }}{{ messages[0].thinking }}") is None
    assert find_thinking_switch("{% generation %}{{ enable_thinking }}{% endgeneration %}") == "enable_thinking"


@pytest.mark.parametrize("field, value", OFF + ON)
def test_effort_sets_the_switch(field, value):
    on = value not in ("none", "minimal")
    assert parse(QWEN3_TEMPLATE, **{field: value}).template_kwargs == {"enable_thinking": on}
    assert parse(SWITCH_ONLY, **{field: value}).template_kwargs == {"thinking": on}
    assert parse(QWEN3_TEMPLATE, **{field: value}, chat_template_kwargs={"enable_thinking": on, "x": 1}
                 ).template_kwargs == {"enable_thinking": on, "x": 1}
    with pytest.raises(ApiError) as e:  # a contradiction names both
        parse(QWEN3_TEMPLATE, **{field: value}, chat_template_kwargs={"enable_thinking": not on})
    assert e.value.status == 422 and "`reasoning_effort`" in e.value.message
    assert "`chat_template_kwargs.enable_thinking` is " + json.dumps(not on) in e.value.message


def test_a_template_without_a_switch():
    """Markers without a switch always reason: on is what they do, off cannot be honoured. No markers and no
    switch: the model does not reason, and only off passes."""
    assert parse(ALWAYS_REASONS, reasoning_effort="high").template_kwargs is None
    assert parse(LLAMA31_TEMPLATE, reasoning_effort="none").template_kwargs is None
    for template, value, says in [(ALWAYS_REASONS, "none", "always reasons"),
                                  (ALWAYS_REASONS, "minimal", "always reasons"),
                                  (LLAMA31_TEMPLATE, "low", "does not reason")]:
        with pytest.raises(ApiError) as e:
            parse(template, reasoning_effort=value)
        assert e.value.status == 400 and e.value.param == "reasoning_effort" and says in e.value.message


@pytest.mark.parametrize("value", ["max", "", 3, True, ["high"]])
def test_an_effort_that_is_not_openais(value):
    with pytest.raises(ApiError) as e:
        parse(QWEN3_TEMPLATE, reasoning_effort=value)
    assert e.value.status == 422 and e.value.param == "reasoning_effort" and '"none"' in e.value.message


# --- the whole stack -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen3_chat_server):
    return qwen3_chat_server


@pytest.fixture(scope="module")
def openai_sdk(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_sdk(server):
    from anthropic import Anthropic

    return Anthropic(base_url=server.url, api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def section_tokens(server) -> int:
    """The prompt's text with thinking on (the template's default) and off, from /chat_tokenize; how many
    tokens the empty section adds."""
    def templated(**body):
        status, _, answer = post(server.url + "/chat_tokenize", {"messages": QUESTION, **body})
        assert status == 200, answer
        return answer["templated_text"], len(answer["tokenize_response"])

    default, default_count = templated()
    assert default.endswith("<|im_start|>assistant\n")
    assert templated(reasoning_effort="high") == (default, default_count)
    off, off_count = templated(reasoning_effort="none")
    assert off == default + EMPTY_SECTION and templated(chat_template_kwargs={"enable_thinking": False})[0] == off
    return off_count - default_count


def test_openai_chat_reasoning_effort(openai_sdk, section_tokens):
    def ask(**kwargs):
        return openai_sdk.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, temperature=0,
                                                  **kwargs)

    on, off = ask(reasoning_effort="low"), ask(reasoning_effort="none")
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == section_tokens > 0
    assert ask().usage.prompt_tokens == on.usage.prompt_tokens  # on is the template's default
    assert off.choices[0].message.reasoning_content is None  # the prompt closed the section
    assert ask(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
               ).usage.prompt_tokens == off.usage.prompt_tokens


def test_responses_reasoning_and_template_kwargs(openai_sdk, section_tokens):
    def ask(**kwargs):
        return openai_sdk.responses.create(model="tiny", input="Why is the sky blue?", max_output_tokens=2,
                                           temperature=0, **kwargs)

    on = ask(reasoning={"effort": "medium", "summary": "auto"})  # no summary is written: a no-op
    off = ask(reasoning={"effort": "none"})
    assert off.usage.input_tokens - on.usage.input_tokens == section_tokens
    assert on.reasoning.effort == "medium" and on.reasoning.summary == "auto" and off.reasoning.effort == "none"
    assert not [item for item in off.output if item.type == "reasoning"]
    kwargs_off = ask(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs_off.usage.input_tokens == off.usage.input_tokens


def test_anthropic_thinking_and_template_kwargs(anthropic_sdk, section_tokens):
    def count(**kwargs) -> int:
        return anthropic_sdk.messages.count_tokens(model="tiny", messages=QUESTION, **kwargs).input_tokens

    enabled = count(thinking={"type": "enabled", "budget_tokens": 1024})
    assert count(thinking={"type": "disabled"}) - enabled == section_tokens
    assert count() == count(thinking={"type": "adaptive"}) == enabled
    assert count(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == enabled + section_tokens
    message = anthropic_sdk.messages.create(model="tiny", messages=QUESTION, max_tokens=2,
                                            thinking={"type": "disabled"})
    assert message.usage.input_tokens == enabled + section_tokens
    assert [block.type for block in message.content] == ["text"]


@pytest.mark.parametrize("route, body, names", [
    ("/v1/chat/completions", {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
     ["`reasoning_effort`", "chat_template_kwargs.enable_thinking"]),
    ("/v1/chat/completions", {"reasoning_effort": "max"}, ["`reasoning_effort`"]),
    ("/v1/responses", {"reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}},
     ["`reasoning.effort`", "chat_template_kwargs.enable_thinking"]),
    ("/v1/responses", {"reasoning": {"summary": "long"}}, ["`reasoning.summary`"]),
    ("/v1/responses", {"chat_template_kwargs": {"add_generation_prompt": False}}, ["chat_template_kwargs"]),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 64},
                      "chat_template_kwargs": {"enable_thinking": False}},
     ["`thinking.type`", "chat_template_kwargs.enable_thinking"]),
    ("/v1/messages", {"thinking": {"type": "enabled"}}, ["`thinking.budget_tokens`"]),
    ("/v1/messages", {"thinking": {"type": "on"}}, ["`thinking.type`"]),
    ("/v1/messages", {"chat_template_kwargs": {"messages": []}}, ["chat_template_kwargs"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_and_contradicting_controls_name_the_fields(server, route, body, names):
    base = {"model": "tiny", "max_tokens": 2, "messages": QUESTION} if route != "/v1/responses" else \
        {"model": "tiny", "max_output_tokens": 2, "input": "hi"}
    headers = {"anthropic-version": "2023-06-01"} if route == "/v1/messages" else None
    status, _, answer = post(server.url + route, base | body, headers=headers)
    message = answer["error"]["message"]
    assert status in (400, 422) and all(name in message for name in names), answer
