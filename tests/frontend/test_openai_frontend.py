"""The OpenAI routes, /tokenize, /chat_tokenize, /invocations and the guards, against the fake scheduler
of ``llmbus.testing.fake_scheduler`` (real zmq sockets and HTTP; the reply is a fixed script, so texts are exact).

The fake scheduler answers every request with REPLY (then EOS), three tokens per event; a prompt with
HOLD waits for ``release``, one with FAIL fails with a validation error.
"""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from llmbus.testing.fake_scheduler import EOS, REPLY, WAIT, chat, last_rid, parse_sse


@pytest.fixture
def fe(make_fe):
    return make_fe()


def stream_events(raw: bytes) -> list:
    """The events of an OpenAI stream, which must end with exactly one ``data: [DONE]``."""
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1, raw[-80:]
    return parse_sse(raw[:-len(b"data: [DONE]\n\n")])


def openai_error(status, body, expected_status: int, code: str, fragment: str, param=None):
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["code"] == code and body["error_type"] == code
    assert fragment in error["message"], error["message"]
    assert error["param"] == param


# --- chat ------------------------------------------------------------------------------------------


def test_chat_completion_shape_and_template(fe):
    status, _, body = chat(fe, messages=[{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "h"},
                                                                      {"type": "text", "text": "i"}]}])
    assert status == 200, body
    assert list(body) == ["id", "object", "created", "model", "system_fingerprint", "choices", "usage"]
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > 12
    assert body["object"] == "chat.completion" and body["model"] == "tiny-test"
    assert isinstance(body["created"], int) and body["system_fingerprint"].endswith("-native")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                "logprobs": None, "finish_reason": "stop"}]
    add = fe.sched.adds[last_rid(fe)]
    templated = fe.sched.tok.decode(add.input_ids, skip_special_tokens=False)
    assert templated == "<s><system>be brief\n<user>hi\n<assistant>"
    assert add.input_ids.count(0) == 1, "the template's BOS is not doubled by the tokenizer"
    assert add.sampling.do_sample, "OpenAI samples unless temperature is 0"
    usage = body["usage"]
    assert usage == {"prompt_tokens": len(add.input_ids), "completion_tokens": usage["completion_tokens"],
                     "total_tokens": len(add.input_ids) + usage["completion_tokens"],
                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage["completion_tokens"] == len(fe.sched.reply) + 1  # the EOS counts
    assert chat(fe)[2]["id"] != body["id"], "ids are unique"


def test_openai_answers_carry_tgis_timing_headers_summed_over_choices(fe):
    one = fe.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})[1]
    prompt = len(fe.sched.adds[last_rid(fe)].input_ids)
    assert one["x-compute-type"] and float(one["x-compute-time"]) >= 0 and int(one["x-total-time"]) >= 0
    assert (one["x-prompt-tokens"], one["x-generated-tokens"]) == (str(prompt), str(len(fe.sched.reply) + 1))
    _, headers, body = fe.request("POST", "/v1/completions", {"prompt": ["the fox", "a"], "max_tokens": 2, "n": 2})
    body = json.loads(body)
    assert int(headers["x-generated-tokens"]) == body["usage"]["completion_tokens"] == 8
    # TGI's completions route sums its prompts' headers; a prompt counts once however many choices it has
    assert int(headers["x-prompt-tokens"]) == body["usage"]["prompt_tokens"]
    assert int(headers["x-compute-characters"]) == len("the fox" + "a")


def test_chat_parameters_map_onto_sampling(fe):
    status, _, body = chat(fe, temperature=0, top_p=1.0, max_tokens=3, seed=-1, frequency_penalty=0.5,
                           stop="x", ignore_eos=True)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    add = fe.sched.adds[last_rid(fe)]
    assert not add.sampling.do_sample and add.sampling.top_p == 1.0
    assert add.sampling.frequency_penalty == 0.5 and add.stopping.max_new_tokens == 3
    assert add.stopping.ignore_eos
    chat(fe, temperature=1e-300)  # 0 in the f32 the engine computes in: greedy, not a division by zero
    assert not fe.sched.adds[last_rid(fe)].sampling.do_sample
    chat(fe, temperature=0.5, top_p=0.9, max_completion_tokens=2, max_tokens=9, seed=7)
    add = fe.sched.adds[last_rid(fe)]
    assert add.sampling.do_sample and (add.sampling.temperature, add.sampling.seed) == (0.5, 7)
    assert add.sampling.top_p == pytest.approx(0.9) and add.stopping.max_new_tokens == 2
    assert add.sampling.logit_bias_ids == add.sampling.logit_bias_values == []


