"""`llmbus` argument validation: one clear line and exit code 2, before anything is spawned."""

import pytest
from click.testing import CliRunner

from llmbus.supervisor.cli import main


@pytest.mark.parametrize("args, message", [
    (["--num-shard", "0"], "Invalid argument: `num_shard` cannot be < 1"),
    (["--max-input-tokens", "300", "--max-total-tokens", "200"],
     "Invalid argument: `max_input_tokens`(300) must be < `max_total_tokens`(200)"),
    # Only without chunking, as in TGI: with it, a prompt longer than the budget is computed in chunks.
    (["--max-input-tokens", "100", "--max-total-tokens", "200", "--max-batch-prefill-tokens", "50",
      "--prefill-chunking", "false"],
     "Invalid argument: `max_batch_prefill_tokens` must be >= `max_input_tokens`. Given: 50 and 100"),
    (["--max-batch-prefill-tokens", "0"], "Invalid argument: `max_batch_prefill_tokens` must be > 0"),
    (["--waiting-served-ratio", "-1"], "Invalid argument: `waiting_served_ratio` must be >= 0. Given: -1.0"),
    (["--max-waiting-tokens", "-2"], "Invalid argument: `max_waiting_tokens` must be >= 0. Given: -2"),
    (["--prefix-caching", "maybe"], "is not a valid boolean"),
    (["--max-total-tokens", "100000"], "must be <= the model's `max_position_embeddings`(2048)"),
    (["--max-batch-size", "0"], "Invalid argument: `max_batch_size` must be > 0"),
    # each of these was taken, and broke the server later (every request failed, SIGKILL at once on a stop, ...)
    (["--step-timeout", "0"], "Invalid argument: `step_timeout` must be > 0. Given: 0.0"),
    (["--graceful-termination-timeout", "-5"],
     "Invalid argument: `graceful_termination_timeout` must be >= 0. Given: -5.0"),
    (["--num-blocks", "0"], "Invalid argument: `num_blocks` must be > 0"),
    (["--max-restarts", "-1"], "Invalid argument: `max_restarts` must be >= 0. Given: -1"),
    (["--watermark-delta", "nan"], "Invalid argument: `watermark_delta` must be a finite number. Given: nan"),
    # named as given (they were refused as a `max_input_tokens` nobody set)
    (["--max-batch-total-tokens", "0"], "Invalid argument: `max_batch_total_tokens` must be > 0"),
    (["--max-total-tokens", "1"], "Invalid argument: `max_total_tokens` must be > 1"),
])
def test_invalid_arguments_exit_2(tiny_model_dir, args, message):
    result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_env_vars_are_read_for_scheduler_flags(tiny_model_dir):
    result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), "--max-input-tokens", "100",
                                       "--max-total-tokens", "200", "--max-batch-prefill-tokens", "50"],
                                env={"PREFILL_CHUNKING": "false"})
    assert result.exit_code == 2 and "must be >= `max_input_tokens`" in result.output


def test_env_vars_are_read(tiny_model_dir):
    result = CliRunner().invoke(main, ["up"], env={"MODEL_ID": str(tiny_model_dir), "NUM_SHARD": "0"})
    assert result.exit_code == 2 and "`num_shard` cannot be < 1" in result.output


def test_missing_model_folder_is_a_clear_error():
    result = CliRunner().invoke(main, ["up", "--model-id", "./no/such/model"])
    assert result.exit_code == 1 and "does not exist" in result.output


def test_help_lists_flags():
    result = CliRunner().invoke(main, ["up", "--help"])
    for flag in ("--model-id", "--revision", "--gpus", "--num-shard", "--sharded", "--dtype", "--trust-remote-code",
                 "--max-input-tokens", "--max-input-length", "--max-total-tokens", "--max-batch-total-tokens",
                 "--max-batch-prefill-tokens", "--max-concurrent-requests", "--max-best-of", "--max-stop-sequences",
                 "--max-top-n-tokens", "--max-client-batch-size", "--validation-workers", "--port", "--hostname",
                 "--json-output", "--cors-allow-origin", "--api-key", "--huggingface-hub-cache",
                 "--cuda-memory-fraction", "--payload-limit", "--graceful-termination-timeout", "--env",
                 "--watermark-gamma", "--watermark-delta", "--otlp-endpoint", "--otlp-service-name",
                 "--num-frontends", "--health-check-timeout", "--rope-scaling", "--rope-factor",
                 "--disable-custom-kernels", "--master-port", "--usage-stats", "--ngrok"):
        assert flag in result.output


