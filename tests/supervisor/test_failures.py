"""Failure semantics of `llmbus up`: a dead worker takes the launch down loudly and cleanly."""

from __future__ import annotations

import os
import subprocess
import time

from llmbus.testing import Server, free_port
from llmbus.testing.http import get, post

# A rank killed with a request in flight (the launch stops within 10 s, names the rank, leaves no process and no
# run dir behind): test_scale_out.py, last on its two-rank launch.


def test_broken_checkpoint_fails_startup_with_the_workers_error(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = subprocess.run(["llmbus", "up", "--model-id", str(broken), "--port", str(free_port()),
                           "--max-total-tokens", "256"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # whichever dies first (the rank's group, or the scheduler it told) is reported with the root cause
    assert "exited with code" in proc.stderr and "stopping the other services" in proc.stderr
    assert "safetensors" in proc.stderr.lower() or "header" in proc.stderr.lower(), proc.stderr[-3000:]


# SIGTERM with a stream in flight (it finishes, the launch exits 0 and leaves no process and no run dir behind):
# test_shutdown.py, on the one launch that also checks the drain refuses new requests.


def _failed_launch(tiny_model_dir, *args, env: dict | None = None) -> str:
    proc = subprocess.run(["llmbus", "up", "--model-id", str(tiny_model_dir), "--port", str(free_port()),
                           "--dtype", "float32", *args], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc.stderr


def test_more_kv_than_fits_fails_at_startup(tiny_model_dir):
    # A pool bigger than this machine's memory is refused before it is allocated ...
    stderr = _failed_launch(tiny_model_dir, "--max-total-tokens", "256", "--kv-cache-memory", str(10 ** 15))
    assert "Not enough memory for the KV cache" in stderr and "--kv-cache-memory" in stderr, stderr[-3000:]
    # ... and a max_total_tokens the pool cannot hold fails with TGI's message, not at the first long request.
    stderr = _failed_launch(tiny_model_dir, "--max-total-tokens", "256", "--num-blocks", "4", "--block-size", "16")
    assert "Not enough memory to handle `max_total_tokens=256`" in stderr, stderr[-3000:]


def test_without_max_total_tokens_the_longest_request_is_what_the_kv_cache_holds(tiny_model_dir):
    """TGI's default: the model's length (2048 here) unless the KV cache holds less; the prompt's limit
    follows. (A long-context model on a CPU's default pool failed to start without the flag.)"""
    srv = Server(["--model-id", str(tiny_model_dir), "--num-blocks", "8", "--block-size", "16"])
    try:
        status, info = get(f"{srv.url}/info")
        assert (info["max_total_tokens"], info["max_input_tokens"]) == (128, 127), info
        status, _, body = post(f"{srv.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 200}})
        assert status == 422 and "128" in body["error"], body
        assert "max_total_tokens lowered to the KV capacity" in srv.stderr.text
    finally:
        srv.stop()


def test_a_frontend_that_fails_at_start_stops_the_launch_at_once(tiny_model_dir):
    """Vertex's AIP_PREDICT_ROUTE naming a route llmbus serves fails the frontend as it builds its routes,
    while the scheduler still waits for the ranks: the launch stops them all with the reason, and the
    scheduler takes the first SIGTERM (nothing runs yet to drain) instead of the launcher's SIGKILL 5 s on."""
    stderr = _failed_launch(tiny_model_dir, env={"AIP_PREDICT_ROUTE": "/generate"})
    assert "`aip_predict_route` names a route llmbus serves already. Given: /generate" in stderr, stderr[-3000:]
    assert "ignored SIGTERM" not in stderr and "Traceback" not in stderr, stderr[-3000:]  # the reason says all


def test_a_group_asked_back_in_the_round_it_exited_is_not_failed_later(monkeypatch):
    """A worker group's exit and the scheduler's request to restart it can arrive in one round of watching
    (rank 1 killed at two ranks): the group restarts, and the deadline for that request must not outlive it
    (it used to be set after the restart, and ten seconds later stopped a launch that was serving)."""
    import types

    from llmbus.supervisor import launcher as launcher_module

    workers = launcher_module.ProcessSpec("workers", ("x",), reports_ready=False, restart="on_request")
    frontend = launcher_module.ProcessSpec("frontend", ("x",))

    def child(spec, alive: bool):
        return types.SimpleNamespace(spec=spec, alive=lambda: alive, proc=types.SimpleNamespace(
            returncode=None if alive else -9))

    launch = launcher_module.Launcher([workers, frontend], run_dir=None, echo=lambda text: None)
    dead = child(workers, alive=False)
    launch.children = [dead, child(frontend, alive=True)]

    def exit_and_request():
        launch.restart_requests["workers"] = "worker rank 1 disconnected: its process died"
        return dead

    restarted = []
    monkeypatch.setattr(launch, "_watch_once", exit_and_request)
    monkeypatch.setattr(launch, "_restart", lambda c, why: (restarted.append(why), launch.children.__setitem__(
        launch.children.index(c), child(c.spec, alive=True))))
    assert launch._serve_once() is None and len(restarted) == 1
    assert launch.awaiting_request == {}
    monkeypatch.setattr(launch, "_watch_once", lambda: None)
    later = time.monotonic() + launcher_module.RESTART_REQUEST_WAIT_S + 1
    monkeypatch.setattr(launcher_module.time, "monotonic", lambda: later)
    assert launch._serve_once() is None, "a serving launch was stopped"


def test_a_model_the_ranks_refuse_stops_the_launch_in_one_line(tiny_model_dir, tmp_path):
    """What the ranks find as they load (an activation, a RoPE type or a tensor llmbus cannot serve, heads the
    ranks do not divide) says why without a traceback per rank burying it."""
    import json
    import shutil

    gelu = tmp_path / "gelu"
    shutil.copytree(tiny_model_dir, gelu)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "relu2"}))
    stderr = _failed_launch(gelu)
    assert f"cannot serve {gelu}: hidden_act 'relu2' is not supported" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
