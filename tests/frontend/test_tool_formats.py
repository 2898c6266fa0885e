"""The families' tool-call syntaxes (frontend/tool_formats.py): which one a template teaches, the parser
on each (whole answers, and streams cut anywhere, markers split across chunks included), and the grammar
of each, run by llguidance over a tokenizer that holds the markers as added tokens."""

from __future__ import annotations

import json
import random

import pytest

from llmbus.frontend.grammar import compile_error
from llmbus.frontend.tool_formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI, detect_tool_format, \
    tool_format
from llmbus.frontend.tools import ToolCallStream, parse_tool_output, parse_tools, prepare_messages
from llmbus.testing.chat_formats import LLAMA31_TEMPLATE, MISTRAL_TEMPLATE, QWEN3_TEMPLATE, grammar_accepts, \
    marker_vocabulary

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALLS = [("get_weather", {"city": "Paris, \"FR\" {x}", "unit": "c"}), ("get_time", {})]

# per format: (answer text with two calls after some content, the content the parser must give)
ANSWERS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}", '
               '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
               "Let me look."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" {x}", '
                    '"unit": "c"}}; {"name": "get_time", "parameters": {}}', None),
    "mistral": ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}", '
                '"unit": "c"}}, {"name": "get_time", "arguments": {}}]', "Let me look."),
    "phi4_mini": ('functools[{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}", "unit": "c"}}, '
                  '{"name": "get_time", "arguments": {}}]', None),
}


def counter():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


def streamed(fmt, text: str, cuts: list[int]):
    """(content, [(name, arguments text)]) rebuilt from the deltas of ``text`` fed in pieces at ``cuts``."""
    stream, content, calls = ToolCallStream(counter(), fmt), "", {}
    bounds = [0, *cuts, len(text)]
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in stream.feed(text[a:b])] + stream.finish()
    for d in deltas:
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


def test_templates_pick_their_format():
    assert detect_tool_format(QWEN3_TEMPLATE) is HERMES
    assert detect_tool_format(LLAMA31_TEMPLATE) is LLAMA3_JSON
    assert detect_tool_format(MISTRAL_TEMPLATE) is MISTRAL
    assert detect_tool_format("{% for m in messages %}<|tool|>{{ m.tools }}<|/tool|>{% endfor %}") is PHI4_MINI
    assert detect_tool_format("{{ messages }}") is HERMES and detect_tool_format(None) is HERMES
    # "parameters" alone (a schema's word) is not Llama's syntax; in a Llama 3 template it is
    assert detect_tool_format('{{ tools }} "parameters"') is HERMES
    assert tool_format("mistral", QWEN3_TEMPLATE) is MISTRAL and tool_format("auto", MISTRAL_TEMPLATE) is MISTRAL


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_whole_answers_parse(name):
    text, content = ANSWERS[name]
    got_content, calls = parse_tool_output(text, counter(), FORMATS[name])
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert [c["id"] for c in calls] == ["call_0", "call_1"]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_streams_cut_anywhere_give_the_whole_answer(name):
    text, content = ANSWERS[name]
    fmt = FORMATS[name]
    whole = [(n, json.dumps(a, ensure_ascii=False)) for n, a in CALLS]
    rng = random.Random(0)
    cut_sets = [list(range(1, len(text)))]  # one character at a time: every marker split
    cut_sets += [[i] for i in range(1, len(text))]  # two pieces, cut at every point
    cut_sets += [sorted(rng.sample(range(1, len(text)), 7)) for _ in range(30)]
    for cuts in cut_sets:
        assert streamed(fmt, text, cuts) == (content or "", whole), cuts


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_plain_answers_are_content(name):
    fmt = FORMATS[name]
    for text in ("The weather is fine.", "  {not a call at the start? no: text first} [x]", "<|pyth", "functool"):
        if name == "llama3_json" and text.lstrip().startswith("{"):
            continue
        assert parse_tool_output(text, counter(), fmt) == (text, [])
        assert streamed(fmt, text, list(range(1, len(text))))[0] == text


def test_llama_answer_is_calls_only_when_it_begins_with_one():
    text = 'I would call {"name": "get_time", "parameters": {}}'
    assert parse_tool_output(text, counter(), LLAMA3_JSON) == (text, [])
    content, calls = parse_tool_output('  {"name": "get_time", "parameters": {}}', counter(), LLAMA3_JSON)
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_history_calls_are_written_in_the_models_syntax():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                   {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "x", "unit": "c"}'}}]}]
    expected = {"mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                           '"arguments": {"city": "x", "unit": "c"}}]',
                "llama3_json": '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                               '{"city": "x", "unit": "c"}}'}
    for name, text in expected.items():
        plan = parse_tools({"tools": TOOLS}, fmt=FORMATS[name])
        out = prepare_messages(history + [{"role": "user", "content": "and?"}], plan, "{{ messages }}")
        assert out[1]["content"] == text
        # a template without tools is told the syntax with the tools
        assert FORMATS[name].instruction("auto", None, True) in out[-1]["content"]


