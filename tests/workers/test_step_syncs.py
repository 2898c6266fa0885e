"""A decode step reads nothing back from the device until its result (issue #39 part 1: one synchronisation,
the result copy), checked on the CPU by patching what would wait for a GPU: every read of a tensor's values
on the host (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``numpy``). The step runs the GPU's decode
path, the graph buffers (uncaptured, Triton interpreted) and torch's sampling ops (``sampling_kernels`` off,
as on a GPU), and is launched with its tokens fed from the step before on the device; between its launch and
its result the host must not have read anything, for greedy rows, penalised ones (TGI's and OpenAI's) and rows
asking top-n alternatives; nor in the eager step of their prompts before it. (A grammar's row waits for its
token on the host by design: the worker answers the step before first.) The other kind of wait, a copy to a GPU
from pageable memory, has no counterpart on the CPU: gpu_check's part 5 counts those with the profiler."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llmbus.bus.messages import SAMPLED_LAST, SamplingParams
from llmbus.testing.runner_driver import BLOCK_SIZE, NUM_BLOCKS, save_tiny_llama
from llmbus.testing.triton_interpret import interpreted_triton_kernels
from llmbus.workers import sampling
from llmbus.workers.cuda_graphs import DecodeGraphs
from llmbus.workers.model_runner import ModelRunner, SeqInput

triton_kernels = interpreted_triton_kernels()
VOCAB = 256
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync_llama")
    save_tiny_llama(str(path), tied=False, vocab_size=VOCAB)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton")
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, (4, 8), 32, capture=False)
        yield runner


@contextlib.contextmanager
def host_reads():
    """The tensor reads made inside, by method name."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            seen.append(name)
            return originals[name](self, *args, **kwargs)
        return read
    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


KINDS = [SamplingParams(), SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4),
         SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, frequency_per_count=True),
         SamplingParams(top_n_tokens=3)]


def test_a_decode_step_reads_nothing_back_before_its_result(runner, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sampling, "_kernels_for", lambda logits: None)  # torch's ops, as on a GPU
    rows = [SeqInput(f"r{i}", [5 + i] * 4, 0, [2 * i, 2 * i + 1], True, KINDS[i % len(KINDS)], prompt_len=4)
            for i in range(6)]
    with host_reads() as seen:
        first = runner.launch(rows)  # the prompts: a step that runs eagerly
    assert seen == [], f"the prompts' step read the device before its result: {seen}"
    first.result()
    decodes = [SeqInput(s.rid, [SAMPLED_LAST], 4, s.block_table, True, s.sampling, prompt_len=4) for s in rows]
    with host_reads() as seen:
        launched = runner.launch(decodes, first.feed(list(range(len(rows))), [s.rid for s in rows]))
    assert seen == [], f"the step read the device before its result: {seen}"
    out = launched.result()
    assert len(out.token_ids) == len(rows) and len(out.top_tokens[3][0]) == 3
