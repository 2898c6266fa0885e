"""responses_output.OutputBuilder on its own: the chat path's generated text, in any fragments, becomes
the same Responses items and the same event sequence as OpenAI's, whichever way the text is cut. The
served tests (test_responses_api.py) see only what SmolLM2 writes; here are the mixes it seldom does: text
before calls, two calls, a call cut short, nothing at all."""

from __future__ import annotations

import pytest

from llmbus.frontend.responses_output import OutputBuilder

TEXT_THEN_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')


def _build(text: str, tools: bool, pieces: int, status: str = "completed") -> OutputBuilder:
    builder = OutputBuilder(tools)
    step = max(len(text) // pieces, 1)
    for i in range(0, len(text), step):
        builder.feed(text[i:i + step])
    builder.finish(status)
    return builder


def _collapse(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


@pytest.mark.parametrize("pieces", [1, 7, len(TEXT_THEN_CALLS)])
def test_text_then_two_calls(pieces):
    builder = _build(TEXT_THEN_CALLS, tools=True, pieces=pieces)
    message, weather, time_ = builder.output
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (weather["name"], weather["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert (time_["name"], time_["arguments"]) == ("get_time", '{"timezone": "CET"}')
    assert weather["call_id"] != time_["call_id"] and weather["status"] == time_["status"] == "completed"
    events = builder.take_events()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert _collapse([e["type"] for e in events]) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", *call, *call]
    # each event names the item it belongs to, by id and by index
    for event in events:
        index = event["output_index"]
        assert event.get("item_id", event.get("item", {}).get("id")) == builder.output[index]["id"]
    # the deltas add up to the finished items
    for item in builder.output[1:]:
        assert "".join(e["delta"] for e in events if e.get("item_id") == item["id"] and "delta" in e) \
            == item["arguments"]


def test_a_call_cut_short_is_an_incomplete_item():
    text = TEXT_THEN_CALLS[:TEXT_THEN_CALLS.index("Paris")]
    builder = _build(text, tools=True, pieces=3, status="incomplete")
    message, call = builder.output
    assert message["status"] == "completed" and call["status"] == "incomplete"
    assert call["arguments"] == '{"city": "'


def test_without_tools_the_markup_is_text():
    builder = _build(TEXT_THEN_CALLS, tools=False, pieces=5)
    [message] = builder.output
    assert message["content"][0]["text"] == TEXT_THEN_CALLS


@pytest.mark.parametrize("tools", [False, True])
def test_no_text_at_all_is_one_empty_message(tools):
    builder = _build("", tools=tools, pieces=1)
    [message] = builder.output
    assert message["type"] == "message" and message["content"][0]["text"] == ""
    assert [e["type"] for e in builder.take_events()] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