def test_logit_bias_reaches_the_engine_on_both_routes(fe):
    chat(fe, temperature=0, logit_bias={"5": -100, "07": 2.5, "9": 0, "7": 1})
    sampling = fe.sched.adds[last_rid(fe)].sampling
    # "07" and "7" name one token: the later value wins, as JSON objects read into a dict keep the last
    assert dict(zip(sampling.logit_bias_ids, sampling.logit_bias_values)) == {5: -100.0, 7: 1.0, 9: 0.0}
    assert not sampling.do_sample
    status, _, body = fe.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "logit_bias": {"3": 50}})
    assert status == 200, body
    sampling = fe.sched.adds[last_rid(fe)].sampling
    assert (sampling.logit_bias_ids, sampling.logit_bias_values) == ([3], [50.0])


@pytest.mark.parametrize("body, param, fragment", [
    ({"top_p": 1.5}, "top_p", "`top_p` must be > 0.0 and <= 1.0. Given: 1.5"),
    ({"top_p": 0}, "top_p", "`top_p` must be > 0.0"),
    ({"temperature": 2.5}, "temperature", "`temperature` must be >= 0.0 and <= 2.0"),
    ({"temperature": "hot"}, "temperature", "`temperature` must be a number"),
    ({"max_tokens": 0}, "max_tokens", "`max_tokens` must be >= 1"),
    ({"n": 0}, "n", "`n` must be >= 1 and <= 4. Given: 0"),
    ({"n": 5}, "n", "`n` must be >= 1 and <= 4. Given: 5"),
    ({"presence_penalty": 3}, "presence_penalty", "`presence_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "`frequency_penalty` must be >= -2.0"),
    ({"stop": ["a", 1]}, "stop", "`stop` must be a string or an array of strings"),
    ({"top_logprobs": 2}, "top_logprobs", "`top_logprobs` needs `logprobs`"),
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs", "`top_logprobs` must be >= 0 and <= 5. Given: 6"),
    ({"seed": 2**64}, "seed", "`seed` must be >= -9223372036854775808 and <= 18446744073709551615. Given: "),
    ({"seed": -2**63 - 1}, "seed", "`seed` must be >= -9223372036854775808"),
    ({"messages": []}, "messages", "`messages` must be a non-empty array"),
    ({"messages": [{"content": "x"}]}, "messages", "`messages[0]` must be an object with a string `role`"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "image_url content is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "`messages[0].content[0].text` must be a string"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages",
     "`messages[0].content[0]` must be a content part: an object with a string `type`"),
    ({"messages": [{"role": "user"}]}, "messages", "`messages[0]` must have a `content`"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "messages",
     "`messages[1]` must have a `content`"),
    ({"logit_bias": {"x": 1}}, "logit_bias", 'Invalid key in `logit_bias`: "x". Keys must be token ids'),
    ({"logit_bias": {"-1": 1}}, "logit_bias", 'Invalid key in `logit_bias`: "-1"'),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "Invalid value in `logit_bias` for token 5: 100.5. Values must"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", 'Invalid value in `logit_bias` for token 5: "1"'),
    ({"logit_bias": {"5": True}}, "logit_bias", "Invalid value in `logit_bias` for token 5: true"),
    ({"logit_bias": [1.0]}, "logit_bias", "`logit_bias` must be an object"),
    ({"logit_bias": {"1000000000": 1}}, "logit_bias", "token id 1000000000 in `logit_bias` is out of the vocabulary"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "Invalid key in `logit_bias`"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "`logit_bias` may bias at most 1024 tokens"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024 token ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "`stop_token_ids` must be an array of at most 1024 token ids"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids", "token id 1000000000 in `stop_token_ids` is out of the"),
    ({"min_tokens": -1}, "min_tokens", "`min_tokens` must be >= 0. Given: -1"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "`min_tokens` must be <= the tokens to generate (8). Given: 9"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "grammar is not valid: 'objectx' is not valid under any of the given schemas"),
    ({"response_format": {"type": "xml"}}, "response_format", "`response_format.type` must be `text`"),
])
def test_chat_validation_errors_use_openai_envelope(fe, body, param, fragment):
    status, _, answer = chat(fe, **body)
    openai_error(status, answer, 422, "validation", fragment, param)
    assert answer["error"]["type"] == "invalid_request_error"


def test_chat_tgi_rules_still_apply(fe):
    status, _, body = chat(fe, stop=["a", "b", "c", "d", "e"])
    openai_error(status, body, 422, "validation", "`stop` supports up to 4 stop sequences. Given: 5")
    status, _, body = chat(fe, max_tokens=60)  # the prompt plus 60 exceeds max_total_tokens 64
    openai_error(status, body, 422, "validation", "`inputs` tokens + `max_new_tokens` must be <= 64")
    assert fe.sched.adds == {}, "nothing invalid reaches the scheduler"


def test_missing_chat_template_is_tgi_template_error(make_fe, model_dir):
    fe = make_fe(model_dir)  # the plain model folder has no chat template
    status, _, body = chat(fe)
    openai_error(status, body, 422, "template_error", "Template error: template not found")
    status, _, body = fe.post("/chat_tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert (status, body) == (422, {"error": "Template error: template not found", "error_type": "template_error"})


def test_tokenizer_config_path_brings_its_template_and_tokens(make_fe, model_dir, chat_model_dir, tmp_path):
    """TGI's --tokenizer-config-path: a model folder without a template serves the file's, with the special
    tokens it names over the folder's; a file without a template leaves the folder's own."""
    given = tmp_path / "tokenizer_config.json"
    given.write_text(json.dumps({"chat_template": "{{ bos_token }}[{{ messages[0]['content'] }}]", "bos_token": "<B>"}))
    body = make_fe(model_dir, tokenizer_config_path=str(given)).post(
        "/chat_tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2]
    assert body["templated_text"] == "<B>[hi]"
    given.write_text(json.dumps({"eos_token": "</E>"}))
    body = make_fe(chat_model_dir, tokenizer_config_path=str(given)).post(
        "/chat_tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2]
    assert body["templated_text"] == "<s><user>hi\n<assistant>"


def test_template_exceptions_are_template_errors(make_fe, chat_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(chat_model_dir, d)
    (d / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    status, _, body = chat(make_fe(d))
    openai_error(status, body, 422, "template_error", "Template error: roles must alternate")


def test_tools_reach_the_scheduler_as_a_grammar(make_fe):
    fe = make_fe(max_input_tokens=900, max_total_tokens=1000)  # the tools are injected into the prompt
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    status, _, body = chat(fe, tools=tools)
    assert status == 200, body
    grammar = fe.sched.adds[last_rid(fe)].grammar
    assert grammar.kind == "lark" and '"const": "f"' in grammar.source
    status, _, body = chat(fe, tools=tools, tool_choice="none")
    assert status == 200 and fe.sched.adds[last_rid(fe)].grammar is None
    status, _, body = chat(fe, tools=tools, tool_choice={"type": "function", "function": {"name": "g"}})
    openai_error(status, body, 422, "tool_error", "Tool error: Tool with name g not found")
    status, _, body = chat(fe, tools=tools, response_format={"type": "json_object"})
    openai_error(status, body, 422, "tool_error", "Tool error: Grammar and tools are mutually exclusive")


def test_stop_text_is_cut_from_openai_answers(fe):
    stop = "wörld"
    status, _, body = chat(fe, stop=[stop, "zzz"])
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hello "},
                                  "logprobs": None, "finish_reason": "stop"}
    status, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stop": stop, "stream": True})
    events = stream_events(raw)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "Hello " and stop[0] not in text.replace("Hello ", "")
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # TGI's native route keeps the stop sequence in the text
    status, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"stop": [stop]}})
    assert body["generated_text"] == "Hello wörld"


def test_vllm_stop_token_ids_min_tokens_and_include_stop_str_in_output(fe):
    """vLLM's extensions: stop ids beside EOS (kept by ignore_eos), min_tokens masking every id that would end the
    request (EOS only without ignore_eos) and holding back stop sequences, and a stop sequence kept in the text."""
    chat(fe, stop_token_ids=[7, 9, 7], min_tokens=3)
    add = fe.sched.adds[last_rid(fe)]
    assert add.stopping.request_stop_ids == [7, 9] and add.stopping.stop_token_ids == [EOS]
    assert (add.sampling.min_new_tokens, add.sampling.min_tokens_masked_ids) == (3, [EOS, 7, 9])
    chat(fe, stop_token_ids=[7], min_tokens=2, ignore_eos=True)
    add = fe.sched.adds[last_rid(fe)]
    assert add.stopping.ignore_eos and add.stopping.request_stop_ids == [7]
    assert add.sampling.min_tokens_masked_ids == [7]
    chat(fe)
    add = fe.sched.adds[last_rid(fe)]
    assert (add.stopping.request_stop_ids, add.sampling.min_new_tokens, add.sampling.min_tokens_masked_ids) == (
        [], 0, [])
    # a stop id ends the answer there: counted, its text not shown unless asked (vLLM's rule), streamed or not
    first, second = fe.sched.reply[:2]
    _, _, body = chat(fe, stop_token_ids=[second])
    assert body["choices"][0]["message"]["content"] == fe.sched.tok.decode([first]), body
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("stop", 2)
    _, _, raw = fe.request("POST", "/v1/completions", {"prompt": "hi", "stop_token_ids": [second], "stream": True})
    assert "".join(e["choices"][0]["text"] for e in stream_events(raw)) == fe.sched.tok.decode([first])
    _, _, body = chat(fe, stop_token_ids=[second], include_stop_str_in_output=True)
    assert body["choices"][0]["message"]["content"] == fe.sched.tok.decode([first, second]), body
    # the stop sequence kept, streamed and not
    _, _, body = chat(fe, stop="wörld", include_stop_str_in_output=True)
    assert body["choices"][0]["message"]["content"] == "Hello wörld" and body["choices"][0]["finish_reason"] == "stop"
    _, _, raw = fe.request("POST", "/v1/completions", {"prompt": "hi", "stop": "wörld", "stream": True,
                                                      "include_stop_str_in_output": True})
    assert "".join(e["choices"][0]["text"] for e in stream_events(raw)) == "Hello wörld"
    # min_tokens: an "l" the first min_tokens tokens complete does not stop the answer (vLLM's rule); the first one
    # after them does
    _, _, body = chat(fe, stop="l")
    assert body["choices"][0]["message"]["content"] == "He"
    hello = next(k for k in range(1, len(fe.sched.reply)) if fe.sched.tok.decode(fe.sched.reply[:k]) == "Hello")
    _, _, body = chat(fe, stop="l", min_tokens=hello)
    assert body["choices"][0]["message"]["content"] == "Hello wör", body
    _, _, body = chat(fe, stop="l", min_tokens=hello, include_stop_str_in_output=True)
    assert body["choices"][0]["message"]["content"] == "Hello wörl", body
    # the budget's last token completing a stop within min_tokens: the budget ended it, the text uncut
    budget = next(k for k in range(1, len(fe.sched.reply) + 1) if "wörld" in fe.sched.tok.decode(fe.sched.reply[:k]))
    _, _, body = chat(fe, stop="wörld", max_tokens=budget, min_tokens=budget)
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"].endswith(
        "wörld"), body


def test_a_stop_completed_by_the_last_allowed_token_is_the_stop(fe):
    """The budget's last token completes the stop sequence: TGI says length and keeps the text; OpenAI's and
    Anthropic's routes cut it and say stop, as vLLM does (their text never holds a stop sequence)."""
    stop = "wörld"
    budget = next(k for k in range(1, len(fe.sched.reply) + 1) if stop in fe.sched.tok.decode(fe.sched.reply[:k]))
    _, _, body = chat(fe, stop=stop, max_tokens=budget)
    assert body["choices"][0]["message"]["content"] == "Hello " and body["choices"][0]["finish_reason"] == "stop"
    _, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stop": stop, "max_tokens": budget, "stream": True})
    events = stream_events(raw)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    _, _, body = fe.post("/v1/completions", {"prompt": "hi", "stop": [stop], "max_tokens": budget})
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello ", "stop")
    _, _, body = fe.post("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": budget,
                                          "stop_sequences": [stop]})
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop)
    assert body["content"] == [{"type": "text", "text": "Hello "}]
    _, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"stop": [stop], "max_new_tokens": budget,
                                                                      "details": True}})
    assert body["generated_text"] == "Hello wörld" and body["details"]["finish_reason"] == "length"
    # one token short of it, the budget ends the text as before
    _, _, body = chat(fe, stop=stop, max_tokens=budget - 1)
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_stream_bytes_usage_and_done(fe):
    status, headers, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = stream_events(raw)
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    *tokens, last, usage = events
    assert all(e["usage"] is None for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == REPLY
    assert last["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(fe.sched.reply) + 1
    # without include_usage: no usage key at all, no usage chunk
    _, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True})
    events = stream_events(raw)
    assert all("usage" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_n_choices_get_distinct_seeds(fe):
    status, _, body = chat(fe, n=3, seed=10, temperature=0.8)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == REPLY for c in body["choices"])
    seeds = sorted(add.sampling.seed for add in fe.sched.adds.values())
    assert seeds == [10, 11, 12]
    assert body["usage"]["prompt_tokens"] == len(next(iter(fe.sched.adds.values())).input_ids)
    assert body["usage"]["completion_tokens"] == 3 * (len(fe.sched.reply) + 1)
    _, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2})
    events = stream_events(raw)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["finish_reason"] == "stop"


