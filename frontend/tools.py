"""OpenAI tool calling: the request's ``tools`` read into a grammar, the conversation prepared for the chat
template, and the generated text turned back into ``tool_calls`` (whole, or as stream deltas).

Each family's own syntax (frontend/tool_formats.py: Hermes, Llama 3.1's JSON, Mistral's [TOOL_CALLS],
Phi-4-mini's functools); described here in Hermes', which Qwen's templates and most tool-tuned open models
use, and which any model whose template shows no syntax is taught::

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

several calls separated by one "\\n". Models whose template declares no tools see the tools as JSON and an
instruction (``default_tool_prompt``) appended to the last message, as TGI does; every model is then held to
the syntax by a Lark grammar (llguidance's dialect) that rank 0 masks sampling with:

- the call body is one ``%json`` of ``anyOf`` one object schema per function (``{"name": {"const": N},
  "arguments": <parameters>}``, nothing else), with our ``JSON_OPTIONS`` in ``x-guidance``: ", " and ": "
  as separators and no free whitespace. One ``%json`` with ``anyOf`` rather than ``a | b`` of several, as
  llguidance advises; llguidance emits properties in schema order, so "name" always comes first, which the
  stream parser relies on to name a call before its arguments arrive.
- ``required``: ``start: call ("\\n" call)* "\\n"?`` (one call without parallel calls); a named function:
  always one call (``parallel_tool_calls`` aside), as in OpenAI's API and vLLM.
- ``auto``: ``start: TEXT | lead "\\n" body "\\n</tool_call>" ...`` where TEXT is any text without
  "<tool_call>" and ``lead`` a *lazy* lexeme of any text ending in "<tool_call>". Lazy because llguidance's
  lexer is greedy: ``TEXT? call`` can never end TEXT right before "<tool_call>"; a lazy lexeme ends at the
  first point it matches, so the text before the first call and its opening tag are one lexeme.
- an optional trailing "\\n": a model that ends its last call with a newline must not be pushed into
  another call.

``$ref``s of a function's parameters point into the parameters, which become ``anyOf/i/properties/arguments``
of the body schema: they are rebased there. Plain text is content; once "<tool_call>" appears, the text before
it (trailing whitespace dropped) is the content and what follows is calls only.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Callable

from llmbus.bus.grammar import JSON_OPTIONS
from llmbus.bus.messages import Grammar
from llmbus.frontend.errors import ApiError, ErrorKind, validation_error
from llmbus.frontend import harmony
from llmbus.frontend.grammar import compile_error
from llmbus.frontend.marker_tails import held_tail
from llmbus.frontend.strict_schema import strict_schema
from llmbus.frontend.tool_formats import HERMES, ToolFormat, detect_tool_format

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_CHOICE_WORDS = ("auto", "none", "required")
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:')
_JSON_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are data, not schemas
_BAD = object()  # what _loads gives for text that is not JSON
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolPlan:
    """What a request's tools ask of a generation."""

    tools: list[dict]  # all of the request's, as {"type", "function": {"name", "description"?, "parameters"}}
    choice: str  # "auto" | "required" | "function" ("none" gives no plan at all)
    function: str | None  # the one function allowed, when choice == "function"
    parallel: bool  # more than one call per generation
    grammar: Grammar  # kind "lark"
    format: ToolFormat = HERMES  # the syntax the model calls in

    @property
    def offered(self) -> list[dict]:
        """The tools the model may call: the named one only when the choice names one (as TGI does)."""
        if self.choice != "function":
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.function]

    def template_tools(self, template_source: str | None) -> list[dict] | None:
        """The tools to pass to the chat template, when the template declares any."""
        return self.offered if takes_tools(template_source) else None


# --- the request ------------------------------------------------------------------------------------


def _tool(tool, i: int) -> dict:
    def bad(why: str) -> ApiError:
        return validation_error(f"`tools[{i}]` {why}", param="tools")

    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad('must be an object with `type: "function"` (only function tools are supported)')
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad("must have a `function` object with a non-empty string `name`")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    elif not isinstance(params, dict):
        raise bad("`function.parameters` must be a JSON Schema object")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad("`function.description` must be a string")
    out = {"name": fn["name"]} | ({"description": description} if description is not None else {})
    return {"type": "function", "function": out | {"parameters": params}}


