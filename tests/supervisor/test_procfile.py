"""The committed Procfile runs the system under honcho, with no supervisor of ours."""

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from llmbus.testing import LineReader, free_port
from llmbus.testing.http import post

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def honcho(args: list[str], cwd: Path, env: dict):
    """`honcho start` in ``cwd``; yields its output; SIGTERM (then SIGKILL) on the way out."""
    proc = subprocess.Popen(["honcho", "start", "--no-colour", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines = LineReader(proc.stdout)
    try:
        yield lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        lines.join()


@pytest.mark.skipif(shutil.which("honcho") is None, reason="honcho is not installed")
def test_honcho_start_serves_generate(tiny_model_dir, tmp_path):
    port = free_port()
    env = dict(os.environ, MODEL_ID=str(tiny_model_dir), LLMBUS_RUN_DIR=str(tmp_path / "run"),
               LLMBUS_PORT=str(port), DTYPE="float32", PYTHONUNBUFFERED="1")
    with honcho(["-f", str(ROOT / "Procfile")], ROOT, env) as out:
        out.wait_for("listening", timeout=180)
        status, _, body = post(f"http://127.0.0.1:{port}/generate",
                               {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}})
        assert status == 200 and body["details"]["generated_tokens"] >= 1, body


@pytest.mark.skipif(shutil.which("honcho") is None, reason="honcho is not installed")
def test_rendered_procfile_serves_generate(tiny_model_dir, tmp_path):
    port = free_port()
    out = tmp_path / "deploy"
    rendered = subprocess.run(["llmbus", "procfile", "--model-id", str(tiny_model_dir), "-o", str(out),
                               "--port", str(port), "--hostname", "127.0.0.1", "--dtype", "float32",
                               "--max-total-tokens", "128", "--run-dir", str(tmp_path / "run"), "--api-key", "k"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    with honcho([], out, dict(os.environ)) as lines:
        lines.wait_for("listening", timeout=180)
        url = f"http://127.0.0.1:{port}/generate"
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}}
        assert post(url, body)[0] == 401, "the key in .env reached the frontend"
        status, _, answer = post(url, body, headers={"Authorization": "Bearer k"})
        assert status == 200 and answer["details"]["generated_tokens"] >= 1, answer
