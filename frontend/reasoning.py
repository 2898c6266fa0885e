"""Reasoning sections: the text a model writes inside its thinking markers (Qwen3's ``<think>…</think>``)
is returned apart from the answer, as OpenAI-style ``reasoning_content``, and the request's grammar
(``response_format``, tools) applies only after it.

The markers are read from the chat template (``REASONING_MARKERS``, the pairs vLLM's reasoning parsers
know), and so is its thinking switch (``THINKING_SWITCHES``: the variable that turns thinking on and off,
which the APIs' reasoning controls set, thinking_controls.py). Where a generation starts depends on the
rendered prompt, so it is decided per request:

- ``inside``: the generation prompt opens a section (DeepSeek-R1's and Qwen3-Thinking-2507's templates end
  with ``<think>\\n``): the output is reasoning up to the end marker;
- ``may_open``: the template knows the markers but the prompt leaves the section to the model (Qwen3 with
  ``enable_thinking`` on): reasoning when the output begins, after whitespace, with the start marker;
- ``closed``: the prompt ends with the end marker (Qwen3 with ``enable_thinking: false`` writes an empty
  section itself): no reasoning at all.

A grammar is wrapped so that the section is free text: ``start: thought GAP? answer`` (``inside``) or
``start: (open thought GAP?)? answer`` (``may_open``), ``answer`` being the request's own grammar as a
Lark rule. ``thought`` is a *lazy* rule of any text up to the first spelled-out end marker (llguidance's
lexer is greedy: a plain lexeme could never stop right before it), or text without it followed by the
marker's own token, where the tokenizer holds the marker as one added token (llguidance lexes those apart
from text). A user's Lark grammar that names its start rule more than once is left as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jinja2
import jinja2.meta

from llmbus.bus.grammar import JSON_OPTIONS
from llmbus.bus.messages import Grammar
from llmbus.frontend import harmony
from llmbus.frontend.harmony import HarmonyPlan
from llmbus.frontend.marker_tails import held_tail
from llmbus.frontend.tool_formats import ToolFormat
from llmbus.frontend.tools import ToolCallStream, is_json, new_call_id, parse_tool_output

INSIDE, MAY_OPEN, CLOSED = "inside", "may_open", "closed"


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str
    end: str


REASONING_MARKERS = (ReasoningMarkers("<think>", "</think>"),  # Qwen3, QwQ, DeepSeek-R1, Phi-4-reasoning
                     ReasoningMarkers("[THINK]", "[/THINK]"))  # Magistral


def find_markers(template_source: str | None) -> ReasoningMarkers | None:
    """The thinking markers a chat template writes, if any."""
    source = template_source or ""
    return next((m for m in REASONING_MARKERS if m.end in source), None)


# the variables templates turn thinking on and off with: Qwen3's, GLM-4.5's and SmolLM3's; DeepSeek-V3.1's
# and Granite 3.2's
THINKING_SWITCHES = ("enable_thinking", "thinking")
# the variables templates take a reasoning effort in ("low", "medium", "high"): gpt-oss's
EFFORT_VARIABLES = ("reasoning_effort",)


def _read_variables(template_source: str, names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` the template reads as variables. From its syntax tree (a variable the template sets
    itself, or an attribute such as ``message.thinking``, is not read); a template Jinja cannot parse with the
    standard extensions is searched for the names as words."""
    try:
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        read = jinja2.meta.find_undeclared_variables(environment.parse(template_source))
    except jinja2.TemplateSyntaxError:  # an extension tag of transformers' ({% generation %})
        read = set(re.findall(r"\b(?:" + "|".join(names) + r")\b", template_source))
    return read & set(names)


def find_thinking_switch(template_source: str | None) -> str | None:
    """The thinking switch a chat template reads from its variables, if any."""
    read = _read_variables(template_source, THINKING_SWITCHES) if template_source else set()
    return next((name for name in THINKING_SWITCHES if name in read), None)


def find_effort_variable(template_source: str | None) -> str | None:
    """The variable a chat template reads a reasoning effort from, if any."""
    read = _read_variables(template_source, EFFORT_VARIABLES) if template_source else set()
    return next((name for name in EFFORT_VARIABLES if name in read), None)


def opening(markers: ReasoningMarkers, prompt: str) -> str:
    """Where a generation after ``prompt`` starts: ``inside``, ``may_open`` or ``closed`` a section."""
    if prompt.rstrip().endswith(markers.end):
        return CLOSED
    if prompt.rfind(markers.start) > prompt.rfind(markers.end):
        return INSIDE
    return MAY_OPEN


