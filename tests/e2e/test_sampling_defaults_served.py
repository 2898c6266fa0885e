"""Sampling defaults on the real default model (issue #35, part 1): `llmbus up` with no flags serves
SmolLM2-135M-Instruct, and the README's own curl, which sets no temperature, gets a right answer every time.

A request that leaves temperature, top_k, top_p or min_p unset samples with the model's recommended values
(SmolLM2's authors: temperature 0.2, top_p 0.9, written into its cached folder), not at OpenAI's temperature
1.0 over the whole vocabulary, where a 135M model answers noise. A request that sets one still wins.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmbus.testing import Server
from llmbus.testing.http import get, post

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_chat_body() -> dict:
    """The body of the README's /v1/chat/completions curl, exactly as a new user pastes it."""
    found = re.search(r"curl -s localhost:3000/v1/chat/completions .*?-d '(\{.*?\})'", README.read_text(), re.S)
    assert found, "README.md has no /v1/chat/completions curl"
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def default_server(smollm2_server):
    """The session's shared SmolLM2 server (conftest.py), not one more start: like `llmbus up` with no flags it
    names no model and no sampling flag, so the defaults under test are the model's own; its other flags (the
    token and concurrency limits, --speculate) do not touch sampling, and a greedy answer speculated is the
    same answer (tests/scheduler/test_speculation.py)."""
    return smollm2_server


def _answer(server: Server, body: dict) -> dict:
    status, _, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 200, answer
    return answer


def test_readme_curl_names_paris_five_times_of_five(default_server):
    body = readme_chat_body()
    assert "temperature" not in body and "What is the capital of France?" in json.dumps(body)
    answers = [_answer(default_server, body)["choices"][0]["message"]["content"] for _ in range(5)]
    assert all("Paris" in a for a in answers), answers


def test_effective_defaults_in_info_and_startup_log(default_server):
    info = get(f"{default_server.url}/info")[1]
    assert info["sampling_defaults"] == {"do_sample": False, "temperature": 0.2, "top_p": 0.9}, info
    line = next(line for line in default_server.stderr.lines if "sampling defaults" in line)
    assert "temperature=0.2" in line and "top_p=0.9" in line and "generation_config.json" in line, line


def _first_token(server: Server, body: dict) -> dict:
    body = {**body, "max_tokens": 1, "logprobs": True, "top_logprobs": 5}
    return _answer(server, body)["choices"][0]["logprobs"]["content"][0]


def test_explicit_temperature_wins(default_server):
    """What a request sampled from shows in its logprobs: a greedy request's are the model's own
    distribution, and top_logprobs leave out the tokens a warper masked.

    Unset, the default model decodes greedily (its authors' generation_config.json asks for no sampling):
    the model's distribution, its most likely token. An explicit temperature 1.0 with top_p 1.0 samples from
    that same distribution, all five alternatives. An explicit temperature 0.2 samples with the model's
    default top_p 0.9: a nucleus of a token or two, each far more likely than at 1.0."""
    question = readme_chat_body()
    default = _first_token(default_server, question)
    hot = _first_token(default_server, {**question, "temperature": 1.0, "top_p": 1.0, "seed": 3})
    cold = _first_token(default_server, {**question, "temperature": 0.2, "seed": 3})
    assert default["token"] == default["top_logprobs"][0]["token"]  # greedy: the argmax
    assert len(default["top_logprobs"]) == len(hot["top_logprobs"]) == 5 > len(cold["top_logprobs"]), (hot, cold)
    assert [t["token"] for t in hot["top_logprobs"]] == [t["token"] for t in default["top_logprobs"]]
    assert abs(hot["top_logprobs"][0]["logprob"] - default["top_logprobs"][0]["logprob"]) < 1e-3
    assert cold["top_logprobs"][0]["logprob"] > default["top_logprobs"][0]["logprob"] + 0.5
    # the README's /generate curl is TGI's greedy, untouched by the defaults; do_sample takes them
    tgi = {"inputs": "What is the capital of France?",
           "parameters": {"max_new_tokens": 1, "details": True, "top_n_tokens": 5}}
    greedy = post(f"{default_server.url}/generate", tgi)[2]["details"]
    sampled = post(f"{default_server.url}/generate", {**tgi, "parameters": {**tgi["parameters"],
                                                                          "do_sample": True}})[2]["details"]
    assert greedy["seed"] is None and len(greedy["top_tokens"][0]) == 5, greedy
    assert sampled["seed"] is not None and len(sampled["top_tokens"][0]) < 5, sampled
