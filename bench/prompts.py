"""Prompts of a chosen token count, built against the server's own tokenizer.

A prompt's length is only exact in the tokenizer of the model being served, which the load generator
does not have (it may run on another machine, for any model). TGI's ``POST /tokenize`` (llmbus serves it
too) answers with each token and its character span, so one call over a longer text gives the cut that
holds exactly N tokens (special tokens such as BOS included, as the server counts them), and a second
call checks the cut, since a word split at the cut can tokenize differently. Servers without the route
(OpenAI-only ones) get an approximation: one common English word per token, which byte-level BPE
vocabularies mostly honour; the server's ``usage.prompt_tokens`` then records the real count.

Every prompt is drawn from its own seeded random word sequence, so prompts differ from their first
words on and a prefix cache cannot turn a benchmark into a cache-hit test.
"""

from __future__ import annotations

import random

# Common English words: byte-level BPE vocabularies encode most as one token with its leading space.
WORDS = ("the of and to in is was for on with as by at from city river history settlement small people "
         "market bridge north south winter summer harbour road church school council water trade grew "
         "built early later years century families village farm mill station railway house street "
         "square hall tower wall gate field forest hill valley stone brick wood ships merchants workers "
         "children war peace fire flood storm harvest festival music garden island mountain lake coast "
         "letter story morning evening light colour paper bread horse").split()

_CHECKS = 6  # cut, check, move the cut by the difference: a mismatch settles in one or two moves


def random_words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def approximate_prompt(rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens (one word each, one fewer for the BOS most tokenizers add)."""
    return " ".join(random_words(rng, max(1, n_tokens - 1)))


async def exact_prompt(tokenize, rng: random.Random, n_tokens: int) -> tuple[str, int]:
    """(text, its token count) where the count is ``n_tokens`` unless no cut reaches it exactly (then
    the closest found). ``tokenize(text)`` is an async callable returning the ``/tokenize`` answer: a
    list of ``{"id", "text", "start", "stop"}``."""
    words = random_words(rng, n_tokens + 8)
    spans = await tokenize(" ".join(words))
    while len(spans) < n_tokens + 4:  # margin past the cut, for moving it forward
        words += random_words(rng, n_tokens)
        spans = await tokenize(" ".join(words))
    text = " ".join(words)
    k = n_tokens - 1  # index of the last token kept
    best: tuple[int, str, int] | None = None
    for _ in range(_CHECKS):
        k = max(0, min(k, len(spans) - 1))
        candidate = text[:spans[k]["stop"]] or words[0]  # never empty: servers reject empty inputs
        count = len(await tokenize(candidate))
        if best is None or abs(count - n_tokens) < best[0]:
            best = (abs(count - n_tokens), candidate, count)
        if count == n_tokens:
            break
        k += n_tokens - count
    return best[1], best[2]
