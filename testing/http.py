"""Minimal blocking HTTP helpers for tests and benchmarks (stdlib only, so they exercise our server, not a
client library)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def post(url: str, body, *, raw: bytes | None = None, timeout: float = 120, headers: dict | None = None):
    """(status, headers, parsed JSON or text) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), _parse(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), _parse(e.read())


def get(url: str, timeout: float = 30):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, _parse(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read())


def stream(url: str, body, timeout: float = 120) -> bytes:
    """The raw body of an SSE response."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def sse_events(raw: bytes) -> list[dict]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            events.append(json.loads(block[len("data: "):]))
    return events


def named_sse_events(raw: bytes, *, comments: bool = False) -> list[tuple[str, dict]]:
    """(event name, data) of each ``event:``/``data:`` block of an SSE body (Anthropic's and the Responses API's
    shape); keep-alive comment blocks are left out where ``comments`` allows them, and fail otherwise."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block or (comments and block.startswith(":")):
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def read_lines_until(response, line: bytes, count: int) -> list[bytes]:
    """Lines of an open ``http.client`` response, read until ``line`` came ``count`` times."""
    lines = []
    while sum(seen == line for seen in lines) < count:
        lines.append(response.readline())
    return lines


def parse_exposition(text: str, *, labels: bool = False) -> dict[str, float]:
    """Samples of a Prometheus text exposition under their names exactly as written (prometheus_client's
    parser renames counters to ``*_total``, which would hide TGI's names). With ``labels`` the key keeps
    the label set as written (``name{k="v"}``); without, labelled samples of a name: the last one wins."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        samples[key if labels else key.split("{", 1)[0]] = float(value)
    return samples


def metrics(base_url: str, *, labels: bool = False) -> dict[str, float]:
    """Every sample of ``/metrics`` (see parse_exposition)."""
    status, text = get(f"{base_url}/metrics")
    assert status == 200
    return parse_exposition(text, labels=labels)


def wait_for_metrics(base_url: str, condition, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``condition(samples)``: the scheduler's stats reach the frontend asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics(base_url)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, f"/metrics never satisfied the condition: {samples}"
        time.sleep(0.05)


def all_blocks_free(samples: dict[str, float]) -> bool:
    """Idle: nothing queued or running and every KV block owned by no request."""
    return samples.get("tgi_batch_current_size") == 0 and samples.get("tgi_queue_size") == 0 and \
        samples.get("llmbus_kv_blocks_free") == samples.get("llmbus_kv_blocks_total")


def _parse(body: bytes):
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
