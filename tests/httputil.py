"""Minimal blocking HTTP helpers for tests (stdlib only, so they test our server, not a client library)."""

from __future__ import annotations

import json
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


def _parse(body: bytes):
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