def test_chat_logprobs(fe):
    status, _, body = chat(fe, logprobs=True, top_logprobs=2, max_tokens=4)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == -0.25 and first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.25, -5.0]
    assert fe.sched.adds[last_rid(fe)].sampling.top_n_tokens == 2
    _, _, body = chat(fe, logprobs=True, max_tokens=2)
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_name_each_token_by_its_own_bytes(fe, stream):
    """The reply's emoji comes as four one-byte tokens: each token's ``bytes`` are its own, so together they
    are the text's UTF-8, and a token reads the same where it was chosen and among the top tokens."""
    request = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
               "stream": stream}
    _, _, answer = fe.request("POST", "/v1/chat/completions", request)
    if stream:
        rows = [row for e in stream_events(answer)[1:] if e["choices"][0]["logprobs"]
                for row in e["choices"][0]["logprobs"]["content"]]
    else:
        rows = json.loads(answer)["choices"][0]["logprobs"]["content"]
    *text_rows, eos = rows
    assert b"".join(bytes(r["bytes"]) for r in text_rows) == REPLY.encode()
    assert eos["token"] == "</s>"
    split = [r for r in text_rows if r["token"] == "\ufffd"]
    assert [len(r["bytes"]) for r in split] == [1, 1, 1, 1], text_rows
    for row in rows:  # the fake engine's top token is the chosen one
        assert (row["top_logprobs"][0]["token"], row["top_logprobs"][0]["bytes"]) == (row["token"], row["bytes"])


