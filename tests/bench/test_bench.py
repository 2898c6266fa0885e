"""`llmbus bench` against a real llmbus serving the tiny model, run through its CLI as a user runs it,
and the statistics it reports checked by hand on made-up samples.

Lengths are fixed (ignore EOS), so every level must account for exactly requests x max_new_tokens
tokens, and the exact prompt lengths built through /tokenize must be the lengths the server measured.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from llmbus.bench.loadgen import BenchConfig, arrival_rng, arrival_times, run_bench
from llmbus.bench.stats import Sample, level_stats, percentile, summarize
from llmbus.supervisor.cli import main
from llmbus.testing import Server, free_port

MAX_TOTAL = 256
NEW = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A pool of 4096 tokens of the tiny model in float32, eight of the longest requests many times over: the CPU
    # default, 512 MiB, is zeroed at the start.
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", str(MAX_TOTAL),
                  "--kv-cache-memory", str(8 << 20)])
    yield srv
    assert srv.stop() == 0, srv.stderr.text[-3000:]


def bench(*args: str):
    return CliRunner().invoke(main, ["bench", "--no-progress", *args], catch_exceptions=False)


def max_in_flight(samples: list[dict]) -> int:
    """The most requests whose [start, start + e2e] intervals overlap. The report rounds start and e2e to a
    microsecond each, so a client's next request, sent a few microseconds after its last one ended, can seem to
    start before it: an end counts 2 us early."""
    edges = sorted([(s["start"], 1) for s in samples] + [(s["start"] + s["e2e"] - 2e-6, -1) for s in samples],
                   key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def check_summary(summary: dict) -> None:
    assert summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]


def check_level(level: dict, requests: int, events_per_token: bool = True) -> None:
    """``events_per_token``: TGI streams one event per token; an OpenAI completions chunk may carry
    several (text held back until it is valid UTF-8), so it has at most as many events."""
    stats = level["stats"]
    assert stats["requests"] == stats["ok"] == requests and stats["errors"] == 0
    assert stats["output_tokens"] == requests * NEW  # ignore EOS: every request runs to max_new_tokens
    assert stats["output_throughput"] == pytest.approx(stats["output_tokens"] / stats["duration_s"])
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        check_summary(stats[key])
    assert stats["itl_s"]["n"] == requests * (NEW - 1) if events_per_token else stats["itl_s"]["n"] > 0
    for s in level["samples"]:
        assert s["error"] is None and s["output_tokens"] == NEW
        assert len(s["token_times"]) == NEW if events_per_token else 0 < len(s["token_times"]) <= NEW
        assert 0 < s["ttft"] <= s["e2e"]
        assert s["token_times"] == sorted(s["token_times"]) and s["token_times"][-1] <= s["e2e"]


def test_closed_loop_tgi(server, tmp_path):
    out = tmp_path / "r.json"
    result = bench("--url", server.url, "--api", "tgi", "--concurrency", "1,4", "--requests", "6", "--warmup", "1",
                   "--prompt-tokens", "24", "--max-new-tokens", str(NEW), "-o", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["prompt_lengths"] == "exact"
    assert [lv["label"] for lv in data["levels"]] == ["c=1", "c=4"]
    for level, concurrency in zip(data["levels"], (1, 4)):
        check_level(level, 6)
        assert max_in_flight(level["samples"]) == concurrency
        # the server's own count (details.input_length) is the length the prompt was cut to
        assert {s["prompt_tokens"] for s in level["samples"]} == {24}
    assert (tmp_path / "r.png").read_bytes().startswith(PNG_MAGIC)
    assert "c=1" in result.stdout and "c=4" in result.stdout and "TTFT p50/p90/p99" in result.stdout


def test_closed_loop_openai(server, tmp_path, tiny_model_dir):
    out, png = tmp_path / "o.json", tmp_path / "plot.png"
    result = bench("--url", server.url + "/v1", "--api", "openai", "--concurrency", "1,4", "--requests", "6",
                   "--warmup", "0", "--prompt-tokens", "16:32", "--max-new-tokens", str(NEW), "-o", str(out),
                   "--plot", str(png))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["model"] == str(tiny_model_dir) and data["config"]["api"] == "openai"  # from /v1/models
    for level in data["levels"]:
        check_level(level, 6, events_per_token=False)
        assert all(16 <= s["prompt_tokens"] <= 32 for s in level["samples"])  # usage.prompt_tokens
    assert len({s["prompt_tokens"] for lv in data["levels"] for s in lv["samples"]}) > 1  # sampled lengths
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_open_loop_follows_the_seeded_poisson_schedule(server, tmp_path):
    out = tmp_path / "rate.json"
    result = bench("--url", server.url, "--request-rate", "40", "--requests", "8", "--warmup", "0", "--seed", "3",
                   "--prompt-tokens", "16", "--max-new-tokens", str(NEW), "-o", str(out), "--no-plot")
    assert result.exit_code == 0, result.output
    level, = json.loads(out.read_text())["levels"]
    assert level["label"] == "rate=40/s" and level["mode"] == "rate"
    check_level(level, 8)
    due = arrival_times(8, 40.0, arrival_rng(3, 0))
    starts = [s["start"] for s in sorted(level["samples"], key=lambda s: s["index"])]
    assert all(start >= d - 1e-3 for start, d in zip(starts, due)), (starts, due)  # never before its time
    assert not (tmp_path / "rate.png").exists()


def test_failed_requests_are_counted_not_fatal(server, tmp_path):
    """Prompts of 230..260 tokens against a 256-token limit: the server rejects exactly those with
    prompt + max_new_tokens > 256, and the run goes on and reports them."""
    out = tmp_path / "err.json"
    result = bench("--url", server.url, "--concurrency", "2", "--requests", "8", "--warmup", "0", "--seed", "1",
                   "--prompt-tokens", "230:260", "--max-new-tokens", str(NEW), "-o", str(out), "--no-plot")
    assert result.exit_code == 0, result.output
    level, = json.loads(out.read_text())["levels"]
    too_long = [s["prompt_tokens"] + NEW > MAX_TOTAL for s in level["samples"]]
    assert 0 < sum(too_long) < 8, "seed 1 must give both kinds"
    assert [s["error"] is not None for s in level["samples"]] == too_long
    assert level["stats"]["errors"] == sum(too_long) and level["stats"]["ok"] == 8 - sum(too_long)
    assert sum(level["stats"]["error_kinds"].values()) == sum(too_long)
    assert "x in-band error: Input validation error: `inputs` tokens + `max_new_tokens` must be <= 256" \
        in result.stdout


def test_every_request_failing_exits_1(server, tmp_path):
    result = bench("--url", server.url, "--concurrency", "1", "--requests", "2", "--warmup", "0",
                   "--prompt-tokens", "300", "--max-new-tokens", str(NEW), "-o", str(tmp_path / "x.json"),
                   "--no-plot")
    assert result.exit_code == 1
    assert "every request failed" in result.stderr
    assert json.loads((tmp_path / "x.json").read_text())["levels"][0]["stats"]["errors"] == 2


def test_time_bounds(server, tmp_path):
    """--timeout ends one request as an error; --max-duration ends the run: the level is marked cut,
    the request in flight counted as cancelled, later levels skipped. 240 tokens cannot stream in
    50 ms (an eager decode step alone takes over 1 ms)."""
    out = tmp_path / "t.json"
    result = bench("--url", server.url, "--concurrency", "1", "--requests", "2", "--warmup", "0",
                   "--prompt-tokens", "16", "--max-new-tokens", "240", "--timeout", "0.05", "-o", str(out),
                   "--no-plot")
    assert result.exit_code == 1  # both timed out
    level, = json.loads(out.read_text())["levels"]
    assert level["stats"]["error_kinds"] == {"timeout: not finished within 0.05 s": 2}

    t0 = time.monotonic()
    result = bench("--url", server.url, "--concurrency", "1,2", "--requests", "50", "--warmup", "0",
                   "--prompt-tokens", "16", "--max-new-tokens", "240", "--max-duration", "1", "-o", str(out),
                   "--no-plot")
    assert time.monotonic() - t0 < 10
    assert "reached --max-duration" in result.stderr
    level, = json.loads(out.read_text())["levels"]  # c=2 never started
    assert level["truncated"] and level["stats"]["requests"] < 50
    assert level["samples"][-1]["error"] == "cancelled: the run reached --max-duration"


def test_library_with_given_prompts(server):
    prompts = [f"prompt number {i} about the river" for i in range(5)]
    result = run_bench(BenchConfig(url=server.url, concurrency=[2], requests=3, warmup=2, prompts=prompts,
                                   max_new_tokens=(NEW, NEW)))
    assert result.prompt_lengths == "given" and result.config.public_dict()["prompts"] == "5 given"
    level, = result.levels
    assert level.stats["ok"] == 3 and level.stats["output_tokens"] == 3 * NEW


def test_unreachable_server_is_one_line_and_exit_1(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = bench("--url", url, "-o", str(tmp_path / "u.json"))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"Error: cannot reach {url}")
    assert not (tmp_path / "u.json").exists()


def test_missing_matplotlib_exits_2_before_sending(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    result = bench("--url", f"http://127.0.0.1:{free_port()}", "-o", str(tmp_path / "m.json"))
    assert result.exit_code == 2  # not 1: it stopped before trying the (unreachable) server
    assert "pip install 'llmbus[bench]'" in result.stderr


def test_bad_arguments_exit_2():
    assert bench("--concurrency", "0").exit_code == 2
    assert bench("--prompt-tokens", "64:32").exit_code == 2
    assert bench("--request-rate", "2", "--concurrency", "4").exit_code == 2
    assert bench("--url", "localhost:3000").exit_code == 2


# --- statistics on hand-made samples --------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summarize():
    s = summarize([3.0, 1.0, 2.0])
    assert s == {"n": 3, "mean": 2.0, "min": 1.0, "max": 3.0, "p50": 2.0, "p90": pytest.approx(2.8),
                 "p99": pytest.approx(2.98)}
    assert summarize([]) == {"n": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None,
                             "p99": None}


def test_level_stats_by_hand():
    a = Sample(0, start=0.0, prompt_tokens=10, max_new_tokens=3, output_tokens=3, token_times=[0.1, 0.2, 0.4],
               e2e=0.4)
    b = Sample(1, start=0.5, prompt_tokens=20, max_new_tokens=3, output_tokens=3, token_times=[0.3, 0.4, 0.5],
               e2e=0.5)
    failed = Sample(2, start=0.6, prompt_tokens=30, max_new_tokens=3, error="HTTP 500: boom", e2e=0.01)
    stats = level_stats([a, b, failed], duration=2.0)
    assert (stats["requests"], stats["ok"], stats["errors"]) == (3, 2, 1)
    assert stats["error_kinds"] == {"HTTP 500: boom": 1}
    assert stats["output_tokens"] == 6 and stats["prompt_tokens"] == 30  # the failed one's not counted
    assert stats["request_throughput"] == 1.0 and stats["output_throughput"] == 3.0
    assert stats["ttft_s"]["mean"] == pytest.approx(0.2) and stats["e2e_s"]["max"] == 0.5
    assert stats["itl_s"]["n"] == 4 and stats["itl_s"]["max"] == pytest.approx(0.2)
    assert stats["itl_s"]["min"] == pytest.approx(0.1)
    assert stats["tpot_s"]["mean"] == pytest.approx((0.15 + 0.1) / 2)
    assert level_stats([], 0.0)["output_throughput"] is None


def test_arrival_times_are_a_seeded_poisson_process():
    times = arrival_times(20_000, 50.0, random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(20_000, 50.0, random.Random(1))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: the std equals the mean
