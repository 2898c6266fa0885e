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


def test_a_stranger_leaving_the_control_channel_does_not_stop_the_server(tmp_path, tiny_model_dir):
    """Any local process of ours may connect to control.sock; only a worker rank's leaving is fatal (the
    scheduler tells ranks by the pids of their hellos). A bare connect and disconnect stopped the server."""
    import zmq

    from harness import Server
    from httputil import post

    run_dir = tmp_path / "run"
    srv = Server(["--model-id", str(tiny_model_dir), "--run-dir", str(run_dir), "--max-total-tokens", "256"])
    try:
        ctx = zmq.Context()
        for _ in range(3):
            stranger = ctx.socket(zmq.PUSH)
            stranger.connect(f"ipc://{run_dir}/control.sock")
            stranger.send_multipart([b"\x01", b"\xc1"])  # and a malformed message on the way out
            stranger.close(linger=1000)
        ctx.term()
        status, _, body = post(f"{srv.url}/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 3}})
        assert status == 200, body
        srv.stderr.wait_for("not a worker rank left the control channel", 30)
        assert srv.proc.poll() is None
    finally:
        assert srv.stop() == 0