@dataclass(frozen=True)
class ReasoningPlan:
    """A request's reasoning: the markers and where its generation starts."""

    markers: ReasoningMarkers
    opening: str

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.markers, self.opening)


# --- the output -------------------------------------------------------------------------------------


class ReasoningStream:
    """Generated text in (any fragments), ``("reasoning" | "content", text)`` pieces out. The markers are
    never shown; a piece that could still begin one is held back; the whitespace between the end marker
    and the answer is dropped. A generation cut inside its section has reasoning only."""

    def __init__(self, markers: ReasoningMarkers, opening_: str):
        self.markers = markers
        self._state = {INSIDE: "reasoning", MAY_OPEN: "start"}.get(opening_, "content")
        self._held = ""
        self.reasoned = opening_ == INSIDE  # a section began (so reasoning is "" rather than None)

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        text, self._held = self._held + text, ""
        while text:
            if self._state == "content":
                out.append(("content", text))
                break
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(self.markers.start):
                    self._state, self.reasoned, text = "reasoning", True, stripped[len(self.markers.start):]
                    continue
                if self.markers.start.startswith(stripped):  # whitespace, or the marker begun
                    self._held = text
                    break
                self._state = "content"
                continue
            if self._state == "after":
                text = text.lstrip()
                if text:
                    self._state = "content"
                continue
            at = text.find(self.markers.end)
            if at != -1:
                if at:
                    out.append(("reasoning", text[:at]))
                self._state, text = "after", text[at + len(self.markers.end):]
                continue
            keep = held_tail(text, (self.markers.end,))
            if len(text) > keep:
                out.append(("reasoning", text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the generation has ended."""
        held, self._held = self._held, ""
        if not held or self._state == "after":
            return []
        return [("reasoning" if self._state == "reasoning" else "content", held)]


def split_reasoning(text: str, plan: ReasoningPlan | None) -> tuple[str | None, str]:
    """(reasoning, answer) of a finished generation; reasoning None when it wrote no section."""
    if plan is None:
        return None, text
    stream = plan.stream()
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    return (reasoning if stream.reasoned else None), "".join(t for kind, t in pieces if kind == "content")


class AnswerParser:
    """A generation's text in (any fragments), chat-completion deltas out: ``reasoning_content`` of its
    reasoning section, then ``content`` and ``tool_calls`` of the answer (calls in ``tools``' syntax, when
    the request offered tools). The chat, Responses and Messages routes all read answers through it. A
    harmony answer (``HarmonyPlan``) says itself which of its messages are calls."""

    def __init__(self, reasoning: ReasoningPlan | HarmonyPlan | None, tools: ToolFormat | None,
                 new_id=new_call_id):
        self.reasoning = reasoning.stream() if reasoning is not None else None
        harmony = isinstance(reasoning, HarmonyPlan)
        self.tools = ToolCallStream(new_id, tools) if tools is not None and not harmony else None
        self._new_id = new_id
        self._calls = 0  # harmony's calls

    @property
    def has_calls(self) -> bool:
        return self._calls > 0 or self.tools is not None and self.tools.has_calls

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": piece})
            elif kind == "call":
                out.append({"tool_calls": [{"index": self._calls, "id": self._new_id(), "type": "function",
                                            "function": {"name": piece, "arguments": ""}}]})
                self._calls += 1
            elif kind == "arguments":
                out.append({"tool_calls": [{"index": self._calls - 1, "function": {"arguments": piece}}]})
            elif self.tools is not None:
                out += self.tools.feed(piece)
            else:
                out.append({"content": piece})
        return out

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.reasoning.feed(text) if self.reasoning else [("content", text)])

    def finish(self) -> list[dict]:
        out = self._deltas(self.reasoning.finish()) if self.reasoning else []
        return out + (self.tools.finish() if self.tools is not None else [])


def parse_answer(text: str, reasoning: ReasoningPlan | HarmonyPlan | None, tools: ToolFormat | None,
                 new_id=new_call_id) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool_calls) of a finished generation; content None when calls took it all."""
    if isinstance(reasoning, HarmonyPlan):
        return _joined_answer(AnswerParser(reasoning, tools, new_id), text)
    thought, text = split_reasoning(text, reasoning)
    if tools is None:
        return thought, text, []
    content, calls = parse_tool_output(text, new_id, tools)
    return thought, content, calls


def _joined_answer(parser: AnswerParser, text: str) -> tuple[str | None, str | None, list[dict]]:
    """``parse_answer``'s triple from ``parser``'s deltas over the whole ``text`` (a stream and a whole answer
    agree). A call whose arguments do not parse as JSON (cut by max_tokens) is dropped, as in the other formats."""
    reasoning, content, calls = [], [], []
    for delta in parser.feed(text) + parser.finish():
        reasoning.append(delta.get("reasoning_content", ""))
        content.append(delta.get("content", ""))
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    calls = [c for c in calls if is_json(c["function"]["arguments"])]
    reasoned = parser.reasoning is not None and parser.reasoning.reasoned
    return ("".join(reasoning) if reasoned else None), ("".join(content) or (None if calls else "")), calls


# --- the grammar ------------------------------------------------------------------------------------


def _lark_regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\/.^$|?*+()[]{}-" else ch for ch in text)


# a Lark grammar's string and regex literals and comments, where a word "start" names no rule
_LARK_LITERALS = re.compile(r'"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|//[^\n]*')


def _answer_rule(grammar: Grammar) -> str | None:
    """The request's grammar as Lark rules whose start is ``reasoned_answer``; None when it cannot be."""
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        return "reasoned_answer: %json " + json.dumps(schema) + "\n"
    if grammar.kind == "regex":
        return "reasoned_answer: REASONED_ANSWER\nREASONED_ANSWER: /" + grammar.source.replace("/", "\\/") + "/\n"
    if grammar.kind == "lark" and len(re.findall(r"\bstart\b", _LARK_LITERALS.sub(" ", grammar.source))) == 1:
        renamed, n = re.subn(r"^(\s*)start(\s*:)", r"\1reasoned_answer\2", grammar.source, count=1, flags=re.M)
        return renamed if n else None
    return None


def _token_ranges(ids) -> str:
    """Lark's token set of ``ids``, as ranges: ``<[3-5,9]>``."""
    ids, runs = sorted(set(ids)), []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "<[" + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs) + "]>"


def grammar_in_harmony(grammar: Grammar | None, token_of) -> Grammar | None:
    """``grammar`` as the body of a harmony answer's final message (harmony.answer_grammar); as it is where its
    rules cannot be renamed (a Lark grammar that names its start rule more than once)."""
    answer = _answer_rule(grammar) if grammar is not None else None
    return harmony.answer_grammar(answer, token_of) if answer is not None else grammar


def grammar_after_reasoning(grammar: Grammar | None, plan: ReasoningPlan | None, token_of,
                            other_tokens=()) -> Grammar | None:
    """``grammar`` with a free reasoning section before it, where the generation may or must write one;
    ``token_of(marker)`` is the marker's id where the tokenizer holds it as one added token;
    ``other_tokens``: the other added tokens a section may hold (not end-of-sequence ones: a grammar's
    generation may not end inside its section)."""
    if grammar is None or plan is None or plan.opening == CLOSED:
        return grammar
    answer = _answer_rule(grammar)
    if answer is None:
        return grammar
    start, end = plan.markers.start, plan.markers.end
    end_token = token_of(end)
    others = [t for t in other_tokens if t != end_token]
    # where the end marker is a token, the section may hold the other added tokens too (llguidance lexes
    # them apart from text), each one alone: a token set never matches plain text, so text stays lexemes
    pieces = f"(REASONING_TEXT | {_token_ranges(others)})*" if others else "REASONING_TEXT?"
    by_token = f" | {pieces} <[{end_token}]>" if end_token is not None else ""
    rules = (f"reasoning_section: reasoning_lazy{by_token}\n"
             f"reasoning_lazy[lazy]: /(.|\\n)*{_lark_regex(end)}/\n"
             f"REASONING_TEXT: /(.|\\n)+/ & ~/(.|\\n)*{_lark_regex(end)}(.|\\n)*/\n"
             "REASONING_GAP: /[ \\t\\r\\n]{1,4}/\n")  # bounded: a small model may spin in whitespace
    if plan.opening == INSIDE:
        head = "start: reasoning_section REASONING_GAP? reasoned_answer\n"
    else:
        start_token = token_of(start)
        alternative = f" | <[{start_token}]>" if start_token is not None else ""
        head = (f"start: (reasoning_open reasoning_section REASONING_GAP?)? reasoned_answer\n"
                f"reasoning_open: {json.dumps(start)}{alternative}\n")
    return Grammar("lark", head + rules + answer)
