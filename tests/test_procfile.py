"""The committed Procfile runs the system under honcho, with no supervisor of ours."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from harness import LineReader, free_port
from httputil import post

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("honcho") is None, reason="honcho is not installed")
def test_honcho_start_serves_generate(tiny_model_dir, tmp_path):
    port = free_port()
    env = dict(os.environ, MODEL_ID=str(tiny_model_dir), LLMBUS_RUN_DIR=str(tmp_path / "run"),
               LLMBUS_PORT=str(port), DTYPE="float32", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(["honcho", "start", "-f", str(ROOT / "Procfile"), "-d", str(ROOT), "--no-colour"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out = LineReader(proc.stdout)
    try:
        out.wait_for("listening", timeout=180)
        status, _, body = post(f"http://127.0.0.1:{port}/generate",
                               {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}})
        assert status == 200 and body["details"]["generated_tokens"] >= 1, body
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.join()
