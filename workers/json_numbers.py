"""Numbers in constrained JSON stop at a float64's precision (issue #37).

A JSON grammar lets a number run on: llguidance writes a JSON number as one regex lexeme with no bound on
its digits, and a small model asked for pi under a schema writes ``3.14159265359873926536163363232111...``
until ``max_tokens``. JSON parsers keep a float64, which 17 significant digits round-trip exactly; digits
past those change nothing the caller reads. So rank 0 caps numbers in the masks it computes: once a number
holds ``SIGNIFICANT_DIGITS`` significant digits (counted from its first non-zero digit), no token that adds
a digit or a decimal point to it is allowed, and the grammar's other choices (a delimiter, an exponent)
end it. The same holds for the zeros before the first significant digit (``0.0000...``; smaller values take
an exponent) and for the exponent's digits (a float64's fit in three).

Why in the masks and not in the grammar: llguidance 1.9's JSON compiler has no option that bounds a
number's length (its ``x-guidance`` options are whitespace, separators and escapes), a number schema takes
no ``pattern``, and ``multipleOf`` bounds only fraction digits, to 10 at most (finer steps fail "too many
digits"), which rounds away precision a float64 holds and leaves the integer part unbounded. Writing the
schema out as a Lark grammar with bounded number lexemes would mean re-implementing llguidance's JSON
Schema compiler (bounds, ``multipleOf``, combinators) to change one lexeme.

Where numbers are: ``JsonScanner`` follows the output's bytes. A ``json_schema`` grammar's output is one
JSON document; a Lark grammar with ``%json`` (tool calls) has JSON inside text, so the scanner enters JSON
at a ``{`` or ``[`` and leaves it at the matching close. Text is never capped: a cap needs the grammar's own
mask to refuse every token that starts with a letter other than ``e``/``E`` (what a JSON number allows),
which free text, and a string the scanner misread, do not. A cap that would leave no token at all (an
integer schema whose ``minimum`` needs more digits) is not applied: the grammar's own mask stands.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llmbus.bus.messages import Grammar

SIGNIFICANT_DIGITS = 17  # a float64 round-trips through 17 significant digits; JSON parsers keep no more
LEADING_ZEROS = 17  # zeros before a number's first significant digit ("0.000..."), its integer "0" included
EXPONENT_DIGITS = 3  # a float64's decimal exponent is within -324..308

_DIGITS = frozenset(b"0123456789")
_NUMBER_BYTES = _DIGITS | frozenset(b".eE+-")
_INTEGER, _FRACTION, _EXPONENT = range(3)


class Number(NamedTuple):
    """The number being written: its part, and the digits counted so far."""

    part: int = _INTEGER
    significant: int = 0
    zeros: int = 0
    exponent: int = 0


def _advance(number: Number, byte: int) -> Number | None:
    """``number`` after ``byte``, or None where ``byte`` ends it (a JSON number's bytes are not checked:
    the grammar did)."""
    part, significant, zeros, exponent = number
    if byte in _DIGITS:
        if part == _EXPONENT:
            return Number(part, significant, zeros, exponent + 1)
        if significant or byte != 0x30:
            return Number(part, significant + 1, zeros, exponent)
        return Number(part, significant, zeros + 1, exponent)
    if byte == 0x2E and part == _INTEGER:
        return Number(_FRACTION, significant, zeros, exponent)
    if byte in b"eE" and part != _EXPONENT:
        return Number(_EXPONENT, significant, zeros, exponent)
    if byte in b"+-" and part == _EXPONENT and exponent == 0:
        return number
    return None


def _too_long(number: Number) -> bool:
    return (number.significant > SIGNIFICANT_DIGITS or number.zeros > LEADING_ZEROS
            or number.exponent > EXPONENT_DIGITS)


def overruns(number: Number, text: bytes) -> bool:
    """Whether writing ``text`` next would take ``number`` past a float64's precision: a digit past the
    bounds, or a decimal point after all 17 significant digits (a digit must follow it)."""
    for byte in text:
        if byte == 0x2E and number.part == _INTEGER and number.significant >= SIGNIFICANT_DIGITS:
            return True
        after = _advance(number, byte)
        if after is None:
            return False
        if _too_long(after):
            return True
        number = after
    return False


class JsonScanner:
    """Where an output stands in JSON, fed its bytes as they are generated: ``number`` is the number being
    written (None outside one). ``whole``: the output is one JSON document; otherwise JSON starts at a
    ``{`` or ``[`` in text and ends at its matching close."""

    __slots__ = ("whole", "depth", "in_string", "escaped", "number")

    def __init__(self, whole: bool):
        self.whole = whole
        self.depth = 0
        self.in_string = self.escaped = False
        self.number: Number | None = None

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # quote
                    self.in_string = False
                continue
            if self.number is not None:
                self.number = _advance(self.number, byte)
                if self.number is not None:
                    continue
            if not self.whole and self.depth == 0:  # text around JSON
                if byte in b"{[":
                    self.depth = 1
                continue
            if byte == 0x22:
                self.in_string = True
            elif byte in b"{[":
                self.depth += 1
            elif byte in b"}]":
                self.depth -= 1
            elif byte == 0x2D or byte in _DIGITS:
                self.number = _advance(Number(), byte) if byte != 0x2D else Number()


def scanner_for(grammar: Grammar) -> JsonScanner | None:
    """A scanner for a grammar whose output holds JSON (a schema, or a Lark grammar with ``%json``);
    None for the others (a regex or Lark grammar of the client's own is theirs to bound)."""
    if grammar.kind == "json_schema":
        return JsonScanner(whole=True)
    if grammar.kind == "lark" and "%json" in grammar.source:
        return JsonScanner(whole=False)
    return None


class NumberCap:
    """The vocabulary's tokens as the cap needs them: their bytes, those that can extend a number, and
    those that start with a letter a JSON number never takes (the probe that tells numbers from text)."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        first = [b[0] if b else -1 for b in token_bytes]
        self.extenders = np.array([i for i, c in enumerate(first) if c in _NUMBER_BYTES], dtype=np.int64)
        letters = [i for i, c in enumerate(first) if (0x41 <= c <= 0x5A or 0x61 <= c <= 0x7A) and c not in b"eE"]
        # the one-letter tokens are probe enough (text and strings allow every one), and few to look up
        self.letters = np.array([i for i in letters if len(token_bytes[i]) == 1] or letters, dtype=np.int64)

    @staticmethod
    def _allowed(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]

    def apply(self, row: np.ndarray, number: Number) -> None:
        """Clear, in the mask ``row`` (int32 words, one bit per token), the tokens that would take ``number``
        past a float64's precision, unless the mask allows text or the cap would leave nothing."""
        words = row.view(np.uint32)
        if len(self._allowed(words, self.letters)):
            return  # not a JSON number: text, or a string
        over = [int(t) for t in self._allowed(words, self.extenders) if overruns(number, self.token_bytes[t])]
        if not over:
            return
        kept = words.copy()
        for token in over:
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
        if not words.any():
            words[:] = kept