def _choice(value) -> tuple[str, str | None]:
    """(kind, function name) of a ``tool_choice``."""
    if value is None:
        return "auto", None
    if isinstance(value, str):  # TGI takes a bare function name too; the keywords win over such names
        return (value, None) if value in _CHOICE_WORDS else ("function", value)
    if isinstance(value, dict) and value.get("type", "function") == "function":
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return "function", fn["name"]
    raise validation_error('`tool_choice` must be "none", "auto", "required", a function name or '
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")


def parse_tools(body: dict, *, strict: bool = False, fmt: ToolFormat = HERMES,
                token_of=lambda marker: None) -> ToolPlan | None:
    """The plan of a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when the
    generation is not about tools (no tools, or ``tool_choice: "none"``). ``strict``: arguments hold to
    what each function's parameters declare (frontend/strict_schema.py). ``fmt``: the model's syntax;
    ``token_of``: the id of a marker the tokenizer holds as one token (or None)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise validation_error("`tools` must be an array of tools", param="tools")
    tools = [_tool(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise validation_error(f"`tools` has more than one function named {duplicates[0]}", param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise validation_error("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    choice, function = _choice(body.get("tool_choice"))
    if not tools:
        if choice in ("required", "function"):
            raise validation_error("`tool_choice` needs `tools`", param="tool_choice")
        return None
    if choice == "none":
        return None
    if choice == "function" and function not in names:
        raise ApiError(ErrorKind.TOOL, f"Tool with name {function} not found")
    # a named function means exactly one call, as in OpenAI's API and vLLM: with more allowed, a small model
    # repeats the same call until max_tokens. Harmony calls once a turn: <|call|> ends the generation.
    parallel = parallel is not False and choice != "function" and fmt.name != "harmony"
    plan = ToolPlan(tools, choice, function, parallel, Grammar("lark", ""), fmt)
    offered = plan.offered
    if strict:
        offered = [{**t, "function": {**t["function"], "parameters": strict_schema(t["function"]["parameters"])}}
                   for t in offered]
    plan.grammar = tool_grammar(offered, choice, plan.parallel, fmt, token_of)
    why = compile_error("lark", plan.grammar.source)
    if why is not None:  # name the culprit: compiling each schema alone gives llguidance's plain reason
        for tool in plan.offered:
            fn = tool["function"]
            alone = compile_error("json_schema", json.dumps(fn["parameters"]))
            if alone is not None:
                raise ApiError(ErrorKind.TOOL, f"invalid parameters schema of {fn['name']}: {alone}")
        raise ApiError(ErrorKind.TOOL, f"the tools make no grammar: {why}")
    return plan


# --- the grammar ------------------------------------------------------------------------------------


def _rebase(schema, base: str):
    """``schema`` with its local ``$ref``s ("#", "#/...") pointing below ``base`` instead of the root."""
    if isinstance(schema, list):
        return [_rebase(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            value = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas (a property may be "enum")
            value = {name: _rebase(v, base) for name, v in value.items()}
        elif key not in _JSON_VALUES:
            value = _rebase(value, base)
        out[key] = value
    return out


def call_schema(tools: list[dict], key: str = "arguments") -> dict:
    """The JSON schema of one call's body: any of the functions, by name, with its arguments under
    ``key`` ("parameters" in Llama's syntax)."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        key: _rebase(t["function"]["parameters"], f"#/anyOf/{i}/properties/{key}")},
        "required": ["name", key], "additionalProperties": False} for i, t in enumerate(tools)],
        "x-guidance": JSON_OPTIONS}


def tool_grammar(tools: list[dict], choice: str, parallel: bool, fmt: ToolFormat = HERMES,
                 token_of=lambda marker: None) -> Grammar:
    """The Lark grammar of a generation under ``choice`` in ``fmt``'s syntax; the same tools give the same
    source (the engine caches compiled grammars by source), as key order is kept, never sorted: it is the
    properties' order."""
    if fmt.name == "harmony":
        return harmony.tool_grammar(tools, choice, token_of)
    body = "%json " + json.dumps(call_schema(tools, fmt.arguments_key))
    return Grammar("lark", fmt.grammar(body, choice, parallel, token_of))


# --- the conversation -------------------------------------------------------------------------------


def takes_tools(template_source: str | None) -> bool:
    return bool(template_source) and re.search(r"\btools\b", template_source) is not None


def _takes_tool_role(source: str) -> bool:
    # Documented rule: a template handles tool results when it names the role as a string literal, as in
    # `message.role == "tool"` (Qwen2.5, Llama 3.1, Mistral). SmolLM2's prints any role but never says so.
    return re.search(r"""['"]tool['"]""", source) is not None


def _tools_in_system_message(source: str) -> bool:
    # Phi-4-mini's template reads the tools from the system message (a JSON string between <|tool|> tags),
    # not from its `tools` variable
    return "<|tool|>" in source and re.search(r"""message\[['"]tools['"]\]|message\.tools\b""", source) is not None


def default_tool_prompt(plan: ToolPlan) -> str:
    """Our instruction to call functions in the plan's syntax, worded for its choice."""
    return plan.format.instruction(plan.choice, plan.function, plan.parallel)


