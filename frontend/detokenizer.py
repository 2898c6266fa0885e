"""Incremental detokenization: the text each new token adds, correct across multi-byte characters.

A token that ends in the middle of a UTF-8 character (byte-level BPE, byte-fallback) yields "" and the
token that completes the character carries all of it, as TGI's ``decode_token`` does. The last few
prompt tokens are kept as context so that decoders which treat the start of a sequence specially
(SentencePiece's leading space) give the first generated token its real text.

``tokenizers.decoders.DecodeStream`` (tokenizers >= 0.21) does exactly this in Rust; on older versions the
same prefix/read-offset algorithm runs in Python.
"""

from __future__ import annotations

from tokenizers import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

# TGI keeps 5 prompt tokens of context (prefix_offset = len(prompt) - 5).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed token ids one at a time with ``step``; special tokens are kept in the text."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self._tokenizer = tokenizer
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if DecodeStream is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=False)
        else:
            self._stream = None
            self._ids = list(context)
            self._prefix_offset = 0
            self._read_offset = len(context)
        self._history = context  # ids that produced text (the last few), context for ``flush``
        self._pending: list[int] = []  # ids fed since the last text

    def step(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                text = self._stream.step(self._tokenizer, token_id) or ""
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
                text = ""
        else:
            text = self._step_python(token_id)
        if text:
            self._history = (self._history + self._pending + [token_id])[-CONTEXT_TOKENS:]
            self._pending = []
        else:
            self._pending.append(token_id)
        return text

    def flush(self) -> str:
        """The text of tokens still waiting for the rest of a character, when no more will come:
        the incomplete bytes decode as U+FFFD, as in TGI's final ``generated_text``."""
        if not self._pending:
            return ""
        decode = self._tokenizer.decode
        pending, history = self._pending, self._history
        self._history, self._pending = (history + pending)[-CONTEXT_TOKENS:], []
        base = decode(history, skip_special_tokens=False)
        full = decode(history + pending, skip_special_tokens=False)
        return full[len(base):] if full.startswith(base) else decode(pending, skip_special_tokens=False)

    def _step_python(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=False)
        new = decode(self._ids[self._prefix_offset:], skip_special_tokens=False)
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # keep memory bounded: everything before the prefix is never decoded again
            if self._prefix_offset > 64:
                self._ids = self._ids[self._prefix_offset:]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return new[len(prefix):]
        return ""
