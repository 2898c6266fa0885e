"""Reasoning sections (frontend/reasoning.py): where a generation starts from the rendered prompt, the split
of its text into reasoning and answer (whole, and streamed in any pieces, markers split across them), and
the grammars that leave the section free and constrain what follows, run by llguidance."""

from __future__ import annotations

import json

import pytest

from llmbus.bus.messages import Grammar
from llmbus.frontend.chat import ChatTemplate
from llmbus.frontend.grammar import compile_error, json_schema_grammar
from llmbus.frontend.reasoning import CLOSED, INSIDE, MAY_OPEN, ReasoningMarkers, ReasoningPlan, find_markers, \
    grammar_after_reasoning, opening, split_reasoning
from llmbus.frontend.tools import parse_tools
from llmbus.testing.chat_formats import LLAMA31_TEMPLATE, QWEN3_TEMPLATE, grammar_accepts, marker_vocabulary

THINK = ReasoningMarkers("<think>", "</think>")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def render(tmp_path, **kwargs) -> str:
    (tmp_path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    template = ChatTemplate(tmp_path)
    return template.render([{"role": "user", "content": "hi"}], None, kwargs or None)


def test_the_prompt_says_where_the_generation_starts(tmp_path):
    assert find_markers(QWEN3_TEMPLATE) == THINK and find_markers(LLAMA31_TEMPLATE) is None
    assert opening(THINK, render(tmp_path)) == MAY_OPEN
    off = render(tmp_path, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and opening(THINK, off) == CLOSED
    assert opening(THINK, render(tmp_path, open_thinking=True)) == INSIDE
    # an earlier turn's finished section does not open one
    assert opening(THINK, "<think>a</think>b<|im_start|>assistant\n") == MAY_OPEN


def pieces_of(plan: ReasoningPlan, text: str, cuts: list[int]) -> tuple[str | None, str]:
    stream = plan.stream()
    bounds = [0, *cuts, len(text)]
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in stream.feed(text[a:b])] + stream.finish()
    assert all(t for _, t in pieces)  # no empty deltas
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    return (reasoning if stream.reasoned else None), "".join(t for k, t in pieces if k == "content")


CASES = [  # (opening, generated text, reasoning, answer)
    (INSIDE, "let me see </thin k> ok</think>\n\nThe answer <think> is 4.", "let me see </thin k> ok",
     "The answer <think> is 4."),
    (INSIDE, "cut short <", "cut short <", ""),
    (INSIDE, "</think>  ", "", ""),
    (MAY_OPEN, "\n<think>\nhmm\n</think>\n\n{\"ok\": true}", "\nhmm\n", "{\"ok\": true}"),
    (MAY_OPEN, "  <thinking is not the marker", None, "  <thinking is not the marker"),
    (MAY_OPEN, "No reasoning here </think> at all", None, "No reasoning here </think> at all"),
    (MAY_OPEN, " <thi", None, " <thi"),
    (CLOSED, "<think>x</think>y", None, "<think>x</think>y"),
]


@pytest.mark.parametrize("start, text, reasoning, answer", CASES)
def test_split_whole_and_in_any_pieces(start, text, reasoning, answer):
    plan = ReasoningPlan(THINK, start)
    assert split_reasoning(text, plan) == (reasoning, answer)
    assert pieces_of(plan, text, list(range(1, len(text)))) == (reasoning, answer)  # every marker split
    for cut in range(1, len(text)):
        assert pieces_of(plan, text, [cut]) == (reasoning, answer), cut
    assert split_reasoning(text, None) == (None, text)


# --- the grammars ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marker_tokenizer(tiny_model_dir, tmp_path_factory):
    return marker_vocabulary(tiny_model_dir / "tokenizer.json", tmp_path_factory.mktemp("reasoning-markers"))


def accepts(llg, grammar, ids) -> bool:
    return grammar_accepts(llg, grammar, ids)


def ids_of(tok, text: str, spelled: bool = False) -> list[int]:
    if not spelled:
        return tok.encode(text, add_special_tokens=False).ids
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False).ids]


