"""Each token's own bytes, as OpenAI's logprobs report them (``bytes``, and the ``token`` text made of them).

Decoding one id alone is not a token's piece: a byte-level token that ends inside a character decodes to
U+FFFD, and SentencePiece decoders strip the leading space of a text's first token ("▁Paris" → "Paris").
A piece is read from the vocabulary instead, the way the tokenizer's decoder would read it inside a text:
GPT-2's byte-level characters mapped back to their bytes, ``<0xAB>`` byte-fallback tokens as that byte,
SentencePiece's "▁" as a space; added tokens are their content. Concatenated, the pieces of a text's tokens
are its UTF-8 bytes. Other decoders (WordPiece, ...) fall back to decoding the id alone.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer and decoder use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _decoders(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoders(inner)]
    return [spec]


class TokenPieces:
    """Token id → its bytes, read once from ``tokenizer``'s spec and cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        spec = json.loads(tokenizer.to_str())
        self._tokenizer = tokenizer
        self._added = {t["id"]: t["content"].encode("utf-8") for t in spec.get("added_tokens", [])}
        decoders = _decoders(spec.get("decoder"))
        kinds = {d.get("type") for d in decoders}
        self._byte_level = {char: byte for byte, char in byte_to_unicode().items()} if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        # SentencePiece's word marker, by either decoder that turns it into a space
        self._replacements = [(d["pattern"]["String"], d["content"]) for d in decoders
                              if d.get("type") == "Replace" and "String" in d.get("pattern", {})]
        self._replacements += [(d.get("replacement", "▁"), " ") for d in decoders if d.get("type") == "Metaspace"]
        self._known = "ByteLevel" in kinds or bool(self._replacements) or self._byte_fallback
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._read(token_id)
        return piece

    def _read(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        token = self._tokenizer.id_to_token(token_id)
        if token is None:  # past the vocabulary (a model's padded logits)
            return b""
        if not self._known:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._byte_level is not None and all(char in self._byte_level for char in token):
            return bytes(self._byte_level[char] for char in token)
        if self._byte_fallback and (byte := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(byte.group(1), 16)])
        for pattern, content in self._replacements:
            token = token.replace(pattern, content)
        return token.encode("utf-8")
