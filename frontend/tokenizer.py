"""The model's tokenizer as the frontend needs it: encode prompts, name special tokens, find EOS ids.

Only the fast ``tokenizer.json`` is supported (``tokenizers``; no transformers, no torch). EOS ids are the
union of ``generation_config.json`` ``eos_token_id`` (an int or a list) and ``tokenizer_config.json``
``eos_token``, falling back to ``config.json`` ``eos_token_id``; the scheduler stops on any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from llmbus.bus.model_files import config_max_positions, eos_token_ids, read_config, token_content
from llmbus.frontend.detokenizer import IncrementalDetokenizer
from llmbus.frontend.errors import validation_error
from llmbus.frontend.token_pieces import TokenPieces

# texts longer than this many characters are tokenized off the event loop (Generator.tokenize)
LONG_TEXT_CHARS = 2000
# transformers' "no limit" sentinel for model_max_length is 1e30; anything this large means "unknown".
_UNBOUNDED = 10**9


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    special_ids: frozenset[int]
    model_max_length: int | None  # None when neither config.json nor tokenizer_config.json says

    def _encoding(self, text: str, add_special_tokens: bool):
        # tokenizers' encode holds the GIL throughout (a second per 2 MB body, every other request stalled);
        # encode_batch releases it, so a long text tokenized on a worker thread leaves the event loop running
        if len(text) <= LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoding(text, add_special_tokens).ids

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """``(id, start, stop)`` per token; start/stop index characters of ``text`` (0, 0 for added
        special tokens)."""
        encoding = self._encoding(text, add_special_tokens)
        return [(i, start, stop) for i, (start, stop) in zip(encoding.ids, encoding.offsets)]

    def known_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """``ids`` (a prompt given as token ids, or the ``param`` that names them), if every one is in the
        vocabulary."""
        if not ids:
            return ids
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        unknown = next((i for i in ids if i >= size), None)
        if unknown is not None:
            where = "" if param == "prompt" else f" in `{param}`"
            raise validation_error(f"token id {unknown}{where} is out of the vocabulary ({size} tokens)", param=param)
        return ids

    def text_of(self, ids: list[int]) -> str:
        """The text of a prompt given as token ids, as an echo shows it (special tokens take no room)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own, special tokens kept (TGI's prefill / top-token texts)."""
        if not ids:
            return []
        return self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)

    @cached_property
    def _pieces(self) -> TokenPieces:  # read from the spec on first use: only logprobs need it
        return TokenPieces(self.tokenizer)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each id's own bytes (OpenAI's logprob ``bytes``): concatenated, a text's tokens give its UTF-8."""
        return [self._pieces.bytes_of(i) for i in ids]

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids)


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}: the frontend needs a fast tokenizer")
    tokenizer = Tokenizer.from_file(str(path))
    # Validation measures and truncates prompts itself (TGI semantics); the file's own settings must not.
    tokenizer.no_truncation()
    tokenizer.no_padding()

    tok_config = read_config(model_dir / "tokenizer_config.json")
    model_config = read_config(model_dir / "config.json")
    eos = eos_token_ids(model_dir, tokenizer)

    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = token_content(tok_config.get(key))
        token_id = tokenizer.token_to_id(text) if text is not None else None
        if token_id is not None:
            special.add(token_id)

    lengths = []
    positions = config_max_positions(model_config)
    if positions is not None:
        lengths.append(positions)
    mml = tok_config.get("model_max_length")
    if isinstance(mml, (int, float)) and not isinstance(mml, bool) and 0 < mml < _UNBOUNDED:
        lengths.append(int(mml))
    model_max_length = min(lengths) if lengths else None

    return ModelTokenizer(tokenizer=tokenizer, eos_token_ids=eos, special_ids=frozenset(special),
                          model_max_length=model_max_length)
