"""OpenAI's harmony format (gpt-oss): how its answers are read, and the grammars that keep it to the format.

gpt-oss writes every turn as messages on channels. The prompt ends with ``<|start|>assistant``; the generation
goes on with the first message's header and then, message after message::

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

or, calling a function (the recipient may also stand before ``<|channel|>``, as the chat template writes
history: ``<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>``)::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "X"}<|call|>

``analysis`` is the reasoning (returned as ``reasoning_content``), ``final`` the answer, ``commentary`` a call
when it has a ``functions.*`` recipient and a preamble shown to the user otherwise (content, as vLLM shows it).
``<|return|>`` and ``<|call|>`` end the generation: they are among the model's end-of-sequence ids, so they do
not reach the text. A message to another recipient (the built-in ``browser``/``python`` tools, which a client
does not run) is reasoning. The markers are special tokens, which a generated text leaves out: a chat answer's
text keeps them (``ChatFormat.markers``) for this parser, which never shows them.

A request's grammar (``response_format``, a required tool call) applies to the final message's body, after an
optional analysis message: the grammar holds the headers as the markers' own tokens (llguidance lexes added
tokens apart from text), so the model writes the format it was trained on, and an analysis message's text may
not spell a marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmbus.bus.grammar import JSON_OPTIONS
from llmbus.bus.messages import Grammar
from llmbus.frontend.errors import ApiError, ErrorKind
from llmbus.frontend.marker_tails import held_tail

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# the markers a generated text keeps for this parser (<|return|> and <|call|> end it)
TEXT_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
MARKERS = (*TEXT_MARKERS, RETURN, CALL)
_ENDS = (END, RETURN, CALL)
FUNCTIONS = "functions."
# Header text a model may write before <|message|>; past it, the text is taken for a plain answer (a model
# that does not write the format, or writes it wrong, still answers).
MAX_HEADER = 256
_RECIPIENT = re.compile(r"\bto=(\S+)")
_MARKER_TEXT = "|".join(re.escape(marker) for marker in MARKERS)


def is_harmony(template_source: str | None) -> bool:
    """Whether the chat template writes harmony (gpt-oss's)."""
    source = template_source or ""
    return CHANNEL in source and MESSAGE in source and START in source


@dataclass(frozen=True)
class HarmonyPlan:
    """A request answered in harmony: what ``ChatRequest.reasoning`` holds for a gpt-oss model."""

    calls: bool  # tools were offered: a functions.* message is a call (else its body is shown as content)

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self.calls)


