"""Tool calling through the whole stack on SmolLM2-135M-Instruct, with the ``openai`` SDK as clients use it:
every ``tool_choice``, streamed and not, parallel calls, a second turn with the tool's result, and the
errors. Arguments must parse and validate against the function's schema, and a stream's deltas must follow
OpenAI's shape exactly and add up to the same calls a whole answer gives.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmbus.testing.http import post

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def sdk(smollm2_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="-")


def ask(sdk, messages=QUESTION, **kwargs):
    kwargs = {"model": "tgi", "messages": messages, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **kwargs}
    return sdk.chat.completions.create(**kwargs)


def check_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI tool calls, each valid against its function's schema, ids unique."""
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    out = []
    for call in calls:
        assert call.type == "function" and isinstance(call.function.arguments, str)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(sdk, **kwargs):
    """(content, calls as [(name, arguments text)], finish_reason) rebuilt from a stream's deltas, checking
    OpenAI's shape: a call's first delta has its index, id, type and name with empty arguments; later
    deltas of it carry only argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in ask(sdk, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, delta
                assert delta.function.arguments == ""
                calls[delta.index] = [delta.id, delta.function.name, ""]
            else:
                assert delta.id is None and delta.type is None and delta.function.name is None, delta
                calls[delta.index][2] += delta.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(name, args) for _, name, args in calls.values()], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_whole_and_streamed(sdk, choice):
    answer = ask(sdk, tool_choice=choice, parallel_tool_calls=False)
    message = answer.choices[0].message
    # OpenAI's reasons: "tool_calls" for a required call, "stop" for a named one
    expected_finish = "stop" if isinstance(choice, dict) else "tool_calls"
    assert answer.choices[0].finish_reason == expected_finish and message.content is None, answer
    [(name, arguments)] = check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert name == "get_time"
    content, calls, finish = streamed(sdk, tool_choice=choice, parallel_tool_calls=False)
    assert finish == expected_finish and content == ""
    assert [(n, json.loads(a)) for n, a in calls] == [(name, arguments)]  # greedy: the same call
    assert calls[0][1] == message.tool_calls[0].function.arguments  # fragments add up to the exact text


def test_parallel_calls_all_validate(sdk):
    answer = ask(sdk, tool_choice="required", max_tokens=90)
    calls = answer.choices[0].message.tool_calls
    assert calls, answer
    check_calls(calls)  # each one whole; a call cut by max_tokens is not reported
    _, streamed_calls, _ = streamed(sdk, tool_choice="required", max_tokens=90)
    # a stream may also have begun a call that max_tokens cut (its deltas went out before the cut)
    assert [(n, json.loads(a)) for n, a in streamed_calls[:len(calls)]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_auto_answers_in_text_or_calls_and_none_never_calls(sdk):
    answer = ask(sdk, tool_choice="auto", max_tokens=40)
    message = answer.choices[0].message
    if message.tool_calls:
        check_calls(message.tool_calls)
        assert answer.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert "<tool_call>" not in message.content and message.content.strip(), message
    content, calls, _ = streamed(sdk, tool_choice="auto", max_tokens=40)
    assert content == (message.content or "") and len(calls) >= len(message.tool_calls or [])
    answer = ask(sdk, tool_choice="none", max_tokens=30)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    content, calls, _ = streamed(sdk, tool_choice="none", max_tokens=30)
    assert calls == [] and content == answer.choices[0].message.content


def test_second_turn_with_the_tool_result(sdk, smollm2_server):
    first = ask(sdk, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    second = ask(sdk, messages=messages, max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _, _, rendered = post(f"{smollm2_server.url}/chat_tokenize", {"messages": messages, "tools": TOOLS})
    text = rendered["templated_text"]
    assert call.function.arguments in text and '{"temperature": 18}' in text  # the call and its result
    assert text.index(call.function.arguments) < text.index('{"temperature": 18}')


def test_tool_errors_are_422_and_the_server_keeps_serving(smollm2_server):
    url = f"{smollm2_server.url}/v1/chat/completions"
    cases = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "Tool error: Tool with name nope not found"),
             ({"response_format": {"type": "json_object"}}, "Tool error: Grammar and tools are mutually exclusive"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}]},
              "Tool error: invalid parameters schema of f"),
             ({"tools": [{"type": "retrieval"}]}, "Input validation error: `tools[0]` must be an object")]
    for extra, message in cases:
        status, _, body = post(url, {"messages": QUESTION, "tools": TOOLS, **extra})
        assert status == 422 and body["error"]["message"].startswith(message), body
    status, _, body = post(url, {"messages": QUESTION, "max_tokens": 5})
    assert status == 200, body
