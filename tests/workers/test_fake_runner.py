"""The fake runner (`--runner fake`) beside a real model folder."""

import json

from llmbus.workers.fake import FakeRunner


def test_the_fake_takes_the_served_models_vocabulary(tmp_path):
    """Served with a real tokenizer, the fake reports the model's vocabulary, so the frontend accepts every
    id that tokenizer gives (ids past 1000 were refused: `llmbus up --runner fake` answered English prompts
    with a validation error)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert FakeRunner(str(tmp_path)).vocab_size == 32000
    nested = tmp_path / "vision"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 4096}}))
    assert FakeRunner(str(nested)).vocab_size == 4096
    assert FakeRunner("none").vocab_size == 1000  # the bus tests' fake: its special ids stay inside
