"""Sampling defaults (frontend/sampling_defaults.py) through the real frontend in front of the fake scheduler:
what a request leaves unset comes from a --default-* flag, else the model's generation_config.json (read
from a test model folder), else the API's own default; what it sets always wins; greedy stays greedy. The
SamplingParams the scheduler receives say what the ranks will sample with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmbus.bus.settings import SettingsError
from llmbus.frontend.config import FrontendConfig

GENERATION = {"eos_token_id": 1, "temperature": 0.6, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
              "repetition_penalty": 1.1}


def _folder(chat_model_dir: Path, tmp_path: Path, name: str, generation: dict) -> Path:
    folder = tmp_path / name
    shutil.copytree(chat_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture
def tuned_dir(chat_model_dir, tmp_path):
    """The chat test model, whose generation_config.json recommends a sampling of its own."""
    return _folder(chat_model_dir, tmp_path, "tuned", GENERATION)


def _sent(fe, path: str, body: dict):
    status, _, answer = fe.post(path, body)
    assert status == 200, answer
    with fe.sched.cond:
        return list(fe.sched.adds.values())[-1].sampling


def chat(fe, **body):
    return _sent(fe, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})


def generate(fe, parameters: dict | None = None):
    body = {"inputs": "hello"} if parameters is None else {"inputs": "hello", "parameters": parameters}
    return _sent(fe, "/generate", body)


def _sampling(s) -> tuple:
    return s.do_sample, s.temperature, s.top_k, pytest.approx(s.top_p), pytest.approx(s.min_p), \
        pytest.approx(s.repetition_penalty)


FROM_FILE = (True, pytest.approx(0.6), 20, pytest.approx(0.8), pytest.approx(0.05), pytest.approx(1.1))
NOTHING = (False, 1.0, 0, 1.0, 0.0, 1.0)


def test_model_generation_config_fills_what_a_request_leaves_unset(make_fe, tuned_dir):
    fe = make_fe(tuned_dir)
    s = chat(fe)
    assert (s.do_sample, s.temperature, s.top_k) == (True, pytest.approx(0.6), 20)
    assert (s.top_p, s.min_p, s.repetition_penalty) == (pytest.approx(0.8), pytest.approx(0.05), pytest.approx(1.1))
    assert _sampling(_sent(fe, "/v1/completions", {"prompt": "hello"})) == FROM_FILE
    status, _, raw = fe.request("GET", "/info")
    assert json.loads(raw)["sampling_defaults"] == {k: v for k, v in GENERATION.items() if k != "eos_token_id"}


def test_what_a_request_sets_always_wins(make_fe, tuned_dir):
    fe = make_fe(tuned_dir)
    # OpenAI's "off" values are explicit too: top_p 1, top_k 0, min_p 0
    s = chat(fe, temperature=1.0, top_p=1.0, top_k=0, min_p=0, repetition_penalty=1.0)
    assert _sampling(s) == (True, 1.0, 0, 1.0, 0.0, 1.0)
    s = chat(fe, temperature=1.3, min_p=0.2)  # one set, the others from the file
    assert _sampling(s) == (True, pytest.approx(1.3), 20, pytest.approx(0.8), pytest.approx(0.2), pytest.approx(1.1))
    s = generate(fe, {"temperature": 0.9, "top_k": 3})
    assert _sampling(s) == (True, pytest.approx(0.9), 3, pytest.approx(0.8), pytest.approx(0.05), pytest.approx(1.1))


def test_greedy_requests_stay_greedy(make_fe, tuned_dir):
    fe = make_fe(tuned_dir)
    # OpenAI's temperature 0 is greedy whatever else it sets; TGI's parameters without sampling too
    assert _sampling(chat(fe, temperature=0, top_p=0.5, top_k=5)) == NOTHING
    assert _sampling(generate(fe, {})) == NOTHING
    assert _sampling(generate(fe, {"max_new_tokens": 2, "repetition_penalty": 1.3}))[:5] == NOTHING[:5]
    # TGI samples when asked (do_sample, a sampling parameter, or a body without parameters: TGI's quirk)
    assert _sampling(generate(fe, {"do_sample": True})) == FROM_FILE
    assert _sampling(generate(fe)) == FROM_FILE


def test_flags_override_the_model_file(make_fe, tuned_dir):
    fe = make_fe(tuned_dir, default_temperature=0.3, default_top_p=1.0, default_repetition_penalty=1.0)
    s = chat(fe)
    assert _sampling(s) == (True, pytest.approx(0.3), 20, 1.0, pytest.approx(0.05), 1.0)
    assert _sampling(generate(fe, {"do_sample": True})) == (True, pytest.approx(0.3), 20, 1.0,
                                                           pytest.approx(0.05), 1.0)
    status, _, raw = fe.request("GET", "/info")
    assert json.loads(raw)["sampling_defaults"] == {"do_sample": True, "temperature": 0.3, "top_k": 20,
                                                    "top_p": 1.0, "min_p": 0.05, "repetition_penalty": 1.0}
    # a default temperature of 0: OpenAI requests without one are greedy; one that asks to sample gets
    # OpenAI's 1.0; TGI's sampling requests too (TGI has no temperature 0)
    fe = make_fe(tuned_dir, default_temperature=0.0)
    assert _sampling(chat(fe)) == NOTHING
    assert chat(fe, top_p=0.5).temperature == 1.0 and chat(fe, top_p=0.5).do_sample
    assert generate(fe, {"do_sample": True}).temperature == 1.0


def test_generation_config_none_or_another_folder(make_fe, tuned_dir, chat_model_dir, tmp_path):
    fe = make_fe(tuned_dir, generation_config="none")
    assert _sampling(chat(fe)) == (True, 1.0, 0, 1.0, 0.0, 1.0)  # OpenAI's own: temperature 1, nothing cut
    assert _sampling(generate(fe, {"do_sample": True})) == (True, 1.0, 0, 1.0, 0.0, 1.0)
    fe = make_fe(chat_model_dir, generation_config="vllm")  # vLLM's word for none
    assert fe.config.generation_config == "none"
    fe = make_fe(chat_model_dir, generation_config=str(tuned_dir))
    assert _sampling(chat(fe)) == FROM_FILE


def test_a_model_that_asks_for_no_sampling_is_greedy_unless_asked(make_fe, chat_model_dir, tmp_path):
    """do_sample false in the file (the default model's, as transformers reads its authors' config): OpenAI
    requests with no sampling parameter are greedy; one that sets a temperature or a warper samples with the
    file's values."""
    folder = _folder(chat_model_dir, tmp_path, "greedy", {"eos_token_id": 1, "do_sample": False,
                                                          "temperature": 0.2, "top_p": 0.9})
    fe = make_fe(folder)
    assert _sampling(chat(fe)) == NOTHING
    s = chat(fe, top_k=10)
    assert _sampling(s) == (True, pytest.approx(0.2), 10, pytest.approx(0.9), 0.0, 1.0)
    s = chat(fe, temperature=0.7)
    assert _sampling(s) == (True, pytest.approx(0.7), 0, pytest.approx(0.9), 0.0, 1.0)
    assert _sampling(generate(fe, {"do_sample": True})) == (True, pytest.approx(0.2), 0, pytest.approx(0.9), 0.0, 1.0)
    # --default-temperature says to sample by default
    fe = make_fe(folder, default_temperature=0.5)
    assert _sampling(chat(fe)) == (True, pytest.approx(0.5), 0, pytest.approx(0.9), 0.0, 1.0)


