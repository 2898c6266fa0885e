"""What the whole-stack tests ask the demo model's `tiny` size: the prompts (plain, and a system line
with short questions) and a greedy ``/generate`` with the tokens it returned."""

from __future__ import annotations

from llmbus.testing.http import post

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a curious engineer who",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
    "Café, naïve, 中文, emoji 🙂 — multi-byte text",
    "a",
]
MAX_NEW = 12


def tiny_server_args(model_dir) -> list[str]:
    """`llmbus up`'s arguments for the whole-stack tests of the demo model: float32 (so greedy output equals
    transformers'), a 128-token prompt and 256 tokens in all, a pool of 256 blocks of 16."""
    return ["--model-id", str(model_dir), "--dtype", "float32", "--max-total-tokens", "256",
            "--max-input-tokens", "128", "--num-blocks", "256", "--block-size", "16"]

SYSTEM = "You are a helpful assistant. Answer briefly, precisely and politely. "
QUESTIONS = ["What is two plus two?", "Name a colour.", "Why is the sky blue?", "Count to five.",
             "Say hello in French.", "What is a prime number?", "Tell me a joke.", "Spell cat.",
             "Where is Paris?", "Is water wet?", "Define entropy.", "Who are you?"]


def generate(server, prompt: str, max_new_tokens: int = MAX_NEW, **params):
    status, headers, body = post(f"{server.url}/generate", {
        "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **params}})
    assert status == 200, body
    return body, headers


def ids_of(body) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


def greedy_matches_reference(server, reference) -> list[tuple[dict, dict]]:
    """Each of PROMPTS served greedily: its tokens are ``reference``'s (transformers') up to where it stopped,
    a short answer ended by EOS and a whole one by the length. Returns each answer's (body, headers)."""
    answers = []
    for prompt in PROMPTS:
        body, headers = generate(server, prompt)
        got = ids_of(body)
        assert got == reference(prompt)[:len(got)], prompt
        assert body["details"]["finish_reason"] == ("length" if len(got) == MAX_NEW else "eos_token"), prompt
        answers.append((body, headers))
    return answers
