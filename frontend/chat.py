"""The model's chat template: found where transformers looks for it, rendered as transformers' renderer
renders it (chat_render.py), so a conversation becomes exactly the text ``tokenizer.apply_chat_template``
would give.

Where to look, first hit wins (transformers 5 and TGI agree on the order): ``chat_template.jinja``,
``chat_template.json``, then ``tokenizer_config.json`` ``chat_template`` (a string, or a list of named
templates of which ``default`` is used). The template sees ``messages``, ``add_generation_prompt``, the
special tokens (``bos_token``, ``eos_token``, ...), ``tools`` when given and a request's
``chat_template_kwargs`` (``enable_thinking``, ...), which each API's reasoning control sets too
(thinking_controls.py). As in TGI, a conversation that ends with an assistant message is continued (the
prompt stops right after that message's content) instead of being answered.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from llmbus.frontend.chat_render import compiled, render_chat
from llmbus.frontend.errors import ApiError, ErrorKind, validation_error
from llmbus.frontend.harmony import TEXT_MARKERS
from llmbus.frontend.images import MARKDOWN_IMAGE
from llmbus.frontend.reasoning import ReasoningMarkers, find_effort_variable, find_markers, find_thinking_switch
from llmbus.frontend.tool_formats import ToolFormat, tool_format

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")


def template_error(detail: str) -> ApiError:
    return ApiError(ErrorKind.TEMPLATE, detail)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pick(template) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def find_chat_template(model_dir: str | Path) -> str | None:
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for path in (model_dir / "chat_template.json", model_dir / "tokenizer_config.json"):
        if path.is_file():
            template = _pick(_read_json(path).get("chat_template"))
            if template is not None:
                return template
    return None


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


@dataclass(frozen=True)
class ChatFormat:
    """How the model writes: its tool-call syntax, its thinking markers and switch, and its added tokens by
    text (a marker held as one token is allowed in grammars as that token too); and whether it reads images
    (a message's image parts become ``![](<url>)`` in its text, TGI's form, which validation loads)."""

    tools: ToolFormat
    reasoning: ReasoningMarkers | None
    added_tokens: dict[str, int]
    special_ids: frozenset[int] = frozenset()  # the ids a generated text leaves out
    thinking_switch: str | None = None  # the template variable that turns thinking on and off
    reads_images: bool = False  # a vision-language model
    effort_variable: str | None = None  # the template variable that takes a reasoning effort (gpt-oss's)

    @property
    def harmony(self) -> bool:
        """Whether answers are OpenAI's harmony messages (gpt-oss: harmony.py), read with its tool syntax: the
        template's (``tool_formats.detect_tool_format``) or ``--tool-call-parser harmony``."""
        return self.tools.name == "harmony"

    @property
    def reasons(self) -> bool:
        """Whether the model reasons: its template writes thinking markers or has a switch for thinking (or
        writes harmony, whose analysis channel is its reasoning)."""
        return self.reasoning is not None or self.thinking_switch is not None or self.harmony

    def token_of(self, marker: str) -> int | None:
        return self.added_tokens.get(marker)

    @property
    def markers(self) -> frozenset[str]:
        """The markers the parsers read that are special tokens, which a generated text leaves out: a chat
        answer's text keeps them (Mistral's [TOOL_CALLS]). Usually none (Qwen's are plain added tokens)."""
        fmt, reasoning = self.tools, self.reasoning
        found = [fmt.lead, fmt.optional_tag, *(fmt.tags or ())]
        found += [reasoning.start, reasoning.end] if reasoning else []
        found += TEXT_MARKERS if self.harmony else []
        return frozenset(m for m in found if m and self.added_tokens.get(m) in self.special_ids)


