"""benchmarks/gpu_check.py, the device check of issue #34, in its CPU dry run: the script a lent GPU runs must
not be first run there. Its six parts run with tiny shapes on CPU, as a user runs it, and the JSON report
must hold every row, each part's rows naming the attention backend they ran on."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"llama3_gqa", "mixtral"}  # the dry run's (gpu_check.DRY_FAMILIES)


def test_dry_run_writes_every_row(dry_run):
    done, report = dry_run("benchmarks/gpu_check.py")
    assert report["dry_run"] is True
    rows = report["rows"]
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    by_part: dict[str, list[dict]] = {}
    for row in rows:
        by_part.setdefault(row["part"].split()[0], []).append(row)
    families, lora = by_part["1"][:-1], by_part["1"][-1]
    assert {r["name"] for r in families} == FAMILIES
    assert {r["name"] for r in by_part["2"]} == FAMILIES
    assert all(r["mismatched"] == [] and r["min_margin"] > 0 for r in families)
    # the Llama again with three of its sequences on two LoRA adapters, against PEFT
    assert lora["name"] == "llama3_gqa lora" and lora["mismatched"] == [] and len(lora["adapters"]) == 3
    assert all(r["llmbus_error"] <= 1.25 * r["transformers_bf16_error"] for r in by_part["2"])
    served, idle, against = by_part["3"]
    assert served["restarts"] == 0
    assert all(stage["answered"] == stage["requests"] for stage in served["stages"].values())
    assert set(served["stages"]) == {"streams", "long_prompt", "burst", "throughput", "sustained"}
    assert served["stages"]["sustained"]["answered"] >= 4
    assert idle["name"] == "c=4 device idle" and idle["idle_share"] is None  # rank 0 logs it on CUDA only
    # The throughput wave again through transformers' continuous batching, every token generated.
    assert against["name"] == "c=4 vs transformers" and against["transformers_generated"] == 4 * 8
    assert against["ratio"] > 0
    speed = by_part["4"]
    assert speed[0]["name"] == "copy bandwidth" and speed[0]["bytes_per_s"] > 0
    decode = [r for r in speed[1:] if "lora_rows" not in r and "chunk" not in r]
    # each shape one step at a time, and chained as the worker runs steps sent ahead (fed on the device)
    assert sorted((r["batch"], r["context"], r["pipelined"]) for r in decode) == sorted(
        (b, c, p) for b in (1, 4) for c in (16, 48) for p in (False, True))
    assert all(r["step_ms"] > 0 for r in decode)
    # then a step with a prompt chunk beside the largest batch's decodes (eager on CPU: no piecewise graphs)
    (chunk,) = [r for r in speed[1:] if "chunk" in r]
    assert chunk["name"] == "b4 ctx16 + 32-token chunk" and chunk["step_ms"] > 0 and not chunk["piecewise"]
    # then steps with a LoRA adapter on every row and on half of them, beside the base model's step
    lora_steps = [r for r in speed[1:] if "lora_rows" in r]
    assert [(r["batch"], r["lora_rows"]) for r in lora_steps] == [(1, 1), (4, 4), (4, 2)]
    assert all(r["step_ms"] > 0 and r["base_step_ms"] > 0 for r in lora_steps)
    assert [r["name"] for r in by_part["5"]] == ["decode b1 ctx16", "decode b4 ctx16", "decode b4 ctx16 mixed sampling",
                                                 "decode b4 ctx16 with a prompt chunk"]
    # On CPU the default backend; whichever it is, every measured row names it.
    assert all(isinstance(r["backend"], str) and r["backend"] for r in by_part["1"] + by_part["2"] + decode)
    assert served["backend"] == served["info"].get("attention_backend", served["info"])
    # Part 6 on the host CPU: both servers measured, every stream decoding all its tokens (the ratio compares
    # equal work).
    (overlap,) = by_part["6"]
    assert overlap["name"] == "c=1 overlap on/off" and overlap["device"] == "cpu" and overlap["cpu_count"] > 0
    assert overlap["short_streams"] == [] and len(overlap["ratios"]) == len(overlap["rounds"]) == 1
    assert set(overlap["sides"]) == {"overlap", "lock-step"}
    for side in overlap["sides"].values():
        assert side["tok_s"] > 0 and side["output_tokens"] == overlap["tokens_a_side_and_round"] == 8
        assert side["cpu_ms_a_token"]
    assert overlap["median_ratio"] > 0 and overlap["backend"]
    # and the batch-1 step in-process at each thread count worth knowing, the default among them
    sweep = overlap["thread_sweep"]
    assert str(overlap["default_threads"]) in sweep["step_ms"] and "1" in sweep["step_ms"]
    assert all(ms > 0 for ms in sweep["step_ms"].values()) and "fused_decode" in sweep["compute_paths"]
    # The table is printed last.
    assert "part" in done.stdout and "report:" in done.stdout.splitlines()[-1]


def test_a_runner_whose_piecewise_graphs_fail_is_a_row_and_the_check_goes_on_without_them(monkeypatch, tmp_path):
    """A capture that fails on the device must not cost the lent run its other rows: the runner warms up
    again without piecewise graphs, a "piecewise" row carries the error, and later runners (and the served
    part's launch) are not asked for them."""
    import argparse
    import importlib

    from llmbus.testing.runner_driver import TINY_LLAMA
    from llmbus.workers.model_runner import ModelRunner

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    write_random_llama = importlib.import_module("_random_llama").write_random_llama
    asked = []
    warmup = ModelRunner.warmup

    def failing_warmup(runner):
        asked.append(runner.piecewise_sizes)
        if runner.piecewise_sizes:
            raise RuntimeError("operation not permitted when stream is capturing")
        return warmup(runner)

    monkeypatch.setattr(ModelRunner, "warmup", failing_warmup)
    rows = []
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.args = argparse.Namespace(attention_backend="auto", cuda_graphs="0", piecewise_graphs="16,32")
    check.device, check.report = gpu_check.torch.device("cpu"), None
    check.row = lambda part, name, ok, summary, **details: rows.append((part, name, ok, summary))
    # A tiny Llama written without transformers, and part 1's pool: ModelRunner's default, 512 MiB zeroed for
    # each of the three runners, took most of the test's time.
    model = write_random_llama(str(tmp_path / "m"), {**TINY_LLAMA, "vocab_size": 256, "tie_word_embeddings": True})
    first = check.runner(model, gpu_check.torch.float32, num_blocks=gpu_check.NUM_BLOCKS)
    second = check.runner(model, gpu_check.torch.float32, num_blocks=gpu_check.NUM_BLOCKS)
    assert first.piecewise is None and second.piecewise is None
    assert asked == [(16, 32), (), ()] and check.args.piecewise_graphs == "0"
    ((part, name, ok, summary),) = rows
    assert (part, name, ok) == ("piecewise", "warm-up", False) and "stream is capturing" in summary


def test_part_6_serves_at_the_fastest_thread_count_only_where_it_beats_the_default_clearly(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    fastest_env = importlib.import_module("gpu_check_cpu")._fastest_threads_env
    assert fastest_env({1: 30.0, 2: 20.0, 8: 5.0, 14: 31.0, 16: 31.0}, 14) == {"OMP_NUM_THREADS": "8"}
    assert fastest_env({1: 10.9, 2: 6.6}, 2) == {}  # the default is the fastest
    assert fastest_env({1: 10.9, 2: 6.6, 4: 6.0}, 2) == {}  # within 15% of it
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's count is kept
    assert fastest_env({1: 30.0, 8: 5.0, 14: 31.0}, 14) == {}
