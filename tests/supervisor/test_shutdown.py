"""One launch of the whole stack (`llmbus up` on the tiny model) with --json-output, first serving, then
stopped. Its logs: every line it prints is a JSON object naming its service, and each answered request gets a
line with TGI's timing split. Its graceful shutdown: SIGTERM while a stream runs lets the stream finish, answers
new requests 503, and exits 0 with no rank reported lost, no process left, the run dir removed, and every line
of the way out JSON too."""

from __future__ import annotations

import http.client
import json
import re
import signal

import pytest

from llmbus.bus.procfs import command_line, descendants, process_alive
from llmbus.testing import Server
from llmbus.testing.http import post

# Long enough to still be running when the signal lands right after the first token (about 2 s on a quiet
# 2-core machine), short enough to finish well inside the drain timeout on a loaded one.
MAX_NEW = 400
DRAIN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def launch(tiny_model_dir, tmp_path_factory):
    """The module's launch; the SIGTERM test ends it, so the log test comes first."""
    run_dir = tmp_path_factory.mktemp("json-launch") / "run"
    server = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "2048",
                     "--graceful-termination-timeout", str(DRAIN_TIMEOUT_S), "--run-dir", str(run_dir),
                     "--json-output"], env={"LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"})
    server.run_dir = run_dir
    yield server
    assert server.stop() == 0, server.stderr.text[-3000:]


def _records(server: Server) -> list[dict]:
    records = []
    for line in server.stderr.lines:
        if line.strip():
            record = json.loads(line)  # raises on any line that is not JSON
            assert isinstance(record, dict) and record.get("service"), line
            records.append(record)
    return records


def test_json_output_lines_all_parse_and_name_their_service(launch):
    assert launch.proc.poll() is None, "the launch must still be serving: the SIGTERM test ends it, and runs later"
    status, _, _ = post(f"{launch.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    assert status == 200
    assert post(f"{launch.url}/generate", {"inputs": "Hello", "parameters": {"top_p": 7}})[0] == 422
    launch.stderr.wait_for('"event": "request"', 30)
    records = _records(launch)  # the lines so far; the SIGTERM test checks those of the way out
    services = {r["service"] for r in records}
    assert {"launcher", "scheduler", "frontend"} <= services and any(s.startswith("worker") for s in services)
    assert all("rank" in r for r in records if r["service"] == "worker"), "worker lines carry their rank"
    loaded = next(r for r in records if r.get("event") == "model loaded")
    assert loaded["threads"] == 1, loaded  # OMP_NUM_THREADS, as any OpenMP program reads it
    assert re.fullmatch(r"\d+ CPUs, \d+ cores.*", loaded["cpu"]), loaded  # what the default would be from
    assert loaded["frozen_objects"] > 10_000, loaded  # torch's and the model's: out of the collector's sight
    request = next(r for r in records if r.get("event") == "request")
    for key in ("total_time", "validation_time", "queue_time", "inference_time", "time_per_token"):
        assert request[key] >= 0, key
    assert request["generated_tokens"] >= 1 and request["input_length"] >= 1


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_requests(launch):
    server, run_dir = launch, launch.run_dir
    try:
        procs = descendants(server.proc.pid)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/generate_stream", body=json.dumps({"inputs": "Hello", "parameters": {
            "max_new_tokens": MAX_NEW, "ignore_eos_token": True, "details": True}}),
            headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        first = stream.readline()
        assert first.startswith(b"data: ") and b'"index":1,' in first

        server.proc.send_signal(signal.SIGTERM)
        server.stderr.wait_for("draining requests in flight", 60)
        status, _, body = post(f"{server.url}/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert (status, body) == (503, {"error": "The server is shutting down", "error_type": "shutting_down"})

        events = [json.loads(first[len(b"data: "):])]
        for line in iter(stream.readline, b""):
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
        conn.close()
        assert "error" not in events[-1], events[-1]
        assert [e["index"] for e in events] == list(range(1, MAX_NEW + 1))
        assert events[-1]["details"]["finish_reason"] == "length"
        assert events[-1]["details"]["generated_tokens"] == MAX_NEW
        assert server.proc.wait(DRAIN_TIMEOUT_S) == 0, server.stderr.text[-3000:]
        server.stderr.join()
        # The ranks are stopped with the scheduler: their leaving is no loss to recover from (it asked for a
        # restart that never came, or logged a stranger leaving, depending on who won the race).
        assert not server.log_lines("worker ranks lost", "not a worker rank left"), server.stderr.text[-3000:]
        _records(server)  # --json-output holds on the way out too
    finally:
        server.stop()
    leftovers = [p for p in procs if process_alive(p)]
    assert leftovers == [], [command_line(p) for p in leftovers]
    assert not run_dir.exists()


# A process on its way out ignores SIGTERM (bus/service.ignore_stop_signals), so an exit that hangs must not
# outlive the process that started it: nobody would be left to follow up with SIGKILL.
_EXITING_CHILD = """
import threading
from llmbus.bus.service import die_with_parent, ignore_stop_signals
die_with_parent()
ignore_stop_signals()
print("exiting", flush=True)
threading.Event().wait()  # an exit that hangs
"""
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
assert child.stdout.readline() == b"exiting\\n"
print(child.pid, flush=True)
"""


def test_a_hung_exit_dies_with_its_parent():
    import os
    import select
    import subprocess
    import sys

    parent = subprocess.run([sys.executable, "-c", _PARENT, _EXITING_CHILD], capture_output=True, timeout=60)
    assert parent.returncode == 0, parent.stderr.decode()[-2000:]
    child = int(parent.stdout)
    try:
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        gone = poller.poll(10_000)  # readable once the process has exited
    finally:
        os.close(pidfd)
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone, "the child kept running after its parent died"
