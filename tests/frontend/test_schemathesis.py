"""schemathesis against the served OpenAPI document: a real `llmbus up` on the tiny demo model answers
requests generated from /api-doc/openapi.json (valid ones and broken ones), and every answer must be one
the document describes (its status, content type, headers and body schema, SSE events included) and
never a 5xx. Deterministic: the same requests every run.

Also here, on the same server: a client that leaves before the response starts is one log line, not a
traceback.
"""

from __future__ import annotations

import json
import socket
import struct
import urllib.error
import urllib.request

import pytest
import requests
import schemathesis

from llmbus.frontend.openapi import SPEC_PATH
from llmbus.testing import Server

# Generations are kept short so that the run (a few thousand requests, most from the coverage phase's
# boundary values) stays within a minute on 2 cores with no operation or parameter left out: the server
# ends every one within MAX_TOTAL_TOKENS (prompt included), and the test cuts the lengths the fuzzer asks
# for to MAX_NEW_TOKENS (see _shorten_generation).
MAX_TOTAL_TOKENS = 32
MAX_NEW_TOKENS = 2  # a stream still has an event before its last one
# per operation, for the fuzzing phase: a random body of the big request schemas costs the client more to draw
# than anything else in the run; the boundary values are the coverage phase's
MAX_EXAMPLES = 4

# What the document promises about answers. Left out: positive_data_acceptance, since JSON Schema cannot
# say what the server refuses on purpose (prompt tokens + max_new_tokens <= --max-total-tokens, rules
# between fields, a chat template's own checks, TGI's serde refusing an integer written as 1.0);
# negative_data_rejection, since TGI answers rule errors on /generate_stream in-band with a 200 and its
# /tokenize applies none of the parameters' rules.
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32",
                  "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--num-blocks", "64", "--block-size", "16"])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


@pytest.fixture(scope="module")
def served_schema(server):
    config = schemathesis.Config.from_dict({
        "seed": 1,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True,
                       "database": "none"},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
        # Each of these takes another route's body, read by that route's reader, whose boundary values that
        # route's coverage phase already sends: /invocations any of POST /'s, /v1/chat/completions' and
        # /v1/completions'; /vertex a list of /generate's; POST / /generate's (plus `stream`, which picks
        # /generate's or /generate_stream's answer); /chat_tokenize /v1/chat/completions' (the same
        # parse_chat). Their own coverage phases would send them all again (a third of the run, then a fifth
        # of the rest, then a fifth again). Their examples and fuzzing phases stay.
        "operations": [{"include-operation-id": operation_id, "phases": {"coverage": {"enabled": False}}}
                       for operation_id in ("sagemaker_invocations", "vertex_compatibility", "compat_generate",
                                            "chat_tokenize")],
    })
    return schemathesis.openapi.from_url(server.url + SPEC_PATH, config=config)


schema = schemathesis.pytest.from_fixture("served_schema")


@pytest.fixture(scope="module")
def http_session():
    """One keep-alive session for the run's thousands of requests (schemathesis opens a connection per request
    without one), not reading proxies from the environment for each of them."""
    with requests.Session() as session:
        session.trust_env = False
        yield session


def _shorten_generation(body) -> None:
    """A length the server would accept, or none (which runs to MAX_TOTAL_TOKENS), becomes MAX_NEW_TOKENS;
    a length it refuses stays, for its 422. A TGI body without `parameters` keeps TGI's defaults for that
    case (do_sample on), so it is left alone."""
    if not isinstance(body, dict):
        return
    if "inputs" in body:
        fields, names = body.get("parameters"), ("max_new_tokens",)
    elif "input" in body:  # /v1/responses
        fields, names = body, ("max_output_tokens",)
    else:
        fields, names = body, ("max_tokens", "max_completion_tokens")
    if not isinstance(fields, dict):
        return
    for name in names:
        value = fields.get(name)
        if type(value) is int and MAX_NEW_TOKENS < value <= MAX_TOTAL_TOKENS:
            fields[name] = MAX_NEW_TOKENS
    if all(fields.get(name) is None for name in names):
        fields[names[0]] = MAX_NEW_TOKENS


@schema.parametrize()
def test_answers_match_the_document(case, http_session):
    _shorten_generation(case.body)
    case.call_and_validate(session=http_session, timeout=30)


def _post(server: Server, path: str, body: dict) -> tuple[int, str, dict]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], json.loads(e.read())


@pytest.mark.parametrize("path,body,error", [
    # serde's errors are the body's, so HTTP 422s even where rule errors go in-band (a stream) or are not
    # checked at all (/tokenize); they were a 200 with the error in-band, and a 200
    ("/generate_stream", {"inputs": "hi", "parameters": {"grammar": {}}},
     "Failed to deserialize the JSON body into the target type: parameters.grammar: missing field `type`"),
    ("/tokenize", {"inputs": "hi", "parameters": {"grammar": {"type": "regex"}}},
     "Failed to deserialize the JSON body into the target type: parameters.grammar: missing field `value`"),
    ("/", {"inputs": "hi", "stream": True, "parameters": {"grammar": {"type": "json_schema", "value": {}}}},
     "Failed to deserialize the JSON body into the target type: parameters.grammar.value: missing field "
     "`schema`"),
    # was a 500: the AddRequest message could not carry it
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64},
     "Input validation error: `top_k` must be <= 2147483647. Given: 18446744073709551616"),
    # went to the chat template as it was (TGI's serde refuses it)
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4", "tool_call_id": 5}]},
     "Input validation error: `messages[0].tool_call_id` must be a string. Given: 5"),
])
def test_fuzzing_findings_are_422s(server, path, body, error):
    status, content_type, answer = _post(server, path, body)
    assert (status, content_type) == (422, "application/json"), answer
    assert (answer["error"]["message"] if path.startswith("/v1/") else answer["error"]) == error, answer


def _send_and_leave(port: int, path: str, body: dict) -> None:
    """A request whose client resets the connection (SO_LINGER 0) as soon as it is sent."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


def _health(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.makefile("rb").readline()


@pytest.mark.parametrize("path,body", [
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 20}}),
    ("/", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 20}}),
])
def test_client_gone_before_the_response_is_one_info_line(server, path, body):
    """A stream whose headers meet a closing socket: aiohttp's "Cannot write to closing transport" came out
    of the handler, and aiohttp logged it as a 500 with its whole traceback."""
    first = len(server.stderr.lines)
    needle, line = f"client disconnected before the response method=POST path={path} ", None
    for _ in range(10):  # a reset that lands after the headers went out is a client that left mid-stream instead
        for _ in range(10):
            _send_and_leave(server.port, path, body)
        try:
            line = server.stderr.wait_for(needle, 2)
            break
        except TimeoutError:
            continue
    assert line is not None and "[info" in line, line
    assert _health(server.port).startswith(b"HTTP/1.1 200")  # still serving
    said = "\n".join(server.stderr.lines[first:])
    assert "Traceback" not in said and "closing transport" not in said, said[-3000:]
