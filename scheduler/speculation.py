"""N-gram speculation (prompt lookup): guess a request's next tokens from its own prompt and output.

The guess for a sequence is the continuation of the most recent earlier occurrence of its last n tokens
(n from ``MAX_NGRAM`` down to 1): text that quotes, rewrites or summarises its input repeats spans of
it. The ranks then verify every guessed token in the one forward pass that computes the next token anyway:
they sample each position as if it were the only one (the same seeded draw at the same position) and
keep the guesses up to the first one the sample disagrees with, plus that sample. Greedy and seeded
output is therefore token-identical to decoding one token at a time; for a proposal that is a single
token (as here, and as a greedy draft model's), keeping a guess exactly when the target's own draw
matches it is rejection sampling: the kept token is distributed as the target's.

How many tokens to guess is ``GuessRate``'s call, per request and per step, from how its recent guesses
went (below).

Pure: the policy owns one ``NgramIndex`` and one ``GuessRate`` per speculating request and feeds them every
token and every verdict.
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


# ------------------------------------------------------------------------------------------ guess sizing
#
# A guess of k tokens whose positions are each kept with probability ``rate`` (up to the first miss, the
# geometric model peers use too) yields 1 + rate + ... + rate^k tokens in one step; the step costs
# 1 + ROW_COST * k plain decode steps (a verify row per guessed token). The guess length is the k that
# maximises tokens per cost, 0 when no guess beats plain decoding (rate <= ROW_COST for k = 1).
ROW_COST = 0.25  # a verify row, as a share of a one-token decode step: SmolLM2 float32 on CPU, batch 1
RATE_PRIOR = 0.4  # a fresh request guesses one token and earns longer guesses as they are kept
RATE_WEIGHT = 0.2  # how much each verdict moves the rate: about the last 5 to 10 verdicts count
RATE_RECOVERED = 0.5  # a rate at which guesses pay twice over: the probe back-off starts again
PROBE_FIRST = 16  # a braked request that cannot watch for free probes after this many tokens of its own ...
PROBE_MAX = 128  # ... then after twice as many each time a probe fails, up to this many


class GuessRate:
    """The recent acceptance of one request's guesses (an exponential moving average over verified
    positions), the guess length it calls for, and when a braked request probes again.

    Each guessed position up to the first rejected one is one verdict (a kept guess 1, the rejected one 0);
    positions after a rejection say nothing (they were conditioned on a wrong token). A request whose rate
    falls to where no guess pays is *braked*. With a free way to watch (n-gram lookup: the scheduler can
    compare what it would have guessed with the token that came, no row spent) each watched token is a
    verdict too, so guessing resumes as soon as the output starts repeating. Without one (a draft model,
    whose guesses cost the ranks a forward pass each) it feeds a one-token *probe* after ``PROBE_FIRST``
    tokens, then after a back-off that doubles while probes keep failing (up to ``PROBE_MAX``): a request
    that never pays spends at most one row every ``PROBE_MAX`` tokens once its back-off has grown. A kept
    probe starts the request over at ``RATE_PRIOR``, however low its rate had sunk."""

    __slots__ = ("rate", "backoff", "probe_at", "probing")

    def __init__(self, rate: float = RATE_PRIOR):
        self.rate = rate
        self.backoff = PROBE_FIRST
        self.probe_at: int | None = None  # braked: the output length at which to probe next
        self.probing = False  # the last length() was a probe

    def observe(self, kept: int, guessed: int) -> None:
        """A verified guess of ``guessed`` tokens, of which the first ``kept`` were kept."""
        keep = 1.0 - RATE_WEIGHT
        self.rate = 1.0 - (1.0 - self.rate) * keep ** kept
        if kept < guessed:
            self.rate *= keep
        if self.probing and kept:
            self.rate = max(self.rate, RATE_PRIOR)
        self.probing = False
        if self.rate >= RATE_RECOVERED:
            self.backoff = PROBE_FIRST

    def best_length(self, most: int) -> int:
        """The guess length (0..``most``) with the most expected tokens per unit of step cost."""
        best, best_value, tokens, p = 0, 1.0, 1.0, 1.0
        for k in range(1, most + 1):
            p *= self.rate
            tokens += p
            value = tokens / (1.0 + ROW_COST * k)
            if value <= best_value:
                break  # the value rises to one peak and falls after it
            best, best_value = k, value
        return best

    def length(self, most: int, produced: int, probe: bool) -> int:
        """How many tokens to guess now (at most ``most``), ``produced`` tokens into the output: the best
        length; when braked, 1 if ``probe`` (no free way to watch) and a probe is due, else 0."""
        self.probing = False
        if most <= 0:
            return 0
        k = self.best_length(most)
        if k:
            self.probe_at = None
            return k
        if not probe:
            return 0
        if self.probe_at is None:
            self.probe_at = produced + self.backoff  # braked just now
            return 0
        if produced < self.probe_at:
            return 0
        self.backoff = min(2 * self.backoff, PROBE_MAX)
        self.probe_at = produced + self.backoff
        self.probing = True
        return 1
