"""The Responses API's store on a real `llmbus up` (the tiny demo model) run with ``--responses-store-size 2``
and ``--api-key``: the flag reaches the frontend through `llmbus up`, the least recently *used* response is
the one dropped, ``previous_response_id`` of a dropped one is a 404, and reading or deleting a stored
response needs the key as creating one does.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from llmbus.testing import Server, post


@pytest.fixture(scope="module")
def server(tiny_keyed_server):
    """The shared server run with ``--api-key`` and ``--responses-store-size 2``. Responses stored before these
    tests are the least recently used: the first ones dropped, whatever the eviction order checked here."""
    return tiny_keyed_server


def _auth(server: Server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def _call(server: Server, method: str, response_id: str, headers: dict | None = None) -> tuple[int, dict | None]:
    request = urllib.request.Request(f"{server.url}/v1/responses/{response_id}", method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body else None


def _create(server: Server, **body) -> dict:
    status, _, answer = post(server.url + "/v1/responses", {"input": "Hello", "max_output_tokens": 2, **body},
                             headers=_auth(server))
    assert status == 200, answer
    return answer


def test_the_least_recently_used_response_goes_first(server):
    auth = _auth(server)
    a, b = _create(server), _create(server)
    assert _call(server, "GET", a["id"], auth)[0] == 200  # a is now the most recently used
    c = _create(server)  # the store holds 2: b goes
    assert _call(server, "GET", b["id"], auth)[0] == 404
    assert _call(server, "GET", a["id"], auth)[1] == a and _call(server, "GET", c["id"], auth)[1] == c
    # continuing the dropped one is the same 404, in OpenAI's envelope
    status, _, answer = post(server.url + "/v1/responses", {"input": "More", "previous_response_id": b["id"]},
                             headers=auth)
    assert status == 404 and answer["error"]["param"] == "response_id", answer
    # continuing a kept one works, and store: false keeps the newest out (a and c stay)
    d = _create(server, previous_response_id=c["id"], store=False)
    assert d["previous_response_id"] == c["id"] and d["usage"]["input_tokens"] > c["usage"]["input_tokens"]
    assert _call(server, "GET", d["id"], auth)[0] == 404 and _call(server, "GET", a["id"], auth)[0] == 200


def test_reading_and_deleting_need_the_key(server):
    auth = _auth(server)
    answer = _create(server)
    for method in ("GET", "DELETE"):
        assert _call(server, method, answer["id"])[0] == 401
        assert _call(server, method, answer["id"], {"Authorization": "Bearer wrong"})[0] == 401
    assert _call(server, "DELETE", answer["id"], auth) == (200, {"id": answer["id"], "object": "response.deleted",
                                                            "deleted": True})
    assert _call(server, "DELETE", answer["id"], auth)[0] == 404
    assert post(server.url + "/v1/responses", {"input": "Hello"})[0] == 401
