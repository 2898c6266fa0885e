"""OpenAI's Responses API (``/v1/responses``) through the whole stack on SmolLM2-135M-Instruct, with the
``openai`` SDK as clients use it (its pydantic models parse every body and event, so a shape the SDK
does not know fails here): plain, streamed (the exact event order), function tools (``required`` and
named), ``text.format`` json_schema, two kinds of second turn, the store (GET, DELETE, 404) and the errors.
The OpenAI Agents SDK's default model class (Responses) runs an agent with one tool to a final answer.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmbus.testing.http import get, post

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "description": "Current time in a timezone",
          "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                         "required": ["timezone"], "additionalProperties": False}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture
def sdk(smollm2_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="-")


def create(sdk, **kwargs):
    return sdk.responses.create(**{"model": "tgi", "temperature": 0, "max_output_tokens": 40, **kwargs})


def test_plain_text_answer_and_the_store(sdk, smollm2_server):
    answer = create(sdk, input="What is the capital of France?", instructions="Answer in one sentence.",
                    metadata={"case": "plain"}, user="u1")
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.status == "completed"
    assert answer.incomplete_details is None and answer.error is None
    [message] = answer.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    assert "Paris" in answer.output_text
    usage = answer.usage
    assert usage.input_tokens > 10 and 0 < usage.output_tokens <= 40
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert (answer.instructions, answer.metadata, answer.user) == ("Answer in one sentence.", {"case": "plain"},
                                                                   "u1")
    # what the chat route answers for the same conversation: one engine path under both
    chat = sdk.chat.completions.create(model="tgi", temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == answer.output_text
    assert chat.usage.prompt_tokens == usage.input_tokens

    assert sdk.responses.retrieve(answer.id).model_dump() == answer.model_dump()
    sdk.responses.delete(answer.id)
    for call in (lambda: sdk.responses.retrieve(answer.id), lambda: sdk.responses.delete(answer.id)):
        from openai import NotFoundError

        with pytest.raises(NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{answer.id}' not found."


def test_max_output_tokens_makes_it_incomplete_and_store_false_keeps_nothing(sdk, smollm2_server):
    from openai import NotFoundError

    answer = create(sdk, input="Write a long story about a dragon.", max_output_tokens=5, store=False)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 5 and answer.output[0].status == "incomplete"
    with pytest.raises(NotFoundError):
        sdk.responses.retrieve(answer.id)
    assert (answer.temperature, answer.top_p) == (0, answer.top_p) and answer.top_p is not None
    # unset, the sampling values are the ones used, never null: this model's defaults (/info's) decode greedily
    status, info = get(f"{smollm2_server.url}/info")
    assert info["sampling_defaults"]["do_sample"] is False
    unset = sdk.responses.create(model="tgi", input="Hi", max_output_tokens=2, store=False)
    assert (unset.temperature, unset.top_p) == (0.0, 1.0)
    sampled = sdk.responses.create(model="tgi", input="Hi", max_output_tokens=2, store=False, temperature=0.7)
    assert (sampled.temperature, sampled.top_p) == (0.7, info["sampling_defaults"]["top_p"])
    # a long prompt twice: the second finds its full KV blocks in the prefix cache, and usage says so
    instructions = "You are a storyteller who writes about dragons, castles and knights. " * 20
    first, again = (create(sdk, input="Begin.", instructions=instructions, max_output_tokens=1) for _ in range(2))
    assert first.usage.input_tokens == again.usage.input_tokens > 200
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


EVENTS_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def _collapse(types: list[str]) -> list[str]:
    """The event types with runs of deltas written once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_streamed_events_in_order_add_up_to_the_whole_answer(sdk):
    question = "What is the capital of France?"
    events = list(create(sdk, input=question, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _collapse([e.type for e in events]) == EVENTS_TEXT
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text and "Paris" in done.text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert final.status == "completed" and final.output_text == done.text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # the same text as the whole answer
    assert create(sdk, input=question).output_text == done.text


@pytest.mark.parametrize("choice,name", [("required", None), ({"type": "function", "name": "get_time"}, "get_time")],
                         ids=["required", "named"])
def test_function_calls_whole_and_streamed(sdk, choice, name):
    answer = create(sdk, input=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                    max_output_tokens=80)
    assert answer.status == "completed"
    [call] = answer.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert name is None or call.name == name
    schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    assert answer.tool_choice == choice if isinstance(choice, str) else answer.tool_choice.name == name

    events = list(create(sdk, input=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                         max_output_tokens=80, stream=True))
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.arguments == "" and added.name == call.name and added.call_id == done.call_id
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert fragments == done.arguments == events[-3].arguments == call.arguments  # greedy: the same call


def test_text_format_json_schema(sdk):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    answer = create(sdk, input="Name a big city and its population as JSON.", max_output_tokens=60,
                    text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert answer.status == "completed" and answer.text.format.type == "json_schema"
    jsonschema.validate(json.loads(answer.output_text), schema)


def test_second_turns_previous_response_id_and_function_call_output(sdk):
    first = create(sdk, input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, max_output_tokens=80)
    [call] = first.output
    # turn 2 through the store: only the tool's result is sent
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    # tool_choice none: greedy, the 135M model would go on calling; this turn is about reading the result
    second = create(sdk, previous_response_id=first.id, input=[result], tools=TOOLS, tool_choice="none",
                    max_output_tokens=60)
    assert second.previous_response_id == first.id and second.status == "completed"
    # turn 2 stateless: the whole conversation as input items, the call fed back as the SDK returned it
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
    again = create(sdk, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=60, store=False)
    assert again.output_text == second.output_text and again.usage.input_tokens == second.usage.input_tokens
    assert "21" in again.output_text  # the model read the tool's result

    third = create(sdk, previous_response_id=second.id, input="Thanks! And in Fahrenheit?")
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


@pytest.mark.parametrize("body,status,param,words", [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools", "built-in tools (web_search_preview)"),
    ({"input": "hi", "tools": [{"type": "mcp", "server_label": "x"}]}, 400, "tools", "built-in tools (mcp)"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, 400, "tool_choice", "file_search"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "response_id", "resp_nope"),
    ({}, 422, "input", "`input` is required"),
    ({"input": "hi", "max_output_tokens": 0}, 422, "max_output_tokens", ">= 1"),
    ({"input": "hi", "temperature": 3}, 422, "temperature", "<= 2"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 422, "input", "role"),
    ({"input": [{"role": {}, "content": "hi"}]}, 422, "input", "role"),  # was a 500 (schemathesis)
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 422, "text", "text.format.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, 422, "input",
     "`input[0].output` must be a string or an array of content parts"),
    ({"input": "hi", "tools": [{"type": "function"}]}, 422, "tools", "`tools[0].name` must be a non-empty string"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 422, "input", "reasoning items alone"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 422, None,
     "Tool with name nope not found"),
], ids=lambda v: None)
def test_bad_requests_are_openai_errors(smollm2_server, body, status, param, words):
    got, _, answer = post(smollm2_server.url + "/v1/responses", {"model": "tgi", **body})
    assert got == status, answer
    error = answer["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_ids_are_404s_in_openai_envelope(smollm2_server):
    status, answer = get(smollm2_server.url + "/v1/responses/resp_missing")
    assert status == 404 and answer["error"]["type"] == "invalid_request_error", answer


def test_agents_sdk_runs_a_tool_loop_to_a_final_answer(smollm2_server):
    """The Agents SDK's default model class is OpenAIResponsesModel: its loop calls the tool the model
    asks for, sends the result back as a function_call_output item, and ends on the text answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    client = AsyncOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="-")
    agent = Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                  tools=[get_weather], model=OpenAIResponsesModel("tgi", client),
                  # The first turn must call the tool, once (with parallel calls the grammar lets the 135M
                  # model call again and again); the SDK then resets tool_choice, so the next turn may
                  # answer. presence_penalty: greedy, that model otherwise repeats the tool instruction it
                  # was shown until max_tokens (an incomplete response, which the SDK raises on).
                  model_settings=ModelSettings(temperature=0, max_tokens=80, presence_penalty=1.5,
                                               tool_choice="required", parallel_tool_calls=False))
    result = Runner.run_sync(agent, QUESTION, max_turns=4, run_config=RunConfig(tracing_disabled=True))
    assert calls and isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"


def test_answers_match_the_openapi_document(smollm2_server):
    """A real answer and every event of a real stream validate against the served document's schemas
    (schemathesis fuzzes the route on the tiny model; this checks SmolLM2's tool-calling answers too)."""
    from llmbus.frontend.openapi import SPEC_PATH
    from llmbus.testing.http import stream

    _, spec = get(smollm2_server.url + SPEC_PATH)
    post_op = spec["paths"]["/v1/responses"]["post"]
    assert "text/event-stream" in post_op["responses"]["200"]["content"]
    assert {"400", "404", "422"} <= set(post_op["responses"])
    for method in ("get", "delete"):
        assert spec["paths"]["/v1/responses/{response_id}"][method]["security"] == [{"bearer": []}, {}]

    def check(name: str, body) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
        jsonschema.Draft202012Validator(schema).validate(body)

    body = {"model": "tgi", "input": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "parallel_tool_calls": False, "max_output_tokens": 80}
    status, _, answer = post(smollm2_server.url + "/v1/responses", body)
    assert status == 200, answer
    check("ResponsesRequest", body)
    check("ResponseObject", answer)
    raw = stream(smollm2_server.url + "/v1/responses", {**body, "stream": True}).decode()
    blocks = [b.split("\n") for b in raw.split("\n\n") if b]
    # OpenAI's SSE shape: each event names its type on an `event:` line, then its JSON on one `data:` line
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), raw
    events = [json.loads(b[1][len("data: "):]) for b in blocks]
    assert [b[0][len("event: "):] for b in blocks] == [e["type"] for e in events]
    assert events[-1]["type"] == "response.completed"
    for event in events:
        check("ResponseStreamEvent", event)


def test_requests_count_on_metrics_by_route(smollm2_server):
    from llmbus.testing.http import metrics

    before = metrics(smollm2_server.url, labels=True)
    assert post(smollm2_server.url + "/v1/responses", {"input": "Hi", "max_output_tokens": 2})[0] == 200
    assert post(smollm2_server.url + "/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]})[0] == 400
    after = metrics(smollm2_server.url, labels=True)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('llmbus_request_route_count{route="/v1/responses"}') == 2
    assert grew("tgi_request_success") == 1 and grew('tgi_request_failure{err="validation"}') == 1


def test_readme_example_names_paris(smollm2_server):
    """The README's curl example, its body read from the README itself, answers as it says."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("<!-- responses-example -->", 1)[1].split("<!-- /responses-example -->", 1)[0]
    assert "localhost:3000/v1/responses" in block
    body = json.loads(re.search(r"-d '(.*)'", block).group(1))
    status, _, answer = post(smollm2_server.url + "/v1/responses", body)
    assert status == 200 and answer["status"] == "completed", answer
    assert "Paris" in answer["output"][0]["content"][0]["text"]
