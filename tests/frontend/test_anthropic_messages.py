"""Anthropic's Messages API through the whole stack on SmolLM2-135M-Instruct, with the ``anthropic`` SDK as
clients use it: plain and streamed answers (the events in Anthropic's order), stop reasons, tools with
``tool_choice`` any and named (inputs validate against ``input_schema``), a ``tool_result`` turn, and
``count_tokens``. The route runs on the chat path, so its answers must be the chat route's, token for token.

SmolLM2's generation_config.json decodes greedily unless a request samples, so answers are deterministic.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from llmbus.testing.http import post

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Current time in a timezone", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SYSTEM = "Answer briefly."
LONG_SYSTEM = "You are a geography teacher. " * 20 + SYSTEM  # over a KV block (64 tokens) of prompt
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(smollm2_server):
    from anthropic import Anthropic

    return Anthropic(base_url=smollm2_server.url, api_key="-", max_retries=0)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def check_tool_uses(message) -> list[tuple[str, dict]]:
    """(name, input) of each tool_use block, every input valid against its tool's input_schema, ids unique."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len({u.id for u in uses}) == len(uses) and all(u.id.startswith("toolu_") for u in uses)
    for use in uses:
        assert isinstance(use.input, dict)
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return [(u.name, u.input) for u in uses]


def test_create_answers_as_the_chat_route_does(client, smollm2_server):
    # the same conversation on /v1/chat/completions first: same template, same defaults, same tokens; and
    # its prompt (longer than a KV block, with LONG_SYSTEM) is then in the prefix cache
    _, _, chat = post(f"{smollm2_server.url}/v1/chat/completions", {
        "messages": [{"role": "system", "content": LONG_SYSTEM}, *QUESTION], "max_tokens": 30})
    message = client.messages.create(model="smollm2", max_tokens=30, system=LONG_SYSTEM, messages=QUESTION)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert _text(message) == chat["choices"][0]["message"]["content"]
    usage = message.usage
    assert usage.output_tokens == chat["usage"]["completion_tokens"]
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0


def test_system_as_blocks_and_content_as_blocks_are_the_strings(client):
    plain = client.messages.create(model="m", max_tokens=12, system=SYSTEM, messages=QUESTION)
    blocks = client.messages.create(
        model="m", max_tokens=12, system=[{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}])
    assert _text(blocks) == _text(plain)


def _raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        raw = resp.read().decode()
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = re.fullmatch(r"event: (\w+)\ndata: (.*)", block, re.S).groups()
        events.append((name, json.loads(data)))
        assert events[-1][1]["type"] == name  # Anthropic repeats the event's name as the data's type
    return events


