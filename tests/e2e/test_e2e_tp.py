"""Tensor parallelism through the whole stack: `llmbus up --gpus 2` on CPU (two gloo ranks).

Same acceptance bar as at TP=1: greedy output token-identical to transformers (see test_e2e.py for why
the comparison is meaningful), alone and in a concurrent batch.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmbus.testing import Server
from llmbus.testing.tiny_prompts import MAX_NEW, PROMPTS, generate, ids_of


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir):
    srv = Server(["--model-id", str(tiny_model_dir), "--gpus", "2", "--dtype", "float32",
                  "--max-total-tokens", "256", "--num-blocks", "128"])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


def test_tp2_greedy_matches_transformers_alone_and_batched(tp_server, reference):
    expected = [reference(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: ids_of(generate(tp_server, p)[0]), PROMPTS))
    for prompt, exp, got in zip(PROMPTS, expected, together):
        assert got == exp[:len(got)] and (len(got) == MAX_NEW or got[-1] == 1), prompt
    assert "world_size" in tp_server.stderr.text or "ranks=2" in tp_server.stderr.text


def test_tp2_info_names_each_ranks_device(tp_server):
    from llmbus.testing.http import get

    info = get(f"{tp_server.url}/info")[1]
    assert info["devices"] == ["cpu", "cpu"] and info["dtype"] == "float32" and info["attention_backend"]


def test_tp2_constrained_and_free_requests_share_steps(tp_server, reference):
    """Rank 0 alone holds the grammars; the other rank computes the same steps without them. Greedy free
    requests stay token-identical to transformers while constrained ones run beside them."""
    import re

    from llmbus.testing.http import post

    def constrained(regex):
        status, _, answer = post(f"{tp_server.url}/generate", {"inputs": "Hello", "parameters": {
            "max_new_tokens": 12, "grammar": {"type": "regex", "value": regex}}})
        assert status == 200 and re.fullmatch(regex, answer["generated_text"]), answer
        return answer["generated_text"]

    expected = [reference(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        held = [pool.submit(constrained, r) for r in ("[0-9]{6}", "(yes|no)")]
        together = list(pool.map(lambda p: ids_of(generate(tp_server, p)[0]), PROMPTS))
        [f.result() for f in held]
    for prompt, exp, got in zip(PROMPTS, expected, together):
        assert got == exp[:len(got)] and (len(got) == MAX_NEW or got[-1] == 1), prompt