def test_demo_model_command(tmp_path):
    result = CliRunner().invoke(main, ["demo-model", str(tmp_path / "d"), "--size", "tiny"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "model.safetensors").is_file() and (tmp_path / "d" / "tokenizer.json").is_file()


@pytest.mark.parametrize("args, env, message", [
    (["--max-input-tokens", "10", "--max-input-length", "20"], {},
     "Invalid argument: Both `max_input_tokens` (10) and `max_input_length` (20) are set. Please define only "
     "`max_input_tokens` as `max_input_length is deprecated for naming consistency."),
    (["--sharded", "true", "--num-shard", "1"], {}, "Invalid argument: `sharded` is true but `num_shard` <= 1"),
    (["--sharded", "true"], {"CUDA_VISIBLE_DEVICES": "0"},
     "Invalid argument: `sharded` is true but only found 1 CUDA devices"),
    (["--validation-workers", "0"], {}, "Invalid argument: `validation_workers` must be > 0"),
    (["--max-total-tokens", "200", "--max-batch-total-tokens", "100"], {},
     "Invalid argument: `max_total_tokens` must be <= `max_batch_total_tokens`. Given: 200 and 100"),
    (["--max-concurrent-requests", "0"], {}, "Invalid argument: `max_concurrent_requests` must be > 0"),
    (["--payload-limit", "0"], {}, "Invalid argument: `payload_limit` must be > 0"),
    (["--watermark-gamma", "1.5"], {}, "Invalid argument: `watermark_gamma` must be > 0 and < 1. Given: 1.5"),
    (["--cuda-memory-fraction", "0"], {}, "Invalid argument: `cuda_memory_fraction` must be in (0, 1]"),
    (["--port", "70000"], {}, "Invalid argument: `port` must be between 1 and 65535. Given: 70000"),
    ([], {"MAX_INPUT_LENGTH": "10", "MAX_INPUT_TOKENS": "20"}, "Both `max_input_tokens` (20)"),
    (["--num-frontends", "0"], {}, "Invalid argument: `num_frontends` must be > 0"),
    ([], {"HEALTH_CHECK_TIMEOUT": "0"}, "Invalid argument: `health_check_timeout` must be > 0. Given: 0.0"),
])
def test_tgi_launcher_rules(tiny_model_dir, args, env, message):
    result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), *args], env=env)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) <= 2, "one clear line (and click's usage hint at most)"


def test_otlp_endpoint_without_opentelemetry_is_refused(tiny_model_dir, monkeypatch):
    from llmbus.bus import tracing

    monkeypatch.setattr(tracing, "available", lambda: False)
    result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir)], env={"OTLP_ENDPOINT": "http://c:4317"})
    assert result.exit_code == 2
    assert "`otlp_endpoint` is set but tracing needs OpenTelemetry: pip install 'llmbus[tracing]'" in result.output


def test_procfile_renders_the_launch_plan(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_model_dir), "-o", str(tmp_path),
                                       "--port", "3999", "--api-key", "k3y", "--trust-remote-code",
                                       "--max-total-tokens", "128", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    procfile = (tmp_path / "Procfile").read_text()
    entries = dict(line.split(": ", 1) for line in procfile.splitlines() if not line.startswith("#"))
    assert set(entries) == {"scheduler", "workers", "frontend"}
    assert all(cmd.startswith("exec python -m llmbus.") for cmd in entries.values())
    assert "--port 3999" in entries["frontend"] and "--max-total-tokens 128" in entries["frontend"]
    assert "k3y" not in procfile, "the key stays out of the command lines"
    env = (tmp_path / ".env").read_text().splitlines()
    assert "API_KEY=k3y" in env
    assert "--trust-remote-code" in entries["workers"], "a setting of the workers, on their command line"
    two = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_model_dir), "-o", str(tmp_path / "two"),
                                    "--num-frontends", "2", "--otlp-endpoint", "http://collector:4317"])
    entries = dict(line.split(": ", 1) for line in (tmp_path / "two" / "Procfile").read_text().splitlines()
                   if not line.startswith("#"))
    assert set(entries) == {"scheduler", "workers", "frontend0", "frontend1"}, two.output
    assert all("--reuse-port" in entries[f] and "--otlp-endpoint http://collector:4317" in entries[f]
               for f in ("frontend0", "frontend1"))
    assert "--frontend-id f0" in entries["frontend0"] and "--frontend-id f1" in entries["frontend1"]
    assert all("--frontends-sharing 2" in entries[f] for f in ("frontend0", "frontend1"))  # of the 429 limit
    assert "--otlp-endpoint http://collector:4317" in entries["scheduler"]
    bad = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_model_dir), "--num-shard", "0"])
    assert bad.exit_code == 2 and "`num_shard` cannot be < 1" in bad.output
    # --env has no variable, as in TGI's launcher: a container's ENV=production is not the flag (the launch
    # gets as far as its own checks)
    container = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), "--num-shard", "0"],
                                   env={"ENV": "production"})
    assert container.exit_code == 2 and "`num_shard` cannot be < 1" in container.output, container.output


