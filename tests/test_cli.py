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
    for flag in ("--model-id", "--gpus", "--num-shard", "--dtype", "--max-input-tokens", "--max-total-tokens",
                 "--max-concurrent-requests", "--port", "--hostname"):
        assert flag in result.output


def test_demo_model_command(tmp_path):
    result = CliRunner().invoke(main, ["demo-model", str(tmp_path / "d"), "--size", "tiny"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d" / "model.safetensors").is_file() and (tmp_path / "d" / "tokenizer.json").is_file()