def _calls(message: dict, i: int) -> list[tuple[str | None, str, object]]:
    """(id, name, arguments) of an assistant message's ``tool_calls``; arguments parsed when they parse."""
    calls = message.get("tool_calls")
    ok = isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                         and isinstance(c["function"].get("name"), str) for c in calls)
    if not ok:
        raise validation_error(f"`messages[{i}].tool_calls` must be an array of function calls", param="messages")
    out = []
    for c in calls:
        args = c["function"].get("arguments", "{}")
        parsed = _loads(args) if isinstance(args, str) else args
        out.append((c.get("id"), c["function"]["name"], args if parsed is _BAD else parsed))  # bad: as written
    return out


def prepare_messages(messages: list[dict], plan: ToolPlan | None, template_source: str | None,
                     tool_prompt: str | None = None) -> list[dict]:
    """OpenAI messages (string or None contents) made renderable by the template, tools shown to the model.

    - assistant ``tool_calls``: kept for a template that reads them (arguments as a dict, as HF templates
      expect), else written into the content in the model's syntax, so the model sees what it called;
    - ``role: "tool"``: kept for a template that names that role, else a user message
      ``<tool_response>\\n...\\n</tool_response>`` (consecutive results share one, for templates that insist
      on alternating roles);
    - tools (with ``plan``): a template that declares tools gets them from ``plan.template_tools``; it is
      told the syntax (``"\\n---\\n" + prompt``) unless it teaches the plan's syntax itself. A
      template without tools gets ``"\\n---\\n" + tools JSON + "\\n" + prompt`` (TGI's injection). Either goes
      at the end of the last message that is not an assistant's (which would be continued, not answered).
      ``tool_prompt`` None means ``default_tool_prompt``; a given one is always used.
    """
    source = template_source or ""
    fmt = plan.format if plan is not None else detect_tool_format(source)
    keep_calls, keep_role = "tool_calls" in source, _takes_tool_role(source)
    out: list[dict] = []
    merged_tool = False  # out[-1] is a user message made of tool results
    for i, message in enumerate(messages):
        m = dict(message)
        role = m.get("role")
        if role == "tool" and not keep_role:
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if merged_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            merged_tool = True
            continue
        merged_tool = False
        if m.get("tool_calls") is not None:
            calls = _calls(m, i)
            if keep_calls:
                m["tool_calls"] = [({"id": cid} if cid is not None else {})
                                   | {"type": "function", "function": {"name": name, "arguments": args}}
                                   for cid, name, args in calls]
                out.append(m)
                continue
            del m["tool_calls"]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else [])
                                     + [fmt.calls_text([(name, args) for _, name, args in calls])])
        if m.get("content") is None:
            m["content"] = ""  # templates that concatenate content (SmolLM2's) fail on None
        out.append(m)
    if plan is not None and out and _tools_in_system_message(source):
        system = out[0] if out[0].get("role") == "system" else {"role": "system", "content": ""}
        system["tools"] = json.dumps(plan.offered, ensure_ascii=False)
        out[:0] = [] if system is out[0] else [system]
    if plan is not None and out:
        prompt = tool_prompt if tool_prompt is not None else default_tool_prompt(plan)
        if not takes_tools(source):
            extra = "\n---\n" + json.dumps(plan.offered, ensure_ascii=False) + "\n" + prompt
        elif tool_prompt is not None or detect_tool_format(source) is not fmt or not fmt.shown_in(source):
            extra = "\n---\n" + prompt
        else:
            extra = ""
        if extra:
            target = next((m for m in reversed(out) if m.get("role") != "assistant"), out[-1])
            target["content"] = (target.get("content") or "") + extra
    return out


# --- the output -------------------------------------------------------------------------------------


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    ended: bool = False  # the arguments value is whole (the outer object's "}" was seen)