@pytest.mark.parametrize("spelled", [False, True], ids=["marker-tokens", "spelled"])
def test_a_json_answer_after_a_free_section(marker_tokenizer, spelled):
    tok, llg, added = marker_tokenizer
    plain = json_schema_grammar(SCHEMA)
    others = set(added.values()) - {added["</s>"]}
    inside = grammar_after_reasoning(plain, ReasoningPlan(THINK, INSIDE), added.get, others)
    may = grammar_after_reasoning(plain, ReasoningPlan(THINK, MAY_OPEN), added.get, others)
    assert inside.kind == may.kind == "lark" and compile_error("lark", inside.source) is None
    free = 'any {"ok": "text"} <tool_call> here'
    assert accepts(llg, inside, ids_of(tok, free + '</think>\n\n{"ok": true}', spelled))
    assert accepts(llg, inside, ids_of(tok, '</think>{"ok": false}', spelled))
    assert not accepts(llg, inside, ids_of(tok, free + '</think>\n\n{"ok": 1}', spelled))
    assert not accepts(llg, inside, ids_of(tok, '{"ok": true}', spelled))  # the section must end first
    assert not accepts(llg, inside, ids_of(tok, 'cut</s>', spelled))  # and may not end the generation
    assert accepts(llg, may, ids_of(tok, "<think>" + free + '</think>\n\n{"ok": true}', spelled))
    assert accepts(llg, may, ids_of(tok, '{"ok": true}', spelled))
    assert not accepts(llg, may, ids_of(tok, 'text {"ok": true}', spelled))
    # no section where the prompt closed it, or without a grammar
    assert grammar_after_reasoning(plain, ReasoningPlan(THINK, CLOSED), added.get) is plain
    assert grammar_after_reasoning(None, ReasoningPlan(THINK, INSIDE), added.get) is None


def test_tool_and_regex_grammars_after_a_section(marker_tokenizer):
    tok, llg, added = marker_tokenizer
    plan = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
                        "tool_choice": "required"}, token_of=added.get)
    wrapped = grammar_after_reasoning(plan.grammar, ReasoningPlan(THINK, INSIDE), added.get)
    call = '<tool_call>\n{"name": "f", "arguments": {"ok": true}}\n</tool_call>'
    assert accepts(llg, wrapped, ids_of(tok, "hmm</think>\n" + call))
    assert not accepts(llg, wrapped, ids_of(tok, "hmm</think>\nno call"))
    regex = grammar_after_reasoning(Grammar("regex", "a/b+"), ReasoningPlan(THINK, INSIDE), added.get)
    assert accepts(llg, regex, ids_of(tok, "x</think>a/bb")) and not accepts(llg, regex, ids_of(tok, "x</think>c"))
    # a user's Lark grammar whose start rule is used again is left as it is
    recursive = Grammar("lark", 'start: "(" start ")" | "x"\n')
    assert grammar_after_reasoning(recursive, ReasoningPlan(THINK, INSIDE), added.get) is recursive
    # the word in a literal or a comment names no rule: vLLM's guided_choice ["start", "stop"] is wrapped
    words = Grammar("lark", 'start: "start" | /stop/ // the start rule\n')
    wrapped = grammar_after_reasoning(words, ReasoningPlan(THINK, INSIDE), added.get)
    assert wrapped is not words and accepts(llg, wrapped, ids_of(tok, "x</think>start"))
    assert json.loads(json_schema_grammar(SCHEMA).source) == SCHEMA


# --- the Responses and Messages shapes of a section ------------------------------------------------------

ANSWER_WITH_CALL = 'let me see</think>\n\nLooking.\n<tool_call>\n{"name": "f", "arguments": {"ok": true}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 3, 100])
def test_responses_output_has_a_reasoning_item(size):
    from llmbus.frontend.reasoning import AnswerParser
    from llmbus.frontend.responses_output import OutputBuilder
    from llmbus.frontend.tool_formats import HERMES

    builder = OutputBuilder(parser=AnswerParser(ReasoningPlan(THINK, INSIDE), HERMES))
    for i in range(0, len(ANSWER_WITH_CALL), size):
        builder.feed(ANSWER_WITH_CALL[i:i + size])
    builder.finish("completed")
    reasoning, message, call = builder.output
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                         "text": "let me see"}]
    assert message["content"][0]["text"] == "Looking." and (call["name"], call["arguments"]) == ("f", '{"ok": true}')
    events = builder.take_events()
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert deltas == "let me see" and [e["text"] for e in done] == ["let me see"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # reasoning alone (cut short) still gets its empty message, as an answer with no output does
    alone = OutputBuilder(parser=AnswerParser(ReasoningPlan(THINK, INSIDE), None))
    alone.feed("cut short")
    alone.finish("incomplete")
    assert [item["type"] for item in alone.output] == ["reasoning", "message"]


@pytest.mark.parametrize("size", [1, 4, 100])
def test_messages_stream_has_a_thinking_block(size):
    from types import SimpleNamespace

    from llmbus.frontend.anthropic_messages import _Blocks
    from llmbus.frontend.tool_formats import HERMES

    plan = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]})
    chat = SimpleNamespace(plan=plan, reasoning=ReasoningPlan(THINK, INSIDE))
    assert plan.format is HERMES
    blocks, events = _Blocks(chat), []
    pieces = [ANSWER_WITH_CALL[i:i + size] for i in range(0, len(ANSWER_WITH_CALL), size)]
    for n, piece in enumerate(pieces):
        events += blocks.feed(piece, n == len(pieces) - 1)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and blocks.called
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert thinking == "let me see"