def test_a_template_teaching_the_syntax_gets_no_instruction():
    plan = parse_tools({"tools": TOOLS}, fmt=MISTRAL)
    out = prepare_messages([{"role": "user", "content": "hi"}], plan, MISTRAL_TEMPLATE)
    assert out[-1]["content"] == "hi"
    # a template that declares tools but teaches another syntax is told ours
    out = prepare_messages([{"role": "user", "content": "hi"}], plan, QWEN3_TEMPLATE)
    assert out[-1]["content"] == "hi\n---\n" + MISTRAL.instruction("auto", None, True)


# --- the grammars, over a tokenizer with the markers as added tokens ---------------------------------


@pytest.fixture(scope="module")
def marker_tokenizer(tiny_model_dir, tmp_path_factory):
    return marker_vocabulary(tiny_model_dir / "tokenizer.json", tmp_path_factory.mktemp("markers"))


def accepts(llg, grammar, ids) -> bool:
    return grammar_accepts(llg, grammar, ids)


def encode(tok, text: str, as_tokens: bool) -> list[int]:
    """``text``'s ids: its markers as their added tokens, or spelled out in plain tokens."""
    if as_tokens:
        return tok.encode(text, add_special_tokens=False).ids
    ids = []
    for ch in text:  # byte-level pieces never merge into an added token
        ids += [i for i in tok.encode(ch, add_special_tokens=False).ids]
    return ids


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("as_tokens", [True, False], ids=["marker-tokens", "spelled"])
def test_grammars_take_their_formats_answers(marker_tokenizer, name, as_tokens):
    tok, llg, added = marker_tokenizer
    fmt = FORMATS[name]
    text, content = ANSWERS[name]
    if name == "llama3_json" and not as_tokens:
        text = text.removeprefix("<|python_tag|>")  # the tag is a special token: only ever the token
    auto = parse_tools({"tools": TOOLS}, fmt=fmt, token_of=added.get)
    assert compile_error("lark", auto.grammar.source) is None
    assert accepts(llg, auto.grammar, encode(tok, text.rstrip("\n"), as_tokens))
    assert accepts(llg, auto.grammar, encode(tok, "Just text.", as_tokens))
    calls_only = text[text.index(fmt.lead):] if content and fmt.lead else text
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"}, fmt=fmt, token_of=added.get)
    assert accepts(llg, required.grammar, encode(tok, calls_only, as_tokens))
    assert not accepts(llg, required.grammar, encode(tok, "Just text.", as_tokens))
    one = parse_tools({"tools": TOOLS, "tool_choice": "get_time"}, fmt=fmt, token_of=added.get)
    single = fmt.calls_text([("get_time", {})])
    assert accepts(llg, one.grammar, encode(tok, single, as_tokens))
    assert not accepts(llg, one.grammar, encode(tok, calls_only, as_tokens))  # a second call, another name


def test_the_chat_format_follows_the_setting_and_keeps_special_markers(marker_tokenizer, tmp_path):
    from llmbus.frontend.chat import ChatTemplate

    tok, _, added = marker_tokenizer
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    (tmp_path / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    template = ChatTemplate(tmp_path)
    fmt = template.chat_format("auto", tok, special)
    assert fmt.tools is MISTRAL and fmt.reasoning is None and fmt.token_of("[TOOL_CALLS]") == added["[TOOL_CALLS]"]
    assert fmt.markers == {"[TOOL_CALLS]"}  # a special token, which generated text leaves out
    assert template.chat_format("hermes", tok, special).tools is HERMES  # --tool-call-parser wins
    (tmp_path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    qwen = ChatTemplate(tmp_path).chat_format("auto", tok, special)
    assert qwen.tools is HERMES and qwen.reasoning.end == "</think>" and qwen.markers == frozenset()


PHI4_MINI_TEMPLATE = (  # the tool part of Phi-4-mini-instruct's template
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% endif %}")


def test_phi4_mini_gets_its_tools_in_the_system_message(tmp_path):
    from llmbus.frontend.chat import ChatTemplate

    assert detect_tool_format(PHI4_MINI_TEMPLATE) is PHI4_MINI
    plan = parse_tools({"tools": TOOLS}, fmt=PHI4_MINI)
    (tmp_path / "chat_template.jinja").write_text(PHI4_MINI_TEMPLATE)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]):
        out = prepare_messages(messages, plan, PHI4_MINI_TEMPLATE)
        prompt = ChatTemplate(tmp_path).render(out)
        system = messages[0]["content"] if len(messages) == 2 else ""
        assert prompt.startswith(f"<|system|>{system}<|tool|>{json.dumps(plan.offered)}<|/tool|><|end|>")
        assert prompt.endswith("<|user|>hi<|end|><|assistant|>")  # the template teaches the rest