def test_procfile_entries_take_relative_paths_whole(tiny_model_dir, tmp_path, monkeypatch):
    """A Procfile's services start wherever honcho runs: a path given relative to the launch reaches them whole."""
    given = tmp_path / "given"
    given.mkdir()
    (given / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    (given / "generation_config.json").write_text('{"temperature": 0.5}')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_model_dir), "-o", str(tmp_path / "out"),
                                       "--tokenizer-config-path", "given/tokenizer_config.json",
                                       "--generation-config", "given"])
    assert result.exit_code == 0, result.output
    frontend = (tmp_path / "out" / "Procfile").read_text().split("frontend: ", 1)[1]
    assert f"--tokenizer-config-path {given / 'tokenizer_config.json'}" in frontend, frontend
    assert f"--generation-config {given}" in frontend, frontend


def test_env_flag_prints_the_runtime(tiny_model_dir):
    from llmbus.supervisor.cli import runtime_env

    text = runtime_env()
    assert "torch:" in text and "transformers:" in text and "Python:" in text


def test_tgi_launch_flags_run_unchanged(tiny_model_dir, tmp_path, monkeypatch):
    """A TGI launch command's flags: --rope-scaling/--rope-factor reach the workers and stretch the longest
    request; --tokenizer-config-path reaches the frontends; the flags that have nothing to do here are
    accepted and named with why; ngrok, a weights folder apart from the model and a tokenizer config that
    cannot be read are refused with one line."""
    model = ["--model-id", str(tiny_model_dir)]
    too_long = CliRunner().invoke(main, ["procfile", *model, "-o", str(tmp_path / "a"), "--max-total-tokens", "4096"])
    assert too_long.exit_code == 2 and "`max_position_embeddings`(2048)" in too_long.output
    tgi = ["--rope-scaling", "linear", "--rope-factor", "2", "--max-total-tokens", "4096", "--disable-custom-kernels",
           "--master-addr", "10.0.0.1", "--master-port", "29501", "--shard-uds-path", "/tmp/tgi", "--prometheus-port",
           "9001", "--usage-stats", "off"]
    result = CliRunner().invoke(main, ["procfile", *model, "-o", str(tmp_path / "b"), *tgi])
    assert result.exit_code == 0, result.output
    entries = dict(line.split(": ", 1) for line in (tmp_path / "b" / "Procfile").read_text().splitlines()
                   if not line.startswith("#"))
    assert "--rope-scaling linear --rope-factor 2.0" in entries["workers"]
    assert "--max-total-tokens 4096" in entries["frontend"]
    for flag in ("disable-custom-kernels", "master-addr", "master-port", "shard-uds-path", "prometheus-port",
                 "usage-stats"):
        assert f"llmbus: --{flag} has no effect: " in result.output, flag
    quiet = CliRunner().invoke(main, ["procfile", *model, "-o", str(tmp_path / "c")])
    assert quiet.exit_code == 0 and "has no effect" not in quiet.output
    scaled = CliRunner().invoke(main, ["procfile", *model, "-o", str(tmp_path / "d"), "--max-total-tokens", "8192"],
                                env={"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "2"})
    assert scaled.exit_code == 2 and "`max_position_embeddings`(4096) under `rope_factor` 2.0" in scaled.output
    (tmp_path / "tc.json").write_text('{"chat_template": "{{ messages }}"}')
    monkeypatch.chdir(tmp_path)  # a relative path reaches the frontend whole: honcho may start it elsewhere
    given = CliRunner().invoke(main, ["procfile", *model, "-o", "e", "--tokenizer-config-path", "tc.json"])
    assert given.exit_code == 0, given.output
    assert f"--tokenizer-config-path {tmp_path / 'tc.json'}" in (tmp_path / "e" / "Procfile").read_text()
    for args, message in ((["--tokenizer-config-path", str(tmp_path / "none.json")],
                           "`tokenizer_config_path` must name a readable tokenizer_config.json"),
                          (["--ngrok"], "`ngrok` tunneling is not supported"),
                          (["--weights-cache-override", "/data"], "`weights_cache_override` is not supported"),
                          (["--rope-factor", "0"], "`rope_factor` must be in (0, 10000]")):
        refused = CliRunner().invoke(main, ["up", *model, *args])
        assert refused.exit_code == 2 and f"Invalid argument: {message}" in refused.output, refused.output


def test_a_port_in_use_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    """Found before the model loads (it was found after, as a traceback printed twice); several frontends
    share their port among themselves, never with another server's SO_REUSEPORT listener."""
    import socket

    from llmbus.testing import free_port

    port = free_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        for frontends in ("1", "2"):
            run_dir = tmp_path / f"run{frontends}"
            result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), "--hostname", "127.0.0.1",
                                               "--port", str(port), "--num-frontends", frontends,
                                               "--run-dir", str(run_dir)])
            assert result.exit_code == 1, result.output
            assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.output, result.output
            assert not run_dir.exists()


