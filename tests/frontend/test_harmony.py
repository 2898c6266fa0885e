"""gpt-oss's harmony format (``frontend/harmony.py``): answers read into reasoning, content and tool calls, in
one piece and streamed in fragments of any size; the grammars that hold a constrained answer to the format,
checked token by token with llguidance; the reasoning effort set on the template; and, through the whole
``llmbus up`` stack, a tiny model with harmony's special tokens and a gpt-oss-like template answering chat
requests with a JSON schema and with required tool calls, streamed or not."""

from __future__ import annotations

import json
import re

import pytest

from llmbus.frontend.errors import ApiError
from llmbus.frontend.harmony import HarmonyPlan, HarmonyStream, is_harmony
from llmbus.frontend.reasoning import AnswerParser, grammar_in_harmony, parse_answer
from llmbus.frontend.tools import parse_tools
from llmbus.testing.chat_formats import HARMONY_MARKERS, HARMONY_TEMPLATE

ANALYSIS_THEN_FINAL = ("<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
# the form OpenAI documents for a model's call, and the one the chat template writes in a history
CALL_AFTER_CHANNEL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                      '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                      '{"city": "Paris"}')
CALL_BEFORE_CHANNEL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def _pieces(text: str, calls: bool = True, size: int | None = None) -> list[tuple[str, str]]:
    """The stream's pieces over ``text`` fed ``size`` characters at a time, neighbours of a kind joined."""
    stream, out = HarmonyStream(calls), []
    for i in range(0, len(text), size or len(text) or 1):
        out += stream.feed(text[i:i + (size or len(text))])
    joined: list[tuple[str, str]] = []
    for kind, piece in out + stream.finish():
        if joined and joined[-1][0] == kind and kind != "call":
            joined[-1] = (kind, joined[-1][1] + piece)
        else:
            joined.append((kind, piece))
    return joined


@pytest.mark.parametrize("size", [None, 1, 2, 5], ids=["whole", "1", "2", "5"])
@pytest.mark.parametrize("text,calls,expected", [
    (ANALYSIS_THEN_FINAL, True, [("reasoning", "The user greets. Answer briefly."),
                                 ("content", "Hello! How can I help?")]),
    (CALL_AFTER_CHANNEL, True, [("reasoning", "Need the weather."), ("call", "get_weather"),
                                ("arguments", '{"city": "Paris"}')]),
    (CALL_BEFORE_CHANNEL, True, [("call", "get_weather"), ("arguments", '{"city": "Paris"}')]),
    # no tools offered: a call's body is shown
    (CALL_AFTER_CHANNEL, False, [("reasoning", "Need the weather."), ("content", '{"city": "Paris"}')]),
    # a preamble on commentary is the user's to read; a built-in tool's message (browser) is reasoning
    ("<|channel|>commentary<|message|>Checking two cities.<|end|><|start|>assistant<|channel|>commentary "
     "to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|end|><|start|>assistant<|channel|>final"
     "<|message|>Done.", True, [("content", "Checking two cities."), ("reasoning", '{"query": "x"}'),
                                ("content", "Done.")]),
    # cut by max_tokens inside the analysis: what there is, as reasoning
    ("<|channel|>analysis<|message|>Thinking about <|", True, [("reasoning", "Thinking about <|")]),
    # a model that does not write the format: its text is the answer; text off the format between messages is
    # shown, not lost (whitespace before the next message is not shown)
    ("Just an answer.", True, [("content", "Just an answer.")]),
    ("<|channel|>final<|message|>Hi.<|end|> And more.<|end|>\n<|start|>assistant<|channel|>final<|message|> Bye.",
     True, [("content", "Hi. And more. Bye.")]),
], ids=["analysis-final", "call", "history-form-call", "call-without-tools", "preamble-builtin", "cut", "no-format",
        "off-format-between"])
def test_stream_reads_each_message_kind(text, calls, expected, size):
    assert _pieces(text, calls, size) == expected


def test_whole_and_streamed_answers_agree():
    ids = iter(f"call_{i}" for i in range(10))
    reasoning, content, calls = parse_answer(CALL_AFTER_CHANNEL, HarmonyPlan(calls=True), None, lambda: next(ids))
    assert (reasoning, content) == ("Need the weather.", None)
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    parser = AnswerParser(HarmonyPlan(calls=True), None, lambda: "call_s")
    deltas = [d for ch in CALL_AFTER_CHANNEL for d in parser.feed(ch)] + parser.finish()
    assert parser.has_calls
    streamed = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ()))
    assert streamed == '{"city": "Paris"}'
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert not any("content" in d for d in deltas)
    # an answer without an analysis message: no reasoning (None), as for a model that wrote no section
    assert parse_answer("<|channel|>final<|message|>Hi", HarmonyPlan(calls=False), None)[:2] == (None, "Hi")
    # a call cut inside its arguments is dropped, as in the other formats
    assert parse_answer(CALL_AFTER_CHANNEL[:-3], HarmonyPlan(calls=True), None)[2] == []