def test_in_stream_errors_then_done(fe):
    _, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "FAIL"}], "stream": True})
    events = stream_events(raw)
    assert events[-1]["error"]["message"] == "Input validation error: bad thing"


# --- completions -----------------------------------------------------------------------------------


def test_completions_prompts_n_and_usage(fe):
    status, _, body = fe.post("/v1/completions", {"prompt": ["hello world", "the fox"], "n": 2,
                                                  "max_tokens": 5})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in body["choices"])
    prompts = sorted(len(a.input_ids) for a in fe.sched.adds.values())
    assert len(prompts) == 4
    assert body["usage"]["prompt_tokens"] == prompts[0] + prompts[2]
    assert body["usage"]["completion_tokens"] == 20
    _, _, body = fe.post("/v1/completions", {"prompt": "hi"})
    assert fe.sched.adds[last_rid(fe)].stopping.max_new_tokens == 16, "OpenAI's default max_tokens"


def test_completions_echo_and_logprobs(fe, make_fe, model_dir):
    request = {"prompt": "the fox", "echo": True, "logprobs": 1, "max_tokens": 3}
    # the prompt's logprobs are computed only where the server enables them: said, not nulls in their place
    status, _, body = make_fe(model_dir, enable_prefill_logprobs=False).post("/v1/completions", request)
    openai_error(status, body, 422, "validation", "--enable-prefill-logprobs", param="echo")
    _, _, body = fe.post("/v1/completions", request)  # (the fake's frontends enable them)
    choice = body["choices"][0]
    assert choice["text"].startswith("the fox")
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None
    assert "".join(lp["tokens"][1:]) == choice["text"]
    assert lp["text_offset"][1] == 0 and lp["text_offset"][-1] == len(choice["text"]) - len(lp["tokens"][-1])
    assert lp["token_logprobs"][-3:] == [-0.25, -0.5, -0.75]
    assert list(lp["top_logprobs"][-1].values()) == [-0.75]


