"""The tool-call syntaxes of the model families, and which one a model writes.

Each family was trained to call tools its own way; the grammar holds a model to its own syntax and the
parser (``tools.ToolCallStream``) reads that syntax back into OpenAI ``tool_calls``:

- ``hermes`` (Qwen2.5, Qwen3, Hermes and most tool-tuned open models)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  calls separated by "\\n".
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the answer *is* the call, a bare JSON object with "parameters",
  optionally after ``<|python_tag|>``; several calls are separated by "; " (vLLM's reading; Llama's own
  templates allow one). Text that does not begin with "{" (or the tag) is an answer, never a call.
- ``mistral`` (Mistral v0.3 / Nemo / Small tokenizers): ``[TOOL_CALLS]`` then a JSON array of
  ``{"name", "arguments"}`` objects.
- ``phi4_mini`` (Phi-4-mini): ``functools`` then the same JSON array.
- ``harmony`` (gpt-oss): a message of its own, ``<|channel|>commentary to=functions.get_weather
  <|constrain|>json<|message|>{"city": "Paris"}``, one a turn: harmony.py reads it and makes its grammar.

Gemma 3's and Phi-4's (14B) templates define no tool syntax: they get Hermes with our instruction, as any
model whose template shows none. The format is read from the chat template's markers at start-up (the
same markers vLLM's parsers key on), unless ``--tool-call-parser`` names one.

A marker that the tokenizer holds as one added token (``<tool_call>`` in Qwen's, ``[TOOL_CALLS]`` in
Mistral's) is allowed in the grammar both as that token and as its spelled-out text: llguidance lexes an
added token apart from text, so a grammar that only spelled it would force a real model off its token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmbus.frontend.harmony import is_harmony

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "phi4_mini", "harmony")

# Text without the lead marker, for the grammar's plain answer; (.|\n) is valid UTF-8 only, which the
# negation alone would not be
_TEXT_WITHOUT = 'TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n'
# Llama: an answer that does not begin (after whitespace) with "{"; a call is the whole answer
_TEXT_NOT_JSON = 'TEXT: /(.|\\n)*/ & ~/[ \\t\\r\\n]*\\{(.|\\n)*/\n'


def lark_string(text: str) -> str:
    return json.dumps(text)


def _regex_literal(text: str) -> str:
    """``text`` as a piece of a Lark /regex/ (every character that means something escaped)."""
    return "".join("\\" + ch if ch in "\\/.^$|?*+()[]{}-" else ch for ch in text)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    lead: str | None  # the marker that turns text into calls; None: calls only as the whole answer
    arguments_key: str  # "arguments" | "parameters"
    opener: str  # what begins each call ("<tool_call>", or "{" for the JSON forms)
    before_calls: str = ""  # written between the lead and the first call ("[" of an array)
    separator: str = "\n"  # between two calls
    after_calls: str = ""  # after the last call ("]")
    tags: tuple[str, str] | None = None  # markers around each call's JSON (Hermes'), each with a newline
    optional_tag: str | None = None  # a token the answer may begin with (Llama's <|python_tag|>)
    markers: tuple[str, ...] = ()  # what a chat template teaching this syntax writes (any one of them)

    def shown_in(self, template_source: str) -> bool:
        """Whether the template itself teaches the model this syntax."""
        return any(marker in template_source for marker in self.markers)

    def call_text(self, name: str, arguments) -> str:
        """One call as the model writes it (the grammar's separators, UTF-8 unescaped as llguidance forces)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.tags[0]}\n{body}\n{self.tags[1]}" if self.tags else body

    def calls_text(self, calls: list[tuple[str, object]]) -> str:
        """An answer made of these calls (for a history the template cannot show as ``tool_calls``)."""
        inner = self.separator.join(self.call_text(name, args) for name, args in calls)
        lead = self.lead if self.lead is not None and not self.tags else ""
        return lead + self.before_calls + inner + self.after_calls

    def instruction(self, choice: str, function: str | None, parallel: bool) -> str:
        """How to call a function in this syntax, worded for the choice."""
        example = self.calls_text([("<function name>", {})]).replace(
            "{}", "{<the arguments as a JSON object>}")
        form = f"To call a function, answer with a block of exactly this form:\n{example}\n"
        several = ("To call several functions, write one such block per call, each on a new line.\n"
                   if self.separator == "\n" else
                   f"To call several functions, write one call per function, separated by "
                   f"{json.dumps(self.separator)}.\n")
        head = {"function": f"You must call the function {function}. ",
                "required": "You must call one of the functions listed above. "}.get(
            choice, "You can call the functions listed above. ")
        tail = "Only call a function when it helps answer; otherwise answer normally, in plain text."
        return head + form + (several if parallel else "") + (tail if choice == "auto" else "")

    def grammar(self, body: str, choice: str, parallel: bool, token_of) -> str:
        """The Lark grammar of a generation under ``choice``, ``body`` being one call's JSON as Lark (a
        %json); ``token_of(text)`` is the id of a marker the tokenizer holds as one token, or None."""
        more = f" ({lark_string(self.separator)} call)*" if parallel else ""
        if self.tags:  # Hermes: the lead is the first call's opening tag, which ``head`` eats in auto
            close = _alternatives(self.tags[1], token_of)
            rules = (f'call: {_alternatives(self.tags[0], token_of)} "\\n" body "\\n" {close}\n'
                     f"body: {body}\n")
            # a model may end its last call with a newline: it must not be pushed into another call
            if choice != "auto":
                return f'start: call{more} "\\n"?\n' + rules
            return (f'start: TEXT | head "\\n" body "\\n" {close}{more} "\\n"?\n'
                    + _head(self.lead, token_of) + _TEXT_WITHOUT.format(marker=_regex_literal(self.lead)) + rules)
        rules = f"call: body\nbody: {body}\n"
        calls = " ".join(x for x in (lark_string(self.before_calls) if self.before_calls else "", f"call{more}",
                                      lark_string(self.after_calls) if self.after_calls else "") if x)
        if self.lead is None:  # Llama: the whole answer is the calls, maybe after its tag
            tag = token_of(self.optional_tag) if self.optional_tag else None
            calls = (f"<[{tag}]>? " if tag is not None else "") + calls
            if choice != "auto":
                return f"start: {calls}\n" + rules
            return f"start: TEXT | {calls}\n" + _TEXT_NOT_JSON + rules
        if choice != "auto":
            return f"start: {_alternatives(self.lead, token_of)} {calls}\n" + rules
        return (f"start: TEXT | head {calls}\n" + _head(self.lead, token_of)
                + _TEXT_WITHOUT.format(marker=_regex_literal(self.lead)) + rules)


def _alternatives(marker: str, token_of) -> str:
    """A marker in Lark: its text, or its one token where the tokenizer has it."""
    token = token_of(marker)
    return f"({lark_string(marker)} | <[{token}]>)" if token is not None else lark_string(marker)


def _head(marker: str, token_of) -> str:
    """``head``: any text up to and including the first ``marker``. A *lazy* rule for the spelled-out
    marker, since llguidance's lexer is greedy (``TEXT? marker`` could never end TEXT right before it);
    the marker's own token ends the text without lookahead."""
    token = token_of(marker)
    alternative = f" | TEXT <[{token}]>" if token is not None else ""
    return f"head: lead{alternative}\nlead[lazy]: /(.|\\n)*{_regex_literal(marker)}/\n"


HERMES = ToolFormat("hermes", lead="<tool_call>", arguments_key="arguments", opener="<tool_call>",
                    tags=("<tool_call>", "</tool_call>"), markers=("<tool_call>",))
LLAMA3_JSON = ToolFormat("llama3_json", lead=None, arguments_key="parameters", opener="{", separator="; ",
                         optional_tag="<|python_tag|>", markers=("<|python_tag|>", '"parameters"'))
MISTRAL = ToolFormat("mistral", lead="[TOOL_CALLS]", arguments_key="arguments", opener="{",
                     before_calls="[", separator=", ", after_calls="]", markers=("[TOOL_CALLS]",))
PHI4_MINI = ToolFormat("phi4_mini", lead="functools", arguments_key="arguments", opener="{",
                       before_calls="[", separator=", ", after_calls="]", markers=("functools", "<|tool|>"))
# the name and markers only: harmony's calls are messages of their own, which harmony.py reads and constrains
HARMONY = ToolFormat("harmony", lead=None, arguments_key="arguments", opener="",
                     markers=("<|channel|>commentary", "to=functions."))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI, HARMONY)}


def detect_tool_format(template_source: str | None) -> ToolFormat:
    """The syntax the chat template teaches, from its markers (Hermes when it shows none). Llama's
    "parameters" counts only in a Llama 3 template (its header tokens), where it is the call's key."""
    source = template_source or ""
    if is_harmony(source):
        return HARMONY
    for fmt in (HERMES, MISTRAL, PHI4_MINI):
        if fmt.shown_in(source):
            return fmt
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and '"parameters"' in source):
        return LLAMA3_JSON
    return HERMES


def tool_format(setting: str, template_source: str | None) -> ToolFormat:
    """The format ``--tool-call-parser`` names, or the template's (``auto``)."""
    return detect_tool_format(template_source) if setting == "auto" else FORMATS[setting]
