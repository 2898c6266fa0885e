import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The demo model's `tiny` size, built once per test session (random weights, trained tokenizer)."""
    from llmbus.supervisor.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
