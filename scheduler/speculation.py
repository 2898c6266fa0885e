"""N-gram speculation (prompt lookup): guess a request's next tokens from its own prompt and output.

The guess for a sequence is the continuation of the most recent earlier occurrence of its last n tokens
(n from ``MAX_NGRAM`` down to 1): text that quotes, rewrites or summarises its input repeats spans of
it. The ranks then verify every guessed token in the one forward pass that computes the next token anyway:
they sample each position as if it were the only one (the same seeded draw at the same position) and
keep the guesses up to the first one the sample disagrees with, plus that sample. Greedy and seeded
output is therefore token-identical to decoding one token at a time; for a proposal that is a single
token (as here, and as a greedy draft model's), keeping a guess exactly when the target's own draw
matches it is rejection sampling: the kept token is distributed as the target's.

Pure: the policy owns one ``NgramIndex`` per speculating request and feeds it every token.
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest suffix looked up; longer matches are rarer and no more accurate on short runs


class NgramIndex:
    """Where each n-gram (n <= MAX_NGRAM) of a token sequence last ended, updated as tokens append."""

    __slots__ = ("tokens", "_last_end", "_previous_end")

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        # n-gram -> end (exclusive) of its latest occurrence, and of the one before that: the latest is
        # usually the sequence's own suffix, which has no continuation yet
        self._last_end: dict[tuple[int, ...], int] = {}
        self._previous_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                key = tuple(self.tokens[end - n:end])
                last = self._last_end.get(key)
                if last is not None:
                    self._previous_end[key] = last
                self._last_end[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
        found; [] when no suffix occurred before."""
        end = len(self.tokens)
        if k <= 0 or end < 2:
            return []
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            key = tuple(self.tokens[end - n:end])
            match = self._last_end.get(key)
            if match == end:
                match = self._previous_end.get(key)
            if match is not None and match < end:
                return self.tokens[match:match + k]
        return []