def test_completions_echo_lists_each_prompt_tokens_top_logprobs(make_fe, model_dir):
    """With --enable-prefill-logprobs, echo with logprobs gives the prompt tokens their logprobs and their
    positions' top tokens, as for generated ones (lm-eval's loglikelihood reads both); the first has neither."""
    fe = make_fe(model_dir)
    _, _, body = fe.post("/v1/completions", {"prompt": "the fox", "echo": True, "logprobs": 2, "max_tokens": 2})
    lp = body["choices"][0]["logprobs"]
    prompt = len(fe.sched.adds[last_rid(fe)].input_ids)
    tokens, tops = lp["tokens"][:prompt], lp["top_logprobs"][:prompt]
    assert lp["token_logprobs"][:prompt] == [None] + [-1.5] * (prompt - 1) and tops[0] is None
    assert tops[1:] == [{token: -1.5, "</s>": -5.0} for token in tokens[1:]], tops
    assert all(len(top) == 2 for top in lp["top_logprobs"][prompt:])
    # streamed, the echo comes with the prompt's logprobs (which arrive with the first tokens), then the tokens
    _, _, raw = fe.request("POST", "/v1/completions", {"prompt": "the fox", "echo": True, "logprobs": 2,
                                                       "max_tokens": 2, "stream": True})
    events = [e["choices"][0] for e in stream_events(raw)]
    assert events[0]["text"] == "the fox" and events[0]["logprobs"]["top_logprobs"] == tops
    assert events[0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:prompt]
    assert [t for e in events for t in e["logprobs"]["tokens"]] == lp["tokens"]


