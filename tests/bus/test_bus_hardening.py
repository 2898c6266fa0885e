"""No message can stop the server (issue #18): a peer that sends garbage cannot flood the log (malformed
messages are dropped with one error line per kind per DROP_LOG_INTERVAL_S, which counts the ones dropped
silently since), a well-formed message with wrong field types is dropped at decoding, a request the ranks
cannot take fails alone, and a local process cannot speak in the name of a frontend, the scheduler or a
rank (over ipc the sender's pid is known)."""

import dataclasses
import time

import msgpack
import pytest
import structlog
import zmq

from llmbus.bus import messages as m
from llmbus.bus import sockets
from llmbus.bus.sockets import open_socket, recv
from llmbus.testing.wire_samples import SAMPLES


def test_dropped_messages_are_logged_at_most_once_per_interval_per_kind(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(sockets.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sockets, "log_dropped", sockets.DropLog())

    def decode(frames):
        return sockets.decode_frames([zmq.Frame(f) for f in frames])[0]

    with structlog.testing.capture_logs() as logs:
        for _ in range(20_000):
            assert decode([b"\x01", b"\xc1 not msgpack"]) is None
        assert decode([b"only one frame"]) is None  # another kind: its own line
        clock[0] += sockets.DROP_LOG_INTERVAL_S
        assert decode([b"\x01", b"\xc1"]) is None
    lines = [entry for entry in logs if entry["event"] == "dropped malformed message"]
    assert [(line["kind"], line["suppressed_since_last"]) for line in lines] == [("01", 0), ("?", 0), ("01", 19_999)]


# ------------------------------------------------------------------------------------------------
# The real stack: every defect sent as the real message by a local process; the server keeps serving
# ------------------------------------------------------------------------------------------------

WRONG_VALUES = [None, "x", -1, 2 ** 64 - 1, 1.5, True, [], {}, [None], ["x"], [2 ** 64 - 1]]


def _mutations(values: list):
    """``values`` (a message's wire array) with one leaf, at any depth, replaced by each wrong value."""
    for i, value in enumerate(values):
        for wrong in WRONG_VALUES:
            if wrong != value or type(wrong) is not type(value):
                yield values[:i] + [wrong] + values[i + 1:]
        if isinstance(value, list) and value and isinstance(value[0], (list, int, float, str)):
            for inner in _mutations(value):
                yield values[:i] + [inner] + values[i + 1:]


@pytest.fixture(scope="module")
def server(tiny_server):
    """The shared tiny server: whatever these tests send, it keeps serving the modules that share it after them
    (its exit status is checked as it stops)."""
    return tiny_server, tiny_server.run_dir


def _serves(srv) -> None:
    from llmbus.testing.http import get, post

    status, _, body = post(f"{srv.url}/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 3}})
    assert status == 200, body
    assert get(f"{srv.url}/health")[0] == 200
    assert srv.proc.poll() is None


class RawPeer:
    """A local process writing our messages to the server's sockets, and reading what comes back."""

    def __init__(self, run_dir, frontend_id: str | None = None):
        self.ctx = zmq.Context()
        self.run_dir = run_dir
        self.events = None
        if frontend_id is not None:
            self.endpoint = f"ipc://{run_dir}/test-{frontend_id}.sock"
            self.events = open_socket(self.ctx, zmq.PULL, self.endpoint)

    def push(self, socket_name: str, *frames_or_msgs) -> None:
        sock = open_socket(self.ctx, zmq.PUSH, f"ipc://{self.run_dir}/{socket_name}", linger_ms=5000)
        for item in frames_or_msgs:
            sock.send_multipart(m.encode(item) if isinstance(item, m.Message) else item)
        sock.close()

    def next_event(self, kinds=(m.TokenBatch, m.RequestFailed, m.SchedulerHello), timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while self.events.poll(int(max(deadline - time.monotonic(), 0) * 1000) + 1):
            msg = recv(self.events)
            if isinstance(msg, kinds):
                return msg
            if time.monotonic() > deadline:
                break
        return None

    def close(self) -> None:
        if self.events is not None:
            self.events.close(0)
        self.ctx.term()


def test_wrong_field_types_on_the_intake_never_stop_the_server(server):
    srv, run_dir = server
    sent = 0
    peer = RawPeer(run_dir)
    for kind in (m.Kind.ADD_REQUEST, m.Kind.ABORT_REQUEST, m.Kind.HEALTH_CHECK, m.Kind.FRONTEND_STATS,
                 m.Kind.FRONTEND_HELLO):
        frames = [m.encode(SAMPLES[kind])[0] + b""]
        bad = [frames + [msgpack.packb(values)] for values in _mutations(SAMPLES[kind].to_wire())]
        peer.push("requests.sock", *bad)
        sent += len(bad)
    peer.close()
    assert sent > 300
    _serves(srv)


def test_requests_the_ranks_cannot_take_fail_alone(server):
    """A process that says hello as a frontend of its own gets a validation failure for an out-of-vocabulary
    id, an impossible sampling parameter or logit bias, an unknown grammar kind, a LoRA adapter the ranks do
    not hold or images the ranks could not place; its good request still runs."""
    srv, run_dir = server
    peer = RawPeer(run_dir, "chaos")
    peer.push("requests.sock", m.FrontendHello("chaos", peer.endpoint))
    assert isinstance(peer.next_event(), m.SchedulerHello)
    good = m.AddRequest("chaos-ok", "chaos", [5, 6, 7], m.SamplingParams(), m.StoppingParams(3))
    bad = {
        "chaos-vocab": dataclasses.replace(good, rid="chaos-vocab", input_ids=[5, 10 ** 9]),
        "chaos-negative": dataclasses.replace(good, rid="chaos-negative", input_ids=[-3]),
        "chaos-temp": dataclasses.replace(good, rid="chaos-temp",
                                          sampling=m.SamplingParams(temperature=float("nan"), do_sample=True)),
        "chaos-topk": dataclasses.replace(good, rid="chaos-topk", sampling=m.SamplingParams(top_k=-5)),
        "chaos-grammar": dataclasses.replace(good, rid="chaos-grammar", grammar=m.Grammar("yaml", "a: 1")),
        "chaos-len": dataclasses.replace(good, rid="chaos-len", stopping=m.StoppingParams(0)),
        "chaos-adapter": dataclasses.replace(good, rid="chaos-adapter", adapter="never-loaded"),
        # logit biases the ranks would index out of the logits with, add twice, or pair with nothing
        "chaos-bias-vocab": dataclasses.replace(good, rid="chaos-bias-vocab", sampling=m.SamplingParams(
            logit_bias_ids=[10 ** 9], logit_bias_values=[1.0])),
        "chaos-bias-twice": dataclasses.replace(good, rid="chaos-bias-twice", sampling=m.SamplingParams(
            logit_bias_ids=[4, 4], logit_bias_values=[1.0, 1.0])),
        "chaos-bias-unpaired": dataclasses.replace(good, rid="chaos-bias-unpaired", sampling=m.SamplingParams(
            logit_bias_ids=[4], logit_bias_values=[])),
        "chaos-bias-nan": dataclasses.replace(good, rid="chaos-bias-nan", sampling=m.SamplingParams(
            logit_bias_ids=[4], logit_bias_values=[float("nan")])),
        # images whose placeholders lie outside the prompt, overlap, or that the prefix cache could not key
        "chaos-image-out": dataclasses.replace(good, rid="chaos-image-out", images=[
            m.ImageInput(offset=2, num_tokens=2, data=b"x", digest=bytes(16))]),
        "chaos-image-overlap": dataclasses.replace(good, rid="chaos-image-overlap", images=[
            m.ImageInput(offset=0, num_tokens=2, data=b"x", digest=bytes(16)),
            m.ImageInput(offset=1, num_tokens=1, data=b"y", digest=bytes(16))]),
        "chaos-image-digest": dataclasses.replace(good, rid="chaos-image-digest", images=[
            m.ImageInput(offset=0, num_tokens=1, data=b"x", digest=b"short")]),
        # a grid that is not its tokens' rows and columns, and an image without its file
        "chaos-image-grid": dataclasses.replace(good, rid="chaos-image-grid", images=[
            m.ImageInput(offset=0, num_tokens=2, data=b"x", digest=bytes(16), grid=[2, 2])]),
        "chaos-image-stub": dataclasses.replace(good, rid="chaos-image-stub", images=[
            m.ImageInput(offset=0, num_tokens=1, data=b"", digest=bytes(16))]),
        # a well-formed image, for a model that reads none (the ranks would read its placeholders as text)
        "chaos-image-text-model": dataclasses.replace(good, rid="chaos-image-text-model", images=[
            m.ImageInput(offset=0, num_tokens=1, data=b"x", digest=bytes(16))]),
        # an id of the real frontend's: taken, it would make that frontend's own request a duplicate
        "f0-1": dataclasses.replace(good, rid="f0-1"),
    }
    peer.push("requests.sock", *bad.values(), good)
    failed, tokens = set(), 0
    while tokens < 3:
        ev = peer.next_event()
        assert ev is not None, (failed, tokens)
        if isinstance(ev, m.RequestFailed):
            assert ev.error_type == "validation"
            failed.add(ev.rid)
        elif isinstance(ev, m.TokenBatch):
            assert set(ev.rids) == {"chaos-ok"}
            tokens += len(ev.rids)
    assert failed == set(bad)
    peer.close()
    _serves(srv)


def test_forged_messages_from_another_process_are_dropped(server):
    srv, run_dir = server
    peer = RawPeer(run_dir, "forger")
    # the real frontend's id, held by a running process: no hijack of its events
    peer.push("requests.sock", m.FrontendHello("f0", peer.endpoint))
    # another wire version: caught at the handshake
    peer.push("requests.sock", m.FrontendHello("old", peer.endpoint, wire_version=m.WIRE_VERSION - 1))
    # the real frontend's requests, in its name, and an abort of one of its rids
    peer.push("requests.sock", m.AddRequest("f0-999", "f0", [5], m.SamplingParams(), m.StoppingParams(2)),
              m.AbortRequest(["f0-1", "f0-2"]))
    # the engine's messages to the frontend, and the ranks' to the scheduler
    peer.push("events-f0.sock", m.EngineDead("forged"))
    peer.push("results.sock", m.StepResult(10 ** 6, ["f0-1"], [3], [-0.5]))
    peer.push("control.sock", m.WorkerFatal(0, "forged"), m.WorkerHello(0, 1, pid=1),
              m.HealthAck(0, 1))
    assert peer.next_event(timeout=2.0) is None  # no SchedulerHello for either hello
    peer.close()
    for _ in range(2):
        _serves(srv)
    # One line per kind per DROP_LOG_INTERVAL_S: one may be an earlier test's of this module, the only one that
    # sends the shared server such messages
    log = srv.stderr.text
    for line in ("hello under the id of a frontend that is still running",
                 "frontend speaks another wire version", "message in another frontend's name",
                 "event from a process that is not the scheduler", "step result from a process that is not rank 0",
                 "control message from a process that is not a worker rank"):
        assert line in log, line


def test_a_stranger_leaving_the_control_channel_does_not_stop_the_server(server):
    """Any local process may connect to control.sock; only a worker rank's leaving is fatal (the
    scheduler tells ranks by the pids of their hellos). A bare connect and disconnect stopped the server."""
    srv, run_dir = server
    ctx = zmq.Context()
    for _ in range(3):
        stranger = ctx.socket(zmq.PUSH)
        stranger.connect(f"ipc://{run_dir}/control.sock")
        stranger.send_multipart([b"\x01", b"\xc1"])  # and a malformed message on the way out
        stranger.close(linger=1000)
    ctx.term()
    _serves(srv)
    srv.stderr.wait_for("not a worker rank left the control channel", 30)
    assert srv.proc.poll() is None


def test_a_stop_signal_during_decoding_is_not_a_malformed_message(monkeypatch):
    """SIGTERM's Terminate raised while a message is decoded (the launcher and the scheduler stop a rank at
    the same moment) reaches the service's loop; it used to be dropped with the message as undecodable."""
    from llmbus.bus.service import Terminate

    def interrupted(*args, **kwargs):
        raise Terminate()

    monkeypatch.setattr(msgpack, "unpackb", interrupted)
    with pytest.raises(Terminate):
        m.decode(m.encode(m.Shutdown(reason="stopping")))


def test_images_the_ranks_cannot_read_are_refused():
    """WorkerReady.images says what the model reads: images for a text model, and images without a grid for
    a model that places them by it (M-RoPE), are refused; unknown (None) and LLaVA's layout take them."""
    image = m.ImageInput(offset=0, num_tokens=2, data=b"x", digest=bytes(16))
    request = m.AddRequest("f0-1", "f0", [5, 5, 7], m.SamplingParams(), m.StoppingParams(3), images=[image])
    assert request.problem(100, images="") == "the model reads no images"
    assert request.problem(100, images="grid") == "the model places an image by its grid: every image needs one"
    assert request.problem(100, images="sequence") is None and request.problem(100) is None
    gridded = dataclasses.replace(request, images=[dataclasses.replace(image, grid=[1, 2])])
    assert gridded.problem(100, images="grid") is None
    assert dataclasses.replace(request, images=[]).problem(100, images="") is None
