"""Frontend pieces without sockets: body parsing, TGI's rules, limits, errors, JSON numbers, demux."""

from __future__ import annotations

import asyncio
import random

import pytest

from llmbus.bus import messages as m
from llmbus.frontend.config import FrontendConfig, Limits, resolve_limits
from llmbus.frontend.engine_client import EngineClient, EngineFailure, EngineTokens, Mailbox
from llmbus.frontend.errors import ApiError, ErrorKind, engine_error
from llmbus.frontend.responses import dumps, f32
from llmbus.frontend.validation import (GenerateParameters, parse_request, validate_best_of, validate_lengths,
                                        validate_parameters)

LIMITS = Limits(max_input_tokens=10, max_total_tokens=20, max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5)


def _config(**kw) -> FrontendConfig:
    return FrontendConfig(model_dir="/m", requests_endpoint="ipc://r", events_endpoint="ipc://e", **kw)


def test_parse_defaults_follow_serde():
    req = parse_request(b'{"inputs":"hi"}')
    assert req.parameters.do_sample is True  # default_parameters() quirk
    req = parse_request(b'{"inputs":"hi","parameters":{}}')
    assert req.parameters == GenerateParameters()
    req = parse_request(b'{"inputs":"hi","parameters":{"temperature":1,"top_k":null,"stop":[]}}')
    assert req.parameters.temperature == 1.0 and isinstance(req.parameters.temperature, float)
    assert req.parameters.top_k is None and req.stream is False
    assert parse_request(b'{"inputs":"hi","stream":true}', compat=True).stream is True
    assert parse_request(b'{"inputs":"hi","stream":true}').stream is False  # /generate ignores it


@pytest.mark.parametrize("body, message", [
    (b'{"inputs":"x","parameters":{"seed":18446744073709551616}}',
     "parameters.seed: invalid value: integer `18446744073709551616`, expected u64"),
    (b'{"inputs":"x","parameters":{"top_k":2147483648}}',
     "parameters.top_k: invalid value: integer `2147483648`, expected i32"),
    (b'{"inputs":"x","parameters":{"details":1}}', "parameters.details: invalid type: integer `1`, expected a boolean"),
    (b'{"inputs":"x","parameters":{"temperature":true}}',
     "parameters.temperature: invalid type: boolean `true`, expected f32"),
    (b'{"inputs":"x","parameters":{"stop":"a"}}', 'parameters.stop: invalid type: string "a", expected a sequence'),
    (b'{"inputs":["x"]}', "inputs: invalid type: sequence, expected a string"),
])
def test_parse_type_errors(body, message):
    with pytest.raises(ApiError) as e:
        parse_request(body)
    assert e.value.status == 422 and e.value.error_type == "validation"
    assert e.value.message == "Failed to deserialize the JSON body into the target type: " + message


def test_parse_invalid_json_and_utf8():
    for raw in (b'{"inputs":', b"\xff\xfe", b'{"inputs":"x","parameters":{"top_p":Infinity}}'):
        with pytest.raises(ApiError) as e:
            parse_request(raw)
        assert e.value.message.startswith("Failed to parse the request body as JSON: ")


def test_sampling_decision_and_seed():
    rng = random.Random(1)
    v = validate_parameters("x", GenerateParameters(), LIMITS, rng)
    assert v.sampling.do_sample is False and v.seed is None  # greedy reports no seed
    v = validate_parameters("x", GenerateParameters(top_k=3), LIMITS, rng)
    assert v.sampling.do_sample is True and v.seed == v.sampling.seed
    v = validate_parameters("x", GenerateParameters(temperature=1.0), LIMITS, rng)
    assert v.sampling.do_sample is False  # temperature 1.0 changes nothing: greedy, as in TGI's server
    v = validate_parameters("x", GenerateParameters(watermark=True), LIMITS, rng)
    assert v.sampling.do_sample is False and v.sampling.watermark is True  # watermark biases, never samples
    v = validate_parameters("x", GenerateParameters(do_sample=True, seed=2**64 - 1), LIMITS, rng)
    assert v.seed == 2**64 - 1


def test_the_adapter_that_answers():
    adapters = ["sql", "poet"]
    for params, adapter in ((GenerateParameters(), ""), (GenerateParameters(adapter_id=""), ""),
                            (GenerateParameters(adapter_id="sql"), "sql"),
                            (GenerateParameters(model="poet"), "poet"),  # an OpenAI body's model
                            (GenerateParameters(model="gpt-4o"), ""),  # any other name: the base model
                            (GenerateParameters(adapter_id="sql", model="poet"), "sql")):
        assert validate_parameters("x", params, LIMITS, adapters=adapters).adapter == adapter, params
    with pytest.raises(ApiError, match="adapter `chef` is not loaded; loaded adapters: `sql`, `poet`") as e:
        validate_parameters("x", GenerateParameters(adapter_id="chef"), LIMITS, adapters=adapters)
    assert e.value.kind is ErrorKind.VALIDATION


def test_best_of_limits():
    assert validate_best_of(2, LIMITS) == 2
    with pytest.raises(ApiError, match=r"`best_of` must be > 0 and <= 2. Given: 3"):
        validate_best_of(3, LIMITS)
    one = Limits(10, 20, 1, 4, 5)
    with pytest.raises(ApiError, match="`best_of` != 1 is not allowed for this endpoint"):
        validate_best_of(2, one)