def test_usage_reports_the_prompt_tokens_the_cache_held(fe):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: what the scheduler says the prefix cache held, a
    prompt counted once however many choices it has."""
    fe.sched.cached_tokens = 3
    assert chat(fe)[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    _, _, raw = fe.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0.5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert stream_events(raw)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    _, _, body = fe.post("/v1/completions", {"prompt": ["the fox", "a dog"], "max_tokens": 2, "n": 2})
    assert len(body["choices"]) == 4 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}


def test_completions_take_prompts_as_token_ids(fe):
    """OpenAI's token-id prompts (one, or one per prompt): fed as they are, no special token added; the echo
    is their text, special tokens taking no room, and the answer is the text prompt's."""
    ids = fe.sched.tok.encode("the fox").ids  # with the BOS the text prompt gets
    _, _, by_text = fe.post("/v1/completions", {"prompt": "the fox", "echo": True, "max_tokens": 3})
    assert fe.sched.adds[last_rid(fe)].input_ids == ids and ids[0] == 0
    _, _, body = fe.post("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 3})
    assert fe.sched.adds[last_rid(fe)].input_ids == ids
    assert body["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)
    _, _, body = fe.post("/v1/completions", {"prompt": [ids[1:], ids[1:2]], "max_tokens": 2})
    fed = sorted(a.input_ids for a in list(fe.sched.adds.values())[-2:])
    assert fed == sorted([ids[1:], ids[1:2]]) and len(body["choices"]) == 2, fed


def test_completions_stream(fe):
    _, _, raw = fe.request("POST", "/v1/completions", {"prompt": ["a", "b"], "stream": True, "max_tokens": 30,
                                                       "stream_options": {"include_usage": True}})
    events = stream_events(raw)
    assert all(e["object"] == "text_completion" for e in events)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLY
        assert [c["finish_reason"] for c in mine][-2:] == [None, "stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2 * (len(fe.sched.reply) + 1)


@pytest.mark.parametrize("body, status, error_type, message", [
    ({"prompt": "x", "suffix": "y"}, 422, "suffix not supported",
     "Suffix is not supported and can be achieved by preprocessing the prompt."),
    ({"prompt": ["a"] * 5}, 422, "batch size exceeded",
     "Number of prompts exceeds the maximum allowed batch size of 4"),
    ({"prompt": []}, 422, "validation",
     "Input validation error: Empty array detected. Do not use an empty array for the prompt."),
    *(({"prompt": bad}, 422, "validation", "Input validation error: `prompt` must be a string, an array of "
       "strings, an array of token ids (integers >= 0) or an array of non-empty arrays of token ids")
      for bad in ([1, "x"], [[1, 2], []], [1, -2], [1, True], [[1], "x"])),
    ({"prompt": [1, 10**9]}, 422, "validation", "Input validation error: token id 1000000000 is out of the vocabulary"),
    ({"prompt": "x", "logprobs": 9}, 422, "validation",
     "Input validation error: `logprobs` must be >= 0 and <= 5. Given: 9"),
    ({"prompt": "x", "best_of": 3}, 422, "validation", "Input validation error: `best_of` must equal `n`"),
])
def test_completion_errors(fe, body, status, error_type, message):
    got_status, _, answer = fe.post("/v1/completions", body)
    assert got_status == status and answer["error_type"] == error_type, answer
    assert answer["error"]["message"].startswith(message)


# --- other routes ----------------------------------------------------------------------------------


def test_models_tokenize_and_chat_tokenize(fe):
    status, _, body = fe.post("/tokenize", {"inputs": "hello wörld"})
    assert status == 200
    assert [t["id"] for t in body] == fe.sched.tok.encode("hello wörld").ids
    assert body[0] == {"id": 0, "text": "", "start": 0, "stop": 0}
    assert "".join(t["text"] for t in body) == "hello wörld"
    assert all("hello wörld"[t["start"]:t["stop"]] == t["text"] for t in body)
    status, _, body = fe.post("/chat_tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert body["templated_text"] == "<s><user>hi\n<assistant>"
    assert [t["id"] for t in body["tokenize_response"]] == fe.sched.tok.encode(
        body["templated_text"], add_special_tokens=False).ids
    status, _, body = fe.request("GET", "/v1/models")
    assert json.loads(body) == {"object": "list", "data": [{"id": "tiny-test", "object": "model", "created": 0,
                                                            "owned_by": "tiny-test", "max_model_len": 64}]}


def test_vllm_truncate_prompt_tokens_keeps_the_prompts_last_tokens(fe):
    chat(fe)
    whole = fe.sched.adds[last_rid(fe)].input_ids
    chat(fe, truncate_prompt_tokens=3)
    assert fe.sched.adds[last_rid(fe)].input_ids == whole[-3:]
    chat(fe, truncate_prompt_tokens=-1)  # as many as the server takes: all of this one
    assert fe.sched.adds[last_rid(fe)].input_ids == whole
    fe.post("/v1/completions", {"prompt": "hello wörld and more", "truncate_prompt_tokens": 2})
    assert fe.sched.adds[last_rid(fe)].input_ids == fe.sched.tok.encode("hello wörld and more").ids[-2:]
    for keep in (0, -2, 41):
        status, _, body = chat(fe, truncate_prompt_tokens=keep)
        assert status == 422 and body["error"]["param"] == "truncate_prompt_tokens", body
        assert "`truncate_prompt_tokens` must be -1 or >= 1 and <= 40" in body["error"]["message"]


def test_vllm_and_llama_cpp_tokenize_and_detokenize(fe):
    """/tokenize in vLLM's shapes (a prompt, with special tokens by default; messages, as the chat route renders
    them) and llama.cpp's (content, without them by default; with pieces), and /detokenize, whose text turns back
    into the same ids; TGI's shape and its errors unchanged."""
    tok, text = fe.sched.tok, "hello wörld"
    status, _, body = fe.post("/tokenize", {"prompt": text})
    assert status == 200 and body == {"count": len(tok.encode(text).ids), "max_model_len": 64,
                                      "tokens": tok.encode(text).ids, "token_strs": None}, body
    _, _, body = fe.post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    plain = tok.encode(text, add_special_tokens=False).ids
    assert body["tokens"] == plain and "".join(body["token_strs"]) == text
    _, _, body = fe.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert body["tokens"] == tok.encode("<s><user>hi\n<assistant>", add_special_tokens=False).ids
    _, _, body = fe.post("/tokenize", {"content": text})
    assert body == {"tokens": plain}
    _, _, body = fe.post("/tokenize", {"content": text, "add_special": True, "with_pieces": True})
    assert [t["id"] for t in body["tokens"]] == tok.encode(text).ids and body["tokens"][0]["piece"] == "<s>"
    status, _, body = fe.post("/detokenize", {"tokens": tok.encode(text).ids})
    assert status == 200 and body == {"prompt": "<s>" + text, "content": "<s>" + text}, body
    for route, bad, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"content": ["a"]}, "content"),
                              ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
                              ("/detokenize", {"tokens": [1, -2]}, "tokens"), ("/detokenize", {}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        status, _, body = fe.post(route, bad)
        assert status == 422 and body["error_type"] == "validation" and f"`{param}`" in body["error"], (route, body)
    status, _, body = fe.post("/tokenize", {"inputs": 5})  # TGI's own body keeps TGI's error
    assert status == 422 and "inputs" in body["error"], body


def test_invocations_dispatch(fe):
    _, _, body = fe.post("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert isinstance(body, list) and "generated_text" in body[0]
    _, _, body = fe.post("/invocations", {"messages": [{"role": "user", "content": "hi"}]})
    assert body["object"] == "chat.completion"
    _, _, body = fe.post("/invocations", {"prompt": "hi", "max_tokens": 2})
    assert body["object"] == "text_completion"
    # both shapes at once: TGI's untagged union tries its generate request first
    _, _, body = fe.post("/invocations", {"inputs": "hi", "messages": [{"role": "user", "content": "hi"}]})
    assert isinstance(body, list) and "generated_text" in body[0], body
    status, _, body = fe.post("/invocations", [1])
    assert status == 422 and body["error_type"] == "validation"


# --- guards ----------------------------------------------------------------------------------------

GENERATION_ROUTES = {"/": {"inputs": "hi"}, "/generate": {"inputs": "hi"}, "/generate_stream": {"inputs": "hi"},
                     "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
                     "/v1/completions": {"prompt": "hi"}, "/invocations": {"inputs": "hi"},
                     "/vertex": {"instances": [{"inputs": "hi"}]}, "/tokenize": {"inputs": "hi"},
                     # TGI leaves this one open; it tokenizes as /tokenize does
                     "/chat_tokenize": {"messages": [{"role": "user", "content": "x"}]}}


def test_api_key_guards_every_generation_route(make_fe):
    fe = make_fe(api_key="Secret")
    for path, body in GENERATION_ROUTES.items():
        assert fe.request("POST", path, body)[0] == 401, path
        status, _, _ = fe.request("POST", path, body, headers={"Authorization": "Bearer secret",
                                                               "Content-Type": "application/json"})
        assert status == 200, path
    for path in ("/health", "/info", "/metrics", "/v1/models"):
        assert fe.request("GET", path)[0] == 200, path


def test_cors_any_origin_by_default(fe):
    status, headers, _ = fe.request("OPTIONS", "/generate", headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST"})
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    # DELETE: /v1/responses/{id}
    assert set(headers["access-control-allow-methods"].split(",")) == {"GET", "POST", "DELETE"}
    assert "content-type" in headers["access-control-allow-headers"]
    status, headers, _ = fe.request("GET", "/info", headers={"Origin": "https://a.example"})
    assert status == 200 and headers["access-control-allow-origin"] == "*"


def test_cors_listed_origins_only(make_fe):
    fe = make_fe(cors_allow_origin=["https://ok.example"])
    _, headers, _ = fe.request("GET", "/info", headers={"Origin": "https://ok.example"})
    assert headers["access-control-allow-origin"] == "https://ok.example"
    _, headers, _ = fe.request("GET", "/info", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_payload_limit_is_413_json(make_fe):
    fe = make_fe(payload_limit=1000)
    status, _, raw = fe.request("POST", "/generate", {"inputs": "x" * 2000})
    assert (status, json.loads(raw)) == (413, {"error": "Failed to buffer the request body: length limit "
                                                        "exceeded", "error_type": "payload_too_large"})
    status, _, raw = fe.request("POST", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                               "content": "x" * 2000}]})
    assert status == 413 and json.loads(raw)["error"]["code"] == "payload_too_large"
    assert fe.post("/generate", {"inputs": "hi"})[0] == 200


def test_overloaded_on_openai_routes_and_choices_take_permits(make_fe):
    fe = make_fe(max_concurrent_requests=2)
    conn = socket.create_connection((fe.host, fe.port), timeout=WAIT)
    body = json.dumps({"messages": [{"role": "user", "content": "HOLD"}], "n": 2}).encode()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    fe.sched.wait_for(lambda: len(fe.sched.adds) == 2, "both choices to arrive")
    status, _, answer = chat(fe)
    openai_error(status, answer, 429, "overloaded", "Model is overloaded")
    assert answer["error"]["type"] == "rate_limit_error"
    status, _, answer = fe.post("/v1/completions", {"prompt": "hi"})
    assert status == 429
    conn.close()  # the client leaves: both choices are aborted and their permits return
    fe.sched.wait_for(lambda: len(fe.sched.aborts) == 2, "both choices to be aborted")
    for rid in list(fe.sched.adds):
        fe.sched.release(rid)
    assert chat(fe)[0] == 200


def test_eos_id_is_stop_for_openai(fe):
    # EOS ends the reply: OpenAI calls it "stop"; the native route says eos_token
    _, _, body = fe.post("/generate", {"inputs": "hi", "parameters": {"details": True}})
    assert body["details"]["finish_reason"] == "eos_token"
    assert body["details"]["tokens"][-1]["id"] == EOS
