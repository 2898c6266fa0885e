"""A peer that sends garbage cannot flood the log (issue #18): malformed messages are dropped with one
error line per kind per DROP_LOG_INTERVAL_S, which counts the ones dropped silently since."""

import structlog

from llmbus.bus import sockets


def test_dropped_messages_are_logged_at_most_once_per_interval_per_kind(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(sockets.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sockets, "_log_drop", sockets._DropLog())
    with structlog.testing.capture_logs() as logs:
        for _ in range(20_000):
            assert sockets._decode_or_log([b"\x01", b"\xc1 not msgpack"]) is None
        assert sockets._decode_or_log([b"only one frame"]) is None  # another kind: its own line
        clock[0] += sockets.DROP_LOG_INTERVAL_S
        assert sockets._decode_or_log([b"\x01", b"\xc1"]) is None
    lines = [entry for entry in logs if entry["event"] == "dropped malformed message"]
    assert [(line["kind"], line["suppressed_since_last"]) for line in lines] == [("01", 0), ("?", 0), ("01", 19_999)]
