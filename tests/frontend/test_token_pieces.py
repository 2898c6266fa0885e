"""Each token's own bytes (OpenAI's logprob ``bytes``) for the vocabularies models ship: SentencePiece's with
byte fallback (Llama 2, Mistral), read from the vocabulary as their decoders read it. (GPT-2's byte-level
vocabularies: through the served routes, tests/frontend/test_openai_frontend.py.)"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models

from llmbus.frontend.token_pieces import TokenPieces


def _sentencepiece_like() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xF0>": 3, "<0x9F>": 4, "<0x99>": 5, "<0x82>": 6,
             "▁Paris": 7, "▁is": 8, "▁": 9, "é": 10}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    # Llama 2's tokenizer.json decoder
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken("</s>", special=True)])
    tokenizer.add_tokens(["<|tool|>"])
    return tokenizer


def test_sentencepiece_pieces_keep_their_space_and_bytes_fall_back_one_each():
    tokenizer = _sentencepiece_like()
    pieces = TokenPieces(tokenizer)
    ids = [7, 8, 9, 3, 4, 5, 6, 9, 10]
    raw = [pieces.bytes_of(i) for i in ids]
    # decoding the ids alone strips the first space and turns byte tokens into U+FFFD; the pieces do neither
    assert tokenizer.decode([7]) == "Paris" and tokenizer.decode([3]) == "\ufffd"
    assert raw[:2] == [b" Paris", b" is"] and raw[3:7] == [b"\xf0", b"\x9f", b"\x99", b"\x82"]
    assert b"".join(raw) == b" " + tokenizer.decode(ids).encode()  # the text, its first space kept
    assert pieces.bytes_of(2) == b"</s>" and pieces.bytes_of(tokenizer.token_to_id("<|tool|>")) == b"<|tool|>"
    assert pieces.bytes_of(10_000) == b""  # past the vocabulary: a model's padded logits