def test_stream_events_come_in_anthropics_order(client, smollm2_server):
    body = {"model": "m", "max_tokens": 30, "messages": QUESTION, "stream": True}
    events = _raw_events(f"{smollm2_server.url}/v1/messages", body)
    names = " ".join(name for name, _ in events)
    assert re.fullmatch(r"message_start ping content_block_start( content_block_delta)+ content_block_stop "
                        r"message_delta message_stop", names), names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    delta = events[-2][1]
    whole = client.messages.create(model="m", max_tokens=30, messages=QUESTION)
    assert text == _text(whole)
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's own accumulation of the stream gives the same message
    with client.messages.stream(model="m", max_tokens=30, messages=QUESTION) as stream:
        final = stream.get_final_message()
    assert _text(final) == text and final.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_and_max_tokens(client, stream):
    def ask(**kwargs):
        if not stream:
            return client.messages.create(model="m", messages=QUESTION, **kwargs)
        with client.messages.stream(model="m", messages=QUESTION, **kwargs) as s:
            return s.get_final_message()

    full = _text(ask(max_tokens=30))
    assert "Paris" in full
    stopped = ask(max_tokens=30, stop_sequences=["nothing like this", "Paris"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert _text(stopped) == full[:full.index("Paris")]  # the sequence itself is not shown
    cut = ask(max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_calls_a_tool_with_valid_input(client, stream):
    kwargs = {"model": "m", "max_tokens": 80, "messages": WEATHER_QUESTION, "tools": TOOLS,
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    if stream:
        with client.messages.stream(**kwargs) as s:
            kinds = [e.type for e in s]
            message = s.get_final_message()
        assert "input_json" in kinds  # the arguments came as input_json_delta fragments
    else:
        message = client.messages.create(**kwargs)
    calls = check_tool_uses(message)
    assert [name for name, _ in calls] == ["get_weather"] and calls[0][1]["city"] == "Paris"
    assert message.stop_reason == "tool_use"


def test_named_tool_streamed_equals_whole(client):
    kwargs = {"model": "m", "max_tokens": 80, "messages": WEATHER_QUESTION, "tools": TOOLS,
              "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as s:
        streamed = s.get_final_message()
    assert [name for name, _ in check_tool_uses(whole)] == ["get_time"]
    assert check_tool_uses(streamed) == check_tool_uses(whole)
    assert whole.stop_reason == streamed.stop_reason == "tool_use"


def test_tool_choice_none_answers_in_text(client):
    message = client.messages.create(model="m", max_tokens=20, messages=WEATHER_QUESTION, tools=TOOLS,
                                     tool_choice={"type": "none"})
    assert [b.type for b in message.content] == ["text"] and message.stop_reason in ("end_turn", "max_tokens")


def test_tool_result_turn_renders_as_the_chat_route_does(client, smollm2_server):
    first = client.messages.create(model="m", max_tokens=80, messages=WEATHER_QUESTION, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    conversation = [*WEATHER_QUESTION, first.to_param(),
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": use.id,
                         "content": [{"type": "text", "text": "22 degrees and sunny"}]},
                        {"type": "text", "text": "Answer in one sentence."}]}]
    answer = client.messages.create(model="m", max_tokens=40, messages=conversation, tools=TOOLS)
    assert answer.content and answer.stop_reason in ("end_turn", "tool_use", "max_tokens")
    # the same turn in OpenAI's words: the tool's answer reached the model exactly as on the chat route
    openai_messages = [*WEATHER_QUESTION,
                       {"role": "assistant", "content": None, "tool_calls": [{
                           "id": use.id, "type": "function",
                           "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                       {"role": "tool", "tool_call_id": use.id, "content": "22 degrees and sunny"},
                       {"role": "user", "content": "Answer in one sentence."}]
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in TOOLS]
    _, _, rendered = post(f"{smollm2_server.url}/chat_tokenize", {"messages": openai_messages, "tools": openai_tools})
    assert "<tool_response>\n22 degrees and sunny\n</tool_response>" in rendered["templated_text"]
    counted = client.messages.count_tokens(model="m", messages=conversation, tools=TOOLS)
    assert counted.input_tokens == len(rendered["tokenize_response"])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens


def test_count_tokens_is_the_prompts_token_count(client, smollm2_server):
    counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=QUESTION)
    _, _, rendered = post(f"{smollm2_server.url}/chat_tokenize",
                          {"messages": [{"role": "system", "content": SYSTEM}, *QUESTION]})
    assert counted.input_tokens == len(rendered["tokenize_response"]) > 10
    message = client.messages.create(model="m", max_tokens=2, system=SYSTEM, messages=QUESTION)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens
    with_tools = client.messages.count_tokens(model="m", system=SYSTEM, messages=QUESTION, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens  # the tools are part of the prompt


def test_a_bad_request_is_anthropics_error(client):
    from anthropic import BadRequestError

    with pytest.raises(BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert raised.value.status_code == 400
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "`messages[0].content[0]` is image content" in body["error"]["message"]
    with pytest.raises(BadRequestError, match="Tool with name nope not found"):
        client.messages.create(model="m", max_tokens=10, messages=QUESTION, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})


def test_the_readme_curl_answers(smollm2_server):
    """The README's /v1/messages curl, exactly as a new user pastes it, names Paris."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"curl -s localhost:3000/v1/messages .*?-d '(\{.*?\})'", readme, re.S)
    assert found, "README.md has no /v1/messages curl"
    status, _, answer = post(f"{smollm2_server.url}/v1/messages", json.loads(found.group(1)),
                             headers={"anthropic-version": "2023-06-01"})
    assert status == 200 and "Paris" in answer["content"][0]["text"], answer