def test_the_template_is_recognised():
    assert is_harmony(HARMONY_TEMPLATE) and not is_harmony("{{ messages[0].content }}<|im_start|>")


# --- the grammars ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocabulary(tiny_model_dir, tmp_path_factory):
    """(tokenizers.Tokenizer, llguidance.LLTokenizer, token_of) of the demo tokenizer with harmony's tokens."""
    import llguidance
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in HARMONY_MARKERS])
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size()), tok.token_to_id


def _accepts(vocabulary, grammar, text: str) -> bool:
    from llmbus.testing.chat_formats import grammar_accepts

    tok, llg, _ = vocabulary
    return grammar_accepts(llg, grammar, tok.encode(text, add_special_tokens=False).ids)


def test_a_schema_holds_the_final_message_after_an_optional_analysis(vocabulary):
    from llmbus.bus.messages import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = grammar_in_harmony(Grammar("json_schema", json.dumps(schema)), vocabulary[2])
    final = '<|channel|>final<|message|>{"a": 1}'
    assert _accepts(vocabulary, grammar, final)
    assert _accepts(vocabulary, grammar, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant" + final)
    assert not _accepts(vocabulary, grammar, '{"a": 1}')  # no header
    assert not _accepts(vocabulary, grammar, '<|channel|>final<|message|>{"a": "x"}')
    assert not _accepts(vocabulary, grammar, "<|channel|>analysis<|message|>Think.<|end|>")  # no answer yet
    # the analysis text may not hold a marker's token: it could not end where the grammar means
    assert not _accepts(vocabulary, grammar, "<|channel|>analysis<|message|>a<|message|>b<|end|><|start|>assistant"
                        + final)


@pytest.mark.parametrize("choice", ["required", "function", "auto"])
def test_a_tool_call_in_harmony_holds_its_parameters(vocabulary, choice):
    token_of = vocabulary[2]
    from llmbus.frontend.tool_formats import HARMONY

    tool_choice = {"required": "required", "auto": "auto",
                   "function": {"type": "function", "function": {"name": "get_weather"}}}[choice]
    plan = parse_tools({"tools": WEATHER, "tool_choice": tool_choice}, fmt=HARMONY, token_of=token_of)
    assert not plan.parallel  # <|call|> ends a harmony turn
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert _accepts(vocabulary, plan.grammar, call)
    assert _accepts(vocabulary, plan.grammar, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + call)
    assert not _accepts(vocabulary, plan.grammar, call.replace("Paris", "Paris, the capital of France"))
    other = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    assert _accepts(vocabulary, plan.grammar, other) == (choice != "function")
    assert not _accepts(vocabulary, plan.grammar, call.replace("get_weather", "get_wind"))
    assert _accepts(vocabulary, plan.grammar, "<|channel|>final<|message|>No call.") == (choice == "auto")


def test_a_harmony_template_over_another_tokenizer_is_a_clear_error():
    from llmbus.frontend.tool_formats import HARMONY

    with pytest.raises(ApiError, match="tokenizer has no <|channel|> token"):
        parse_tools({"tools": WEATHER, "tool_choice": "required"}, fmt=HARMONY)


# --- the reasoning effort -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony_format():
    from llmbus.frontend.chat import ChatFormat
    from llmbus.frontend.reasoning import find_effort_variable, find_thinking_switch
    from llmbus.frontend.tool_formats import tool_format

    assert find_thinking_switch(HARMONY_TEMPLATE) is None
    return ChatFormat(tool_format("auto", HARMONY_TEMPLATE), None, {},
                      effort_variable=find_effort_variable(HARMONY_TEMPLATE))


@pytest.mark.parametrize("effort,expected", [("low", "low"), ("medium", "medium"), ("high", "high"),
                                             ("xhigh", "high"), ("minimal", "low")])
def test_reasoning_effort_is_the_templates_degree(harmony_format, effort, expected):
    from llmbus.frontend.thinking_controls import apply_thinking, openai_effort

    assert harmony_format.effort_variable == "reasoning_effort" and harmony_format.reasons
    assert apply_thinking(openai_effort(effort), harmony_format, None) == {"reasoning_effort": expected}
    assert apply_thinking(openai_effort(effort), harmony_format, {"reasoning_effort": expected}) == {
        "reasoning_effort": expected}


def test_reasoning_that_gpt_oss_cannot_do_is_refused(harmony_format):
    from llmbus.frontend.thinking_controls import anthropic_thinking, apply_thinking, openai_effort

    with pytest.raises(ApiError, match="always reasons"):
        apply_thinking(openai_effort("none"), harmony_format, None)
    with pytest.raises(ApiError, match="always reasons"):
        apply_thinking(anthropic_thinking({"type": "disabled"}), harmony_format, None)
    with pytest.raises(ApiError, match="`chat_template_kwargs.reasoning_effort` is \"low\""):
        apply_thinking(openai_effort("high"), harmony_format, {"reasoning_effort": "low"})
    assert apply_thinking(anthropic_thinking({"type": "enabled", "budget_tokens": 9}), harmony_format, None) is None


# --- the whole stack ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    from llmbus.testing import Server
    from llmbus.testing.chat_formats import build_harmony_model

    folder = build_harmony_model(tmp_path_factory.mktemp("harmony") / "model")
    server = Server(["--model-id", str(folder), "--dtype", "float32", "--max-total-tokens", "1024"])
    yield server, folder
    assert server.stop() == 0, server.stderr.text[-3000:]


def _chat(server, stream: bool = False, **body):
    from llmbus.testing.http import post, sse_events, stream as post_stream

    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 60, "temperature": 0, **body}
    if stream:
        raw = post_stream(f"{server.url}/v1/chat/completions", {**body, "stream": True})
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        return sse_events(raw[:-len(b"data: [DONE]\n\n")])
    status, _, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, answer
    return answer