def _header_parts(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header: what follows ``<|channel|>`` up to a space, and a ``to=``'s
    target wherever it stands."""
    channel = ""
    if CHANNEL in header:
        channel = header.split(CHANNEL, 1)[1].split(CONSTRAIN)[0].strip().split(" ")[0]
    match = _RECIPIENT.search(header.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
    return channel, (match.group(1) if match else None)


class HarmonyStream:
    """Generated text in (any fragments, markers kept), pieces out: ``("reasoning", text)``, ``("content",
    text)``, ``("call", name)`` when a function call's header is read, then ``("arguments", text)`` fragments of
    its body. Markers and headers are never shown."""

    def __init__(self, calls: bool):
        self.calls = calls
        self._state = "header"  # header | body | between (after <|end|>, before <|start|>)
        self._text = ""  # not handled yet
        self._kind = "content"  # what the current body is: reasoning | content | arguments
        self.reasoned = False  # an analysis message began

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._text += text
        out: list[tuple[str, str]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the generation has ended: a body's tail, or a header that never ended
        (the model did not write the format: its text is the answer)."""
        text, self._text = self._text, ""
        if self._state == "header" and text and CHANNEL not in text and MESSAGE not in text:
            return [("content", text)]
        if self._state == "body" and text:
            return [(self._kind, text)]
        return []

    def _step(self, out: list[tuple[str, str]]) -> bool:
        text = self._text
        if self._state == "between":
            # a message ended: the next one starts with <|start|>; text before it (a model off the format) is
            # shown as content rather than lost
            at = text.find(START)
            limit = at if at != -1 else len(text) - held_tail(text, MARKERS)
            head = re.sub(_MARKER_TEXT, "", text[:limit])
            shown = head.rstrip()  # whitespace before the next message is not shown; before more text it is
            if shown:
                out.append(("content", shown))
            if at == -1:
                self._text = head[len(shown):] + text[limit:]
                return False
            self._text, self._state = text[at + len(START):], "header"
            return True
        if self._state == "header":
            at = text.find(MESSAGE)
            if at == -1:
                if len(text) > MAX_HEADER and CHANNEL not in text:
                    self._state, self._kind = "body", "content"  # no format: a plain answer
                    return True
                return False
            self._open(text[:at], out)
            self._text, self._state = text[at + len(MESSAGE):], "body"
            return True
        ends = [(text.find(marker), marker) for marker in _ENDS if marker in text]
        if ends:
            at, marker = min(ends)
            if at:
                out.append((self._kind, text[:at]))
            self._text, self._state = text[at + len(marker):], "between"
            return True
        keep = held_tail(text, MARKERS)
        if len(text) > keep:
            out.append((self._kind, text[:len(text) - keep]))
        self._text = text[len(text) - keep:]
        return False

    def _open(self, header: str, out: list[tuple[str, str]]) -> None:
        """A message begins: what its body is, by its header."""
        channel, recipient = _header_parts(header)
        if recipient is not None and recipient.startswith(FUNCTIONS) and self.calls:
            self._kind = "arguments"
            out.append(("call", recipient[len(FUNCTIONS):]))
        elif channel == "analysis" or recipient is not None and not recipient.startswith(FUNCTIONS):
            self._kind, self.reasoned = "reasoning", True
        else:
            self._kind = "content"


# --- the grammars ---------------------------------------------------------------------------------------


def _token(token_of, marker: str) -> str:
    token = token_of(marker)
    if token is None:  # a harmony template over another tokenizer: no grammar can hold the model to it
        raise ApiError(ErrorKind.TEMPLATE, f"the chat template writes harmony, but the tokenizer has no {marker} "
                                           f"token: a grammar cannot be applied")
    return f"<[{token}]>"


def _frame(token_of) -> str:
    """The rules every harmony grammar shares: an analysis message, whose text may hold no marker."""
    channel, message, end, start = (_token(token_of, m) for m in (CHANNEL, MESSAGE, END, START))
    return (f'harmony_analysis: {channel} "analysis" {message} HARMONY_TEXT? {end} {start} "assistant"\n'
            "HARMONY_TEXT: /(.|\\n)+/\n"
            f"harmony_channel: {channel}\nharmony_message: {message}\n")


def answer_grammar(answer_rule: str, token_of) -> Grammar:
    """A request's own grammar (``answer_rule``: its Lark rules, started by ``reasoned_answer``) as the body
    of the final message, after an optional analysis message."""
    return Grammar("lark", 'start: harmony_analysis? harmony_channel "final" harmony_message reasoned_answer\n'
                   + _frame(token_of) + answer_rule)


def tool_grammar(tools: list[dict], choice: str, token_of) -> Grammar:
    """A generation under ``choice`` ("auto", "required", "function": ``tools`` then holds the one function)
    that calls in harmony: one call a turn (``<|call|>`` ends it), its arguments held to the function's
    parameters; in auto, a final answer of any text instead."""
    constrain = _token(token_of, CONSTRAIN)
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = {**function["parameters"], "x-guidance": {**JSON_OPTIONS, **function["parameters"].get(
            "x-guidance", {})}}
        calls.append(f'harmony_call_{i}: harmony_channel "commentary to={FUNCTIONS}{function["name"]} " '
                     f'{constrain} "json" harmony_message %json {json.dumps(schema)}\n')
    names = " | ".join(f"harmony_call_{i}" for i in range(len(tools)))
    answer = " | harmony_channel \"final\" harmony_message HARMONY_TEXT?" if choice == "auto" else ""
    return Grammar("lark", f"start: harmony_analysis? ({names}{answer})\n" + _frame(token_of) + "".join(calls))
