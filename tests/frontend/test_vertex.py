"""TGI's Vertex AI route against the fake scheduler (llmbus.testing.fake_scheduler): ``POST /vertex`` with
generate and chat instances, its errors, and the paths Vertex's environment names (AIP_PREDICT_ROUTE,
AIP_HEALTH_ROUTE); the real stack's answer is in tests/e2e/test_real_models.py."""

from __future__ import annotations

import json

from llmbus.testing.fake_scheduler import last_rid
from llmbus.testing.http import parse_exposition


def test_each_instance_is_answered_as_its_own_route_answers(make_fe):
    fe = make_fe()
    generate = {"inputs": "hi", "parameters": {"max_new_tokens": 4, "stop": ["wörld"]}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stop": ["wörld"]}
    status, _, body = fe.post("/vertex", {"instances": [generate, chat, {**generate, "parameters": {
        "max_new_tokens": 3, "return_full_text": True}}]})
    assert status == 200, body
    expected_generate = fe.post("/generate", generate)[2]["generated_text"]
    expected_chat = fe.post("/v1/chat/completions", chat)[2]["choices"][0]["message"]["content"]
    expected_full = "hi" + fe.post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3}})[2][
        "generated_text"]
    assert body == {"predictions": [expected_generate, expected_chat, expected_full]}
    assert expected_generate.endswith("wörld") and "wörld" not in expected_chat  # each route's rule on stops

    # TGI samples a generate instance; one that says do_sample false is greedy
    fe.post("/vertex", {"instances": [{"inputs": "hi"}]})
    assert fe.sched.adds[last_rid(fe)].sampling.do_sample is True
    fe.post("/vertex", {"instances": [{"inputs": "hi", "parameters": {"do_sample": False}}]})
    assert fe.sched.adds[last_rid(fe)].sampling.do_sample is False


def test_bad_instances_are_422_naming_the_instance(make_fe):
    fe = make_fe()
    status, _, body = fe.post("/vertex", {"instances": []})
    assert (status, body) == (422, {"error": "Input validation error: `instances` must be a non-empty array of "
                                             "generate or chat requests", "error_type": "validation"})
    status, _, body = fe.post("/vertex", {"instances": [{"inputs": "x"}, {"prompt": "x"}]})
    assert status == 422 and body["error"].endswith("(`messages`) (instances[1])"), body
    status, _, body = fe.post("/vertex", {"instances": [{"inputs": "x", "parameters": {"top_p": 1.0}}]})
    assert status == 422 and "`top_p` must be > 0.0 and < 1.0 (instances[0])" in body["error"], body
    status, _, body = fe.post("/vertex", {"instances": [{"messages": [{"role": "user", "content": "x"}], "n": 2}]})
    assert status == 422 and body["error"].endswith("(instances[0])"), body
    assert fe.post("/vertex", [1])[0] == 422


def test_vertex_environment_routes_are_the_routes_they_stand_for(make_fe):
    fe = make_fe(aip_predict_route="/v1/endpoints/7:predict", aip_health_route="/ping-vertex", api_key="k")
    instances = {"instances": [{"inputs": "hi", "parameters": {"max_new_tokens": 2}}]}
    assert fe.request("POST", "/v1/endpoints/7:predict", instances)[0] == 401, "guarded as /vertex is"
    status, _, raw = fe.request("POST", "/v1/endpoints/7:predict", instances,
                                headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert status == 200 and b"predictions" in raw, raw
    status, _, raw = fe.request("POST", "/v1/endpoints/7:predict", {"instances": []},
                                headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert status == 422 and json.loads(raw)["error_type"] == "validation", "TGI's envelope, not OpenAI's, under /v1/"
    assert fe.request("GET", "/ping-vertex")[0] == 200
    text = fe.request("GET", "/metrics")[2].decode()
    assert parse_exposition(text, labels=True)['llmbus_request_route_count{route="/vertex"}'] == 2, text