def test_lengths_in_tgi_order():
    assert validate_lengths(5, None, None, LIMITS) == (5, 15)  # default: the rest of max_total_tokens
    assert validate_lengths(5, None, 15, LIMITS) == (5, 15)
    assert validate_lengths(30, 4, 3, LIMITS) == (4, 3)  # truncate keeps the last tokens
    with pytest.raises(ApiError, match=r"must be <= 20. Given: 5 `inputs` tokens and 16 `max_new_tokens`"):
        validate_lengths(5, None, 16, LIMITS)
    with pytest.raises(ApiError, match=r"`inputs` must have less than 10 tokens. Given: 11"):
        validate_lengths(11, None, None, LIMITS)
    big = Limits(10, 5000, 2, 4, 5)
    # without max_new_tokens only the first 1024-token chunk is checked, but all of it is scheduled
    assert validate_lengths(8, None, None, big) == (8, 4992)


def test_resolve_limits():
    assert resolve_limits(_config(), 4096, 100_000) == Limits(4095, 4096, 2, 4, 5)
    assert resolve_limits(_config(), 4096, 1000).max_total_tokens == 1000  # KV capacity caps it
    assert resolve_limits(_config(), None, 0).max_total_tokens == 4096
    assert resolve_limits(_config(max_total_tokens=64, max_input_tokens=40), 4096, 1000).max_input_tokens == 40
    with pytest.raises(ValueError, match="`max_total_tokens` must be <= `max_batch_total_tokens`"):
        resolve_limits(_config(max_total_tokens=2000), 4096, 1000)
    with pytest.raises(ValueError, match="`max_input_tokens` must be < `max_total_tokens`"):
        resolve_limits(_config(max_input_tokens=500), 256, 1000)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"`max_input_tokens`\(64\) must be < `max_total_tokens`\(64\)"):
        _config(max_input_tokens=64, max_total_tokens=64)
    with pytest.raises(ValueError, match="frontend_id"):
        _config(frontend_id="a-b")
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        _config(max_concurrent_requests=0)
    assert _config().model_id == "/m"


def test_engine_error_mapping():
    e = engine_error("generation", "CUDA out of memory")
    assert (e.status, e.body()) == (424, {"error": "Request failed during generation: CUDA out of memory",
                                          "error_type": "generation"})
    e = engine_error("validation", "Input validation error: too long")  # not prefixed twice
    assert (e.status, e.message) == (422, "Input validation error: too long")
    assert engine_error("overloaded", "queue full").body() == {"error": "Model is overloaded",
                                                               "error_type": "overloaded"}
    assert engine_error("something_new", "x").status == 424
    assert ApiError(ErrorKind.UNHEALTHY).body() == {"error": "unhealthy", "error_type": "healthcheck"}


def test_f32_json_numbers():
    assert f32(-0.25) == -0.25
    import struct
    as_f32 = struct.unpack("<f", struct.pack("<f", -1.53))[0]  # what a worker sends for -1.53
    assert as_f32 != -1.53 and f32(as_f32) == -1.53
    assert f32(float("nan")) is None and f32(float("-inf")) is None and f32(None) is None
    assert dumps({"a": "é", "b": [1, None]}) == '{"a":"é","b":[1,null]}'.encode()


def test_token_batch_demux():
    async def run():
        client = EngineClient("ipc://unused-r", "ipc://unused-e", "fe1")
        a, b = Mailbox(), Mailbox()
        client._channels.update({"fe1-1": a, "fe1-2": b})
        client._dispatch(m.TokenBatch(
            rids=["fe1-1", "fe1-2", "fe1-9", "fe1-1"], token_ids=[10, 20, 90, 11], logprobs=[-1.0, -2.0, -9.0, -1.5],
            finish_reasons=[0, 2, 0, 1], prompt_logprobs=[["fe1-2", [-0.5], [[[7], [-0.5]]]]],
            queue_times=[0.1, 0.2, 0.0, 0.0]))
        item_a, item_b = a.get_nowait(), b.get_nowait()
        assert isinstance(item_a, EngineTokens) and [t.token_id for t in item_a.tokens] == [10, 11]
        assert [t.finish_reason for t in item_a.tokens] == [0, 1] and item_a.tokens[0].queue_time == 0.1
        assert item_b.prompt_logprobs == [-0.5] and item_a.prompt_logprobs is None
        assert item_b.prompt_top_tokens == [[[7], [-0.5]]]
        assert a.empty() and b.empty()
        client._dispatch(m.RequestFailed(rid="fe1-2", error_type="generation", message="boom"))
        failure = b.get_nowait()
        assert isinstance(failure, EngineFailure) and failure.error.status == 424
        assert "fe1-2" not in client._channels
        client.hello = m.SchedulerHello(max_batch_total_tokens=1, block_size=1)
        assert client.healthy
        client._dispatch(m.EngineDead(reason="gone"))
        assert not client.healthy and client._channels == {}
        assert a.get_nowait().error.message == "Request failed during generation: gone"
        client._ctx.term()

    asyncio.run(run())


def test_long_texts_tokenize_as_short_ones_do(model_dir):
    """Past LONG_TEXT_CHARS the tokenizer takes the path that lets go of the GIL (encode_batch): the same
    ids and character spans as encode, special tokens and all."""
    from llmbus.frontend.tokenizer import LONG_TEXT_CHARS, load_tokenizer

    tok = load_tokenizer(model_dir)
    text = "<s>héllo wörld 🙂 日本語, " * (LONG_TEXT_CHARS // 10)
    assert len(text) > LONG_TEXT_CHARS
    for add_special_tokens in (True, False):
        plain = tok.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens) == plain.ids
        assert tok.encode_with_offsets(text, add_special_tokens) == [
            (i, start, stop) for i, (start, stop) in zip(plain.ids, plain.offsets)]
