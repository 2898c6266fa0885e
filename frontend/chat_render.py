r"""Chat templates rendered the way transformers renders them, without importing transformers.

``render_chat`` gives, for every way the frontend renders a conversation, the text transformers 5's
``render_jinja_template`` gives (what ``tokenizer.apply_chat_template`` renders), or fails where it fails
(tests/frontend/test_chat_render.py holds the two side by side over the test models' templates, hand-written
ones that use what Hub templates use, and conversations with tools, reasoning, content parts and a continued
final message). The frontend used to call transformers' function itself, and importing transformers cost each
frontend start 0.9 s of CPU and 28 MB of peak memory: importing ``llmbus.frontend.app`` and rendering a
message through ``ChatTemplate`` took 1.46 s of CPU at a peak RSS of 89 MB before, 0.59 s and 61 MB after
(medians of 7 runs on the 2-core test machine, transformers 5.24), measured by::

    python -c "import pathlib, resource, tempfile, time; t = time.process_time(); import llmbus.frontend.app; \
    from llmbus.frontend.chat import ChatTemplate; d = pathlib.Path(tempfile.mkdtemp()); \
    (d / 'chat_template.jinja').write_text('{% for m in messages %}{{ m.content | tojson }}{% endfor %}'); \
    c = ChatTemplate(d); c.load(); c.render([{'role': 'user', 'content': 'hi'}]); \
    print(time.process_time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"

TGI's router renders with its own minijinja environment, and llama.cpp with minja, for the same reason.

What a template sees, as in transformers:
- Jinja's sandbox that refuses every change to a value (``ImmutableSandboxedEnvironment``), with
  ``trim_blocks`` and ``lstrip_blocks`` (the newline after a tag is dropped, and the spaces before a tag
  that starts a line) and the ``break``/``continue`` loop controls.
- ``tojson`` with JSON's own options (``ensure_ascii`` off, ``indent``, ``separators``, ``sort_keys``) and no
  HTML escaping; ``raise_exception(message)``, which fails the rendering with the template's message;
  ``strftime_now(format)``, the local time now; a ``namespace`` that takes no name starting with ``_``; a
  ``dict`` that only builds dicts; ``{% generation %}`` blocks (transformers marks the assistant's text with
  them for its masks, which llmbus never asks for), which render their body.
- ``messages``, ``tools`` (None when there are none), ``documents`` (always None), ``add_generation_prompt``
  and the variables given, every value rebuilt from plain data (``plain_data``); a message's reasoning,
  whichever of ``reasoning_content``, ``thinking`` or ``reasoning`` it came as, also as ``reasoning_content``
  and (where the message has none of its own) ``thinking``, the names templates read it by.

A continued final message (``continue_final_message``) is rendered with a marker after its text, and the
prompt is cut where the marker lands: just before it, or where the text before it ends if the template
trimmed the marker's trailing space. It fails where the template reads no ``content``, the final message has
no text to continue, or the marker or the text does not appear in the rendering (a template that drops the
message).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Mapping
from datetime import datetime

import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# The names a message's reasoning comes under, the first set one winning; the template gets it under the
# first two (the usual name, and gpt-oss's), and under the third where it came so.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' marker itself: a template that splits, cuts or changes the case of the final message does
# so to the marker too, and the prompt is cut where transformers cuts it only if the marker is the same text
CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "
# the renderer's own names: a variable by one of them is an error (a TypeError in transformers' call too)
OWN_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "conversations",
                       "chat_template", "continue_final_message", "return_assistant_tokens_mask"})


def _refuse_private(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not store {name!r} in a namespace: names starting with "
                            f"an underscore are refused")


class _Namespace(Namespace):
    """Jinja's ``namespace()`` without names starting with ``_``, which could reach Python's internals.
    (Namespace answers every attribute from its store, so the check is a module function.)"""

    def __init__(*args, **kwargs):  # Jinja's signature, so that namespace(self=...) works too
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _refuse_private(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:  # {% set ns.name = value %}
        _refuse_private(name)
        Namespace.__setitem__(self, name, value)


class _DictBuilder:
    """The template's ``dict``: ``dict(...)`` and ``dict.fromkeys(...)`` build dicts; nothing else of the
    type is reachable."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the block's body, rendered as a call block (its own scope,
    as in transformers)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as ``json.dumps`` writes it, non-ASCII kept (Jinja's own ``tojson`` escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise TemplateError(message)


def strftime_now(format):  # the parameter's name is the templates' (strftime_now(format=...))
    return datetime.now().strftime(format)


ENVIRONMENT = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
ENVIRONMENT.filters["tojson"] = tojson
ENVIRONMENT.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=_DictBuilder(),
                           namespace=_Namespace)


