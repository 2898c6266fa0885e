"""The frontend tests' shared fixtures: the fake scheduler's model folders (plain, and with a chat
template) and a factory of frontends in front of a fake scheduler (``llmbus.testing.fake_scheduler``),
closed after each test."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from llmbus.testing.fake_scheduler import Frontend, build_model_dir

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model_dir():
    d = Path(tempfile.mkdtemp(prefix="llmbus-fe-model-"))
    build_model_dir(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_frontend(model_dir):
    made = []

    def make(directory: Path | None = None, **overrides) -> Frontend:
        fe = Frontend(directory or model_dir, **overrides)
        made.append(fe)
        return fe
    yield make
    for fe in made:
        fe.close()


@pytest.fixture(scope="module")
def chat_model_dir():
    d = Path(tempfile.mkdtemp(prefix="llmbus-fe-chat-"))
    build_model_dir(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_fe(make_frontend, chat_model_dir):
    """make_frontend, on the model folder with a chat template unless told otherwise."""
    return lambda directory=None, **overrides: make_frontend(directory or chat_model_dir, **overrides)