class ChatTemplate:
    """Renders conversations with the model's template; ``TEMPLATE`` errors (422) when it has none."""

    def __init__(self, model_dir: str | Path, tokenizer_config: str | Path | None = None):
        """``tokenizer_config`` (--tokenizer-config-path): a tokenizer_config.json whose ``chat_template`` wins
        over the model's and whose special tokens override the model's."""
        model_dir = Path(model_dir)
        given = _read_json(Path(tokenizer_config).expanduser()) if tokenizer_config is not None else {}
        self.source = _pick(given.get("chat_template")) or find_chat_template(model_dir)
        self.special_tokens = {**_special_tokens(_read_json(model_dir / "tokenizer_config.json")),
                               **_special_tokens(given)}
        self._format: tuple[tuple[str, bool], ChatFormat] | None = None

    def chat_format(self, tool_call_parser: str, tokenizer, special_ids=frozenset(),
                    reads_images: bool = False) -> ChatFormat:
        """The model's ``ChatFormat`` under ``--tool-call-parser`` (``auto``: the template's), worked out
        once. ``tokenizer``: a ``tokenizers.Tokenizer``; ``special_ids``: the ids its texts leave out;
        ``reads_images``: a vision-language model."""
        key = (tool_call_parser, reads_images)
        if self._format is None or self._format[0] != key:
            added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
            self._format = (key, ChatFormat(tool_format(tool_call_parser, self.source), find_markers(self.source),
                                            added, frozenset(special_ids), find_thinking_switch(self.source),
                                            reads_images, find_effort_variable(self.source)))
        return self._format[1]

    @property
    def available(self) -> bool:
        return self.source is not None

    def load(self) -> None:
        """Compile the template (a few ms for a large one) at start-up rather than in the first chat request.
        A template that does not compile does not stop the start: each chat request reports its error."""
        if self.source is not None:
            with contextlib.suppress(Exception):  # the error is the template's, told at each render
                compiled(self.source)

    def render(self, messages: list[dict], tools: list[dict] | None = None, extra: dict | None = None,
               image_token: str | None = None) -> str:
        """The prompt; ``extra``: more variables for the template (a request's ``chat_template_kwargs``).

        ``image_token`` (a vision model's): messages hold their images as ``![](<url>)`` in their text, TGI's
        form, which every template reads as text. A template that reads content parts (as vision models'
        templates do: llava-hf's picks a message's parts by type, and would drop a plain string's text) gets
        every message as text and ``{"type": "image"}`` parts instead, as transformers' processors hand it
        (vLLM's "openai" content format); each image token it writes then becomes its image's reference
        again, in order."""
        if self.source is None:
            raise template_error("template not found")
        if image_token is None or not self.reads_content_parts:
            return self._render_messages(messages, tools, extra)
        references = [ref for msg in messages for ref in _image_references(msg)]
        rendered = self._render_messages([_as_parts(msg) for msg in messages], tools, extra)
        return _references_in_place(rendered, image_token, references)

    def _render_messages(self, messages: list[dict], tools: list[dict] | None, extra: dict | None) -> str:
        continue_final = bool(messages) and messages[-1].get("role") == "assistant"
        try:
            return render_chat(self.source, messages, tools or None, add_generation_prompt=not continue_final,
                               continue_final_message=continue_final,
                               variables={**self.special_tokens, **(extra or {})})
        except Exception as e:  # noqa: BLE001 - any template failure is the template's error, not ours
            # raise_exception('...') in a template arrives here with the template's own words
            raise template_error(str(e) or type(e).__name__) from None

    @functools.cached_property
    def reads_content_parts(self) -> bool:
        """Whether the template writes a message's text given as ``[{"type": "text", "text": ...}]`` parts (a
        template that prints the content as it is would write the list's repr instead)."""
        if self.source is None:
            return False
        probe = "llmbus-probe-7f3a"
        try:
            rendered = self._render_messages([{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                             None, None)
        except ApiError:
            return False
        return probe in rendered and "'type'" not in rendered


def _image_references(message: dict) -> list[str]:
    content = message.get("content")
    return MARKDOWN_IMAGE.findall(content) if isinstance(content, str) else []


def _as_parts(message: dict) -> dict:
    """``message`` with its text as content parts: text, and its image references as ``{"type": "image"}``."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    texts = MARKDOWN_IMAGE.split(content)
    parts: list[dict] = [{"type": "text", "text": texts[0]}] if texts[0] else []
    for text in texts[1:]:
        parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def _references_in_place(rendered: str, image_token: str, references: list[str]) -> str:
    """``rendered`` with the i-th ``image_token`` the template wrote replaced by the i-th image's reference."""
    pieces = rendered.split(image_token)
    if len(pieces) - 1 != len(references):
        raise validation_error(f"the chat template wrote {len(pieces) - 1} image tokens ({image_token}) for "
                               f"the conversation's {len(references)} images: an image is sent as an image part, "
                               f"and the image token may not appear in a message's text")
    out = [pieces[0]]
    for reference, after in zip(references, pieces[1:]):
        out += [reference, after]
    return "".join(out)