def test_bad_values_in_the_model_file_are_left_out(make_fe, chat_model_dir, tmp_path):
    folder = _folder(chat_model_dir, tmp_path, "bad", {"eos_token_id": 1, "temperature": -1, "top_p": 1.5,
                                                       "top_k": 50.0, "min_p": None, "repetition_penalty": "x"})
    fe = make_fe(folder)
    status, _, raw = fe.request("GET", "/info")
    assert json.loads(raw)["sampling_defaults"] == {"top_k": 50}


@pytest.mark.parametrize("path, body, message", [
    ("/generate", {"inputs": "hello", "parameters": {"min_p": 1.5}},
     "Input validation error: `min_p` must be >= 0.0 and <= 1.0"),
    ("/generate", {"inputs": "hello", "parameters": {"min_p": -0.1}},
     "Input validation error: `min_p` must be >= 0.0 and <= 1.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 2},
     "Input validation error: `min_p` must be >= 0.0 and <= 1.0. Given: 2.0"),
])
def test_min_p_out_of_range_is_refused(make_fe, path, body, message):
    fe = make_fe()
    status, _, answer = fe.post(path, body)
    assert status == 422, answer
    text = answer["error"]["message"] if isinstance(answer["error"], dict) else answer["error"]
    assert text == message
    assert fe.sched.adds == {}


def test_min_p_reaches_the_engine_and_turns_sampling_on(make_fe):
    fe = make_fe()
    s = generate(fe, {"min_p": 0.1})
    assert (s.do_sample, s.min_p) == (True, pytest.approx(0.1))
    assert chat(fe, min_p=0.25).min_p == pytest.approx(0.25)


@pytest.mark.parametrize("setting, value, message", [
    ("default_top_p", 0.0, "`default_top_p` must be in (0, 1]. Given: 0.0"),
    ("default_min_p", 1.5, "`default_min_p` must be between 0 and 1. Given: 1.5"),
    ("default_temperature", -0.5, "`default_temperature` must be >= 0. Given: -0.5"),
    ("generation_config", "/nonexistent", "`generation_config` must be auto, none or a folder holding a "
                                          "generation_config.json. Given: /nonexistent"),
])
def test_bad_flags_are_refused(model_dir, setting, value, message):
    with pytest.raises(SettingsError) as raised:
        FrontendConfig(model_dir=str(model_dir), requests_endpoint="ipc:///x", events_endpoint="ipc:///y",
                       **{setting: value})
    assert message in str(raised.value)
