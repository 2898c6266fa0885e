"""The families' chat formats through the whole stack (``llmbus up``) with the ``openai`` SDK: tool calls in
the Qwen3 (Hermes), Llama 3.1 and Mistral syntaxes, streamed and not, and Qwen3's reasoning sections split
into ``reasoning_content``, with ``enable_thinking`` on and off and with a JSON-schema answer after them.

The model is the demo ``tiny`` one with the families' marker tokens and each family's template
(``llmbus.testing.chat_formats``): random weights, so grammars (a required or named tool choice, a
response_format) hold the shape, and what the model wrote is read back from the logprobs' token texts
(special tokens included) to check the split exactly.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from llmbus.supervisor.demo_model import SPECIAL_TOKENS
from llmbus.testing.chat_formats import set_template

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "now": {"type": "boolean"}},
           "required": ["unit", "now"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
          "required": ["ok", "size"]}
# what the raw answer of one call looks like in each family's syntax
CALL_SHAPES = {"qwen3": r'<tool_call>\n\{"name": "\w+", "arguments": \{.*\}\}\n</tool_call>\n?',
               "llama3_1": r'(<\|python_tag\|>)?\{"name": "\w+", "parameters": \{.*\}\}',
               "mistral": r'\[TOOL_CALLS\]\[\{"name": "\w+", "arguments": \{.*\}\}\]'}


@pytest.fixture(scope="module")
def servers(chat_format_model_dir, tmp_path_factory, request):
    """(family, more flags) -> an SDK client of a server on the model with that family's template (started
    when first asked; Qwen3's without flags is the session's, which test_reasoning_controls.py shares)."""
    from openai import OpenAI

    from llmbus.testing import Server, stop_all

    started, clients = [], {}

    def client(family: str, *flags: str):
        if (family, flags) not in clients:
            if (family, flags) == ("qwen3", ()):
                server = request.getfixturevalue("qwen3_chat_server")
            else:
                folder = tmp_path_factory.mktemp(family) / "model"
                shutil.copytree(chat_format_model_dir, folder)
                server = Server(["--model-id", str(set_template(folder, family)), "--dtype", "float32",
                                 "--max-total-tokens", "1024", *flags])
                started.append(server)
            clients[family, flags] = OpenAI(base_url=f"{server.url}/v1", api_key="-")
        return clients[family, flags]

    yield client
    for server, status in zip(started, stop_all(started)):
        assert status == 0, server.stderr.text[-3000:]


def ask(sdk, **kwargs):
    return sdk.chat.completions.create(**{"model": "tiny", "messages": QUESTION, "max_tokens": 80, "temperature": 0,
                                          **kwargs})


def raw_text(answer) -> str:
    """What the model wrote: its tokens' bytes joined (a token may end inside a character), markers included,
    not the demo tokenizer's own special tokens (its end of sequence, ChatML's), which no answer shows."""
    return b"".join(bytes(t.bytes) for t in answer.choices[0].logprobs.content
                    if t.token not in SPECIAL_TOKENS).decode("utf-8", errors="replace")


def streamed(sdk, **kwargs) -> tuple[str | None, str, dict, str]:
    """(reasoning, content, {index: [name, arguments]}, finish_reason) rebuilt from a stream's deltas; a
    delta carries one kind of text only."""
    reasoning, content, calls, finish = None, "", {}, None
    for chunk in ask(sdk, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        think = getattr(delta, "reasoning_content", None)
        assert not (think and (delta.content or delta.tool_calls)), delta
        if think:
            reasoning = (reasoning or "") + think
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.function.name and call.function.arguments == ""
                calls[call.index] = [call.function.name, ""]
            else:
                calls[call.index][1] += call.function.arguments
    return reasoning, content, calls, finish


def check_call(calls) -> tuple[str, dict]:
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    name, arguments = calls[0].function.name, json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, SCHEMAS[name])
    return name, arguments


@pytest.mark.parametrize("family", sorted(CALL_SHAPES))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_tool_calls_in_the_familys_syntax(servers, family, choice):
    sdk = servers(family)
    kwargs = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
              "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    answer = ask(sdk, logprobs=True, **kwargs)
    raw = raw_text(answer)
    assert re.fullmatch(CALL_SHAPES[family], raw, re.S), raw
    message = answer.choices[0].message
    name, arguments = check_call(message.tool_calls)
    assert name == "get_time" or choice == "required"
    finish_reason = "tool_calls" if choice == "required" else "stop"  # OpenAI's for a named function
    assert not message.content and answer.choices[0].finish_reason == finish_reason
    assert getattr(message, "reasoning_content", None) is None
    reasoning, content, calls, finish = streamed(sdk, **kwargs)
    assert (reasoning, content, finish) == (None, "", finish_reason)
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(name, arguments)]


def test_the_tool_call_parser_flag_overrides_the_template(servers):
    sdk = servers("qwen3", "--tool-call-parser", "mistral")
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    answer = ask(sdk, logprobs=True, **kwargs)
    assert re.fullmatch(CALL_SHAPES["mistral"], raw_text(answer), re.S), raw_text(answer)
    check_call(answer.choices[0].message.tool_calls)


@pytest.mark.parametrize("family", ["llama3_1", "mistral"])
def test_families_without_thinking_markers_answer_in_content(servers, family):
    answer = ask(servers(family), logprobs=True, max_tokens=12)
    message = answer.choices[0].message
    assert message.content == raw_text(answer) and not hasattr(message, "reasoning_content")


def test_reasoning_split_when_the_prompt_opens_a_section(servers):
    sdk = servers("qwen3")
    kwargs = {"extra_body": {"chat_template_kwargs": {"open_thinking": True}}, "max_tokens": 40}
    answer = ask(sdk, logprobs=True, **kwargs)
    raw, message = raw_text(answer), answer.choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert isinstance(reasoning, str) and "</think>" not in reasoning and content
    assert raw.startswith(reasoning + "</think>") and raw.endswith(content)
    assert raw[len(reasoning) + len("</think>"):len(raw) - len(content)].strip() == ""
    assert streamed(sdk, **kwargs) == (reasoning, content, {}, answer.choices[0].finish_reason)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_enable_thinking_reaches_the_template(servers, enable_thinking):
    """The template writes an empty section when thinking is off: the answer is all content, even what looks
    like a marker. On, the model may open a section (this one does not unconstrained): its text is content
    unless it begins with <think>."""
    sdk = servers("qwen3")
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": enable_thinking}}, "max_tokens": 30}
    answer = ask(sdk, logprobs=True, **kwargs)
    raw, message = raw_text(answer), answer.choices[0].message
    if enable_thinking and raw.lstrip().startswith("<think>"):
        assert message.reasoning_content is not None
    else:
        assert message.reasoning_content is None and message.content == raw
    if not enable_thinking:
        assert "</think>" in raw  # the tiny model writes the marker often: it stays content here
    assert streamed(sdk, **kwargs) == (message.reasoning_content, message.content, {},
                                       answer.choices[0].finish_reason)


@pytest.mark.parametrize("kwargs", [{"open_thinking": True}, {"enable_thinking": True}, {"enable_thinking": False}],
                         ids=["inside", "may-open", "off"])
def test_json_schema_answer_after_reasoning_validates(servers, kwargs):
    sdk = servers("qwen3")
    request = {"extra_body": {"chat_template_kwargs": kwargs},
               "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
    answer = ask(sdk, logprobs=True, **request)
    raw, message = raw_text(answer), answer.choices[0].message
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert answer.choices[0].finish_reason == "stop"
    reasoning = message.reasoning_content
    if "open_thinking" in kwargs:
        assert isinstance(reasoning, str)
    if kwargs.get("enable_thinking") is False:
        assert reasoning is None and raw == message.content
    if reasoning is not None:  # the section, free text, then the answer the schema held
        opened = "" if "open_thinking" in kwargs else "<think>"
        assert raw.startswith(opened + reasoning + "</think>") and raw.endswith(message.content)
    assert streamed(sdk, **request) == (reasoning, message.content, {}, "stop")


def test_a_tool_call_after_a_reasoning_section(servers):
    sdk = servers("qwen3")
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              "extra_body": {"chat_template_kwargs": {"open_thinking": True}}}
    answer = ask(sdk, logprobs=True, **kwargs)
    message = answer.choices[0].message
    assert isinstance(message.reasoning_content, str) and not message.content
    name, arguments = check_call(message.tool_calls)
    reasoning, content, calls, finish = streamed(sdk, **kwargs)
    # (an empty section has no delta to stream)
    assert (reasoning or "", content, finish) == (message.reasoning_content, "", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(name, arguments)]


def test_chat_template_kwargs_may_not_replace_the_renderers_variables(servers):
    from openai import BadRequestError, UnprocessableEntityError

    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"eos_token": "x"}):
        with pytest.raises((BadRequestError, UnprocessableEntityError)) as e:
            ask(servers("qwen3"), extra_body={"chat_template_kwargs": kwargs})
        assert "chat_template_kwargs" in str(e.value)
