"""Logs of the whole stack with --json-output: every line llmbus up prints is a JSON object naming its
service, and each answered request gets a line with TGI's timing split."""

from __future__ import annotations

import json
import re

from llmbus.testing import Server
from llmbus.testing.http import post


def test_json_output_lines_all_parse_and_name_their_service(tiny_model_dir):
    server = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "128",
                     "--json-output"], env={"LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"})
    try:
        status, _, _ = post(f"{server.url}/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
        assert status == 200
        assert post(f"{server.url}/generate", {"inputs": "Hello", "parameters": {"top_p": 7}})[0] == 422
        server.stderr.wait_for('"event": "request"', 30)
    finally:
        assert server.stop() == 0
    lines = [line for line in server.stderr.lines if line.strip()]
    records = []
    for line in lines:
        record = json.loads(line)  # raises on any line that is not JSON
        assert isinstance(record, dict) and record.get("service"), line
        records.append(record)
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