def test_bad_files_and_paths_are_one_line_errors(tiny_model_dir, tmp_path):
    """Each of these was a traceback: a config.json cut short or not an object, a run dir too long for its
    sockets, an output folder that cannot be written (bench found it after running)."""
    import shutil

    cut, listed, untokenized = tmp_path / "cut", tmp_path / "listed", tmp_path / "untokenized"
    for folder, text in ((cut, '{"model_type": "llama",\n'), (listed, "[1, 2]")):
        shutil.copytree(tiny_model_dir, folder)
        (folder / "config.json").write_text(text)
    shutil.copytree(tiny_model_dir, untokenized)
    (untokenized / "tokenizer.json").unlink()
    cases = [
        (["up", "--model-id", str(untokenized)], f"{untokenized} has no tokenizer.json"),
        (["up", "--model-id", str(cut)], f"cannot read {cut / 'config.json'}: Expecting"),
        (["up", "--model-id", str(listed)], f"{listed / 'config.json'} is not a JSON object"),
        (["up", "--model-id", str(tiny_model_dir), "--run-dir", "/tmp/" + "r" * 100],
         "is too long for its sockets"),
        (["up", "--model-id", str(tiny_model_dir), "--rope-scaling", "linear", "--rope-factor", "inf"],
         "`rope_factor` must be in (0, 10000]. Given: inf"),
        (["demo-model", "/proc/demo"], "cannot write the demo model to /proc/demo"),
        (["procfile", "--model-id", str(tiny_model_dir), "-o", "/proc/pf"], "cannot write the Procfile to /proc/pf"),
        (["bench", "--url", "http://127.0.0.1:1", "-o", str(tmp_path / "no" / "out.json")],
         "is not a folder this user can write to"),
    ]
    for argv, message in cases:
        result = CliRunner().invoke(main, argv)
        assert result.exit_code in (1, 2) and not isinstance(result.exception, (OSError, ValueError)), argv
        assert message in result.output, (argv, result.output)


def test_a_published_quantization_is_checked_before_anything_starts(tiny_model_dir, tmp_path):
    """A GPTQ/AWQ checkpoint is read as its config says: --quantize may name it (TGI's commands do), not
    contradict it; a quantization llmbus does not read is one line naming it."""
    import json
    import shutil

    def published_as(name: str, section: dict):
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
        return str(folder)

    gptq = published_as("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128})
    bnb = published_as("bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    cases = [
        (["--model-id", gptq, "--quantize", "int4"], 2,
         "--quantize int4 quantizes float weights, and this checkpoint is already quantized with gptq"),
        (["--model-id", gptq, "--quantize", "awq"], 2, "--quantize awq was given, but the checkpoint is quantized "
                                                       "with gptq"),
        (["--model-id", str(tiny_model_dir), "--quantize", "gptq"], 2, "this one has float weights"),
        (["--model-id", bnb], 1, "says quant_method 'bitsandbytes': llmbus reads GPTQ, AWQ, FP8 and MXFP4 "
                                 "checkpoints"),
    ]
    for argv, code, message in cases:
        result = CliRunner().invoke(main, ["up", *argv])
        assert result.exit_code == code and message in result.output, (argv, result.output)


def test_quantize_at_load_on_a_gpu_is_one_line(tiny_model_dir, monkeypatch):
    """--quantize int8/int4 has CPU kernels only: on a GPU the ranks failed with a traceback each."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("auto", "cuda"):
        result = CliRunner().invoke(main, ["up", "--model-id", str(tiny_model_dir), "--quantize", "int4",
                                           "--device", device])
        assert result.exit_code == 2 and "`quantize` int4 runs on CPU only" in result.output, result.output