class ToolCallStream:
    """Generated text in (any fragments), OpenAI chat-completion deltas out, for calls in ``fmt``'s syntax.

    Content deltas come as the text arrives, less a held-back tail: trailing whitespace (dropped if a call
    follows) and what could still begin the format's lead marker. (Llama's syntax has none: an answer is
    calls when it begins with "{" or <|python_tag|>, so only its opening whitespace waits.) A call is
    announced (id, name, empty arguments) as soon as its name is known, then its arguments follow in
    fragments that join to exactly the generated JSON text. Markers, the body's braces and anything
    between or after calls are never shown.
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id, fmt: ToolFormat = HERMES):
        self._new_id = new_id
        self._fmt = fmt
        self._text = ""
        self._pos = 0  # everything before is handled
        self._sent = 0  # the content before this index of _text is emitted
        # start (Llama: is the answer calls?) | text | plain (no calls ever) | name | key | arguments | between
        self._state = "text" if fmt.lead is not None else "start"
        self._started = False  # the arguments value has begun (whitespace before it is skipped)
        self._depth, self._in_string, self._escape = 0, False, False
        self._calls: list[_Call] = []
        self.content = ""  # every content delta, joined

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    @property
    def tool_calls(self) -> list[dict]:
        """The whole calls so far (ended, with arguments that parse), in OpenAI's shape."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self._calls if c.ended and is_json(c.arguments)]

    def feed(self, text: str) -> list[dict]:
        self._text += text
        out: list[dict] = []
        while self._step(out):
            pass
        # keep only what is not handled yet, so a long generation costs linear time
        cut = min(self._pos, self._sent) if self._state in ("text", "start", "plain") else self._pos
        self._text, self._pos, self._sent = self._text[cut:], self._pos - cut, max(self._sent - cut, 0)
        self.content += "".join(d.get("content", "") for d in out)
        return out

    def finish(self) -> list[dict]:
        """The held-back content, when no call began."""
        if self._state not in ("text", "start", "plain") or self._sent == len(self._text):
            return []
        delta, self._sent = self._text[self._sent:], len(self._text)
        self.content += delta
        return [{"content": delta}]

    def _step(self, out: list[dict]) -> bool:
        """Handle what the text allows from ``_pos``; True when the state moved on (call again)."""
        text = self._text
        if self._state == "start":
            return self._start()
        if self._state == "plain":
            if len(text) > self._sent:
                out.append({"content": text[self._sent:]})
            self._pos = self._sent = len(text)
            return False
        if self._state in ("text", "between"):
            marker = self._fmt.lead if self._state == "text" else self._fmt.opener
            at = text.find(marker, self._pos)
            end = at if at != -1 else len(text) - held_tail(text, (marker,))
            if self._state == "text":
                shown = end
                while shown > self._sent and text[shown - 1].isspace():
                    shown -= 1
                if shown > self._sent:
                    out.append({"content": text[self._sent:shown]})
                    self._sent = shown
            if at == -1:
                self._pos = max(self._pos, end)
                return False
            if marker == "{":  # the JSON forms: the opener is the call's own brace
                self._pos, self._state = at, "name"
            else:
                self._pos = at + len(marker)
                self._state = "name" if marker == self._fmt.opener else "between"
            return True
        if self._state == "name":
            match = _NAME.match(text, self._pos)
            if match is None:
                return False
            call = _Call(self._new_id(), json.loads(f'"{match.group(1)}"'))
            self._calls.append(call)
            out.append({"tool_calls": [{"index": len(self._calls) - 1, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            self._pos, self._state = match.end(), "key"
            return True
        if self._state == "key":
            match = _ARGUMENTS_KEY.match(text, self._pos)
            if match is None:
                return False
            self._pos, self._state = match.end(), "arguments"
            self._started, self._depth, self._in_string, self._escape = False, 0, False, False
            return True
        return self._arguments(out)

    def _start(self) -> bool:
        """Llama's syntax: the answer is calls when it begins (after whitespace) with "{" or the tag."""
        text, i = self._text, self._pos
        while i < len(text) and text[i].isspace():
            i += 1
        rest, tag = text[i:], self._fmt.optional_tag or "{"
        if rest.startswith("{") or rest.startswith(tag):
            self._pos, self._state = i, "between"
            return True
        if not rest or tag.startswith(rest):
            return False  # may still become a call
        self._state = "plain"
        return True

    def _arguments(self, out: list[dict]) -> bool:
        """Scan the arguments value, string- and escape-aware, up to the "}" or "," that ends it."""
        text, i = self._text, self._pos
        if not self._started:
            while i < len(text) and text[i].isspace():
                i += 1
            self._started = i < len(text)
        start, ended = i, False
        while i < len(text):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}],":
                if self._depth == 0:
                    ended = True
                    break
                if ch != ",":
                    self._depth -= 1
            i += 1
        call = self._calls[-1]
        if i > start:  # one fragment per feed: this scan stops only at the end of the text or of the value
            call.arguments += text[start:i]
            out.append({"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": text[start:i]}}]})
        self._pos = i
        if ended:
            call.ended, self._state = True, "between"
        return ended


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return _BAD


def is_json(text: str) -> bool:
    """Whether ``text`` parses as JSON (a call's arguments that do not, cut by max_tokens, are dropped)."""
    return _loads(text) is not _BAD


def parse_tool_output(text: str, new_id: Callable[[], str] = new_call_id,
                      fmt: ToolFormat = HERMES) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished generation. Parsed by ``ToolCallStream``, so a stream and a whole
    answer agree. Without a whole call (say, cut by max_tokens) the text is all content."""
    stream = ToolCallStream(new_id, fmt)
    stream.feed(text)
    calls = stream.tool_calls
    if not calls:
        return text, []
    return stream.content or None, calls
