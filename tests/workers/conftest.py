"""Fixtures the graph tests share (test_decode_graphs.py, test_piecewise_graphs.py)."""

import pytest

from llmbus.testing.runner_driver import make_prompts, reference, save_tiny_llama

GRAPHS_VOCAB = 256


@pytest.fixture(scope="module")
def interpreted_triton():
    """Triton's kernels on the CPU, in its interpreter, for a whole module (a GPU's code path, checked here)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama of ``GRAPHS_VOCAB`` tokens, untied."""
    path = tmp_path_factory.mktemp("graphs_llama")
    save_tiny_llama(str(path), tied=False, vocab_size=GRAPHS_VOCAB)
    return str(path)


@pytest.fixture(scope="module")
def plain(llama_dir):
    """transformers' greedy tokens and logits of ``make_prompts`` on ``llama_dir``, computed once a module."""
    return reference(llama_dir, make_prompts(GRAPHS_VOCAB))