@functools.lru_cache(maxsize=32)
def compiled(source: str) -> jinja2.Template:
    """The template, compiled once per source; a syntax error raises ``jinja2.TemplateSyntaxError``."""
    return ENVIRONMENT.from_string(source)


def plain_data(value):
    """``value`` rebuilt from JSON's types (dicts, lists, tuples, str, int, float, bool, None), which carry
    no method the sandbox does not know: a subclass of a scalar (an enum) becomes its plain value, a
    dataclass or a pydantic model its fields, a numpy scalar its Python value, anything else a placeholder
    naming its type (``"<ndarray>"``). Always a copy, so the renderer's changes never reach the caller."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # a subclass's value, whatever its own __str__ says (an enum's names its class)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only where numpy was imported
    if numpy is not None and isinstance(value, numpy.generic):
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_names(message: dict) -> dict:
    """``message`` with its reasoning (the first of ``REASONING_FIELDS`` set) also as ``reasoning_content``
    and, unless the message has a ``thinking`` of its own, as ``thinking``, which then comes first."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    named = {"thinking": reasoning}
    named.update(message)
    named["reasoning_content"] = reasoning
    return named


def _mark_final_message(source: str, chat: list[dict]) -> str:
    """Put ``CONTINUE_MARKER`` after the final message's text (its last text part's, for parts) and return
    that text."""
    if not chat:
        raise ValueError("there is no final message to continue: the conversation is empty")
    final = chat[-1]
    text = final.get("content")
    if text is None:
        raise ValueError("the final message has no content to continue")
    if "content" not in source:
        raise ValueError("the final message cannot be continued: the chat template never reads `content`")
    if not isinstance(text, (list, tuple)):
        final["content"] = text + CONTINUE_MARKER
        return text
    for part in reversed(text):
        if "text" in part:
            text = part["text"]
            part["text"] = text + CONTINUE_MARKER
            return text
    raise ValueError("the final message cannot be continued: it has no text part")


def _cut_at_marker(rendered: str, text: str) -> str:
    marker = CONTINUE_MARKER.strip()
    if text.strip() not in rendered or marker not in rendered:
        raise ValueError(f"the final message cannot be continued: the chat template does not write it as it "
                         f"is (final message: {text.strip()!r})")
    at = rendered.rindex(marker)
    # a template that trims the message trims the marker's space too: the cut is then where the text ends
    return rendered[:at] if rendered.startswith(CONTINUE_MARKER, at) else rendered[:at].rstrip()


def render_chat(source: str, messages: list[dict], tools: list[dict] | None = None, *,
                add_generation_prompt: bool = False, continue_final_message: bool = False,
                variables: Mapping | None = None) -> str:
    """One conversation through the template ``source``: the text transformers' ``render_jinja_template``
    gives for ``[messages]`` with these arguments and ``variables`` as its keyword arguments (the special
    tokens, a request's ``chat_template_kwargs``). ``tools``: JSON schemas. ``continue_final_message``: the
    prompt ends right after the final message's text (it continues that text). The caller's values are
    never changed. Raises what the template raises (``raise_exception``'s ``jinja2.TemplateError`` with the
    template's message), ``ValueError`` where the final message cannot be continued."""
    template = compiled(source)
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("a tool is given as a JSON schema (a dict)")
    variables = dict(variables or {})
    if OWN_NAMES & variables.keys():
        raise TypeError(f"a chat template variable may not be named {sorted(OWN_NAMES & variables.keys())[0]}")
    chat = plain_data(list(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"a chat message is a dict, not {message!r}")
    chat = [_with_reasoning_names(message) for message in chat]
    text = _mark_final_message(source, chat) if continue_final_message else None
    rendered = template.render(messages=chat, tools=plain_data(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **plain_data(variables))
    return _cut_at_marker(rendered, text) if continue_final_message else rendered