MARKER = re.compile(r"<\|(start|end|message|channel|constrain|return|call)\|>")


def test_served_json_answer_after_reasoning(harmony_server):
    server, _ = harmony_server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"type": "integer"}},
              "required": ["ok", "size"], "additionalProperties": False}
    answer = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                   max_tokens=120)
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    assert set(json.loads(message["content"])) == {"ok", "size"}
    assert message["reasoning_content"] is None or isinstance(message["reasoning_content"], str)
    assert not MARKER.search(message["content"] + (message["reasoning_content"] or ""))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_served_required_tool_call(harmony_server, stream):
    server, _ = harmony_server
    body = dict(tools=WEATHER, tool_choice="required", max_tokens=120)
    if not stream:
        choice = _chat(server, **body)["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        assert choice["message"]["content"] is None
    else:
        events = _chat(server, stream=True, **body)
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1]
        calls = []
        for d in deltas:
            for c in d.get("tool_calls") or ():
                if "id" in c:
                    calls.append({"id": c["id"], "function": dict(c["function"])})
                else:
                    calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        assert not any(d.get("content") for d in deltas)
    assert finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    assert name in ("get_weather", "get_time")
    if name == "get_weather":
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12


def test_served_reasoning_effort_reaches_the_template(harmony_server):
    from tokenizers import Tokenizer

    from llmbus.testing.http import post

    server, folder = harmony_server
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for effort, written in (("high", "high"), ("minimal", "low")):
        status, _, body = post(f"{server.url}/tokenize", {
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort})
        assert status == 200, body
        assert f"Reasoning: {written}\n" in tok.decode(body["tokens"], skip_special_tokens=False)
    status, _, body = post(f"{server.url}/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none"})
    assert status == 400 and "always reasons" in body["error"]["message"], body
