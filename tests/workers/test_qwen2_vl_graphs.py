"""Qwen2-VL's decode steps through the decode graphs' buffers (``workers/cuda_graphs.py``, uncaptured, the
Triton backend's kernels run by Triton's interpreter as tests/workers/test_decode_graphs.py runs them): a decode
row past its images replays them with its rotation's shift (M-RoPE, ``mrope.py``) staged beside its position."""

import pytest

from llmbus.testing import qwen2_vl
from llmbus.testing import llava
from llmbus.testing.llava import encoded_image
from llmbus.testing.runner_driver import BLOCK_SIZE, MIN_MARGIN, NUM_BLOCKS, Request, drive
from llmbus.testing.triton_interpret import interpreted_triton_kernels

interpreted_triton_kernels()
pytestmark = [pytest.mark.usefixtures("interpreted_triton"), pytest.mark.timeout(300)]


def test_decode_rows_past_their_images_replay_the_graphs(tiny_qwen2_vl_dir):
    """Decode graphs (uncaptured, the Triton backend's kernels interpreted, as tests/workers/test_decode_graphs.py
    runs them): a decode row past its images replays them with its rotation's shift staged beside its position,
    and its tokens stay transformers'; the prompt steps, whose rows are images' or come before them, run eagerly."""
    from llmbus.workers.cuda_graphs import DecodeGraphs
    from llmbus.workers.model_runner import ModelRunner

    path = tiny_qwen2_vl_dir
    prompts = [qwen2_vl.image_prompt(path, [[5, 6, 7], [8, 9]], [encoded_image(2, (30, 90))]),
               qwen2_vl.image_prompt(path, [[10, 11], [12], [13, 14]],
                                     [encoded_image(3, (200, 40)), encoded_image(1, (64, 48))])]
    expected = llava.generate_reference(path, prompts, 6, MIN_MARGIN)
    runner = ModelRunner(str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend="triton",
                         max_batch_prefill_tokens=256)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, (1, 2), 64, capture=False)
    assert runner.graphs.shift_field == 3
    replayed = []
    forward = runner.graphs.forward
    runner.graphs.forward = lambda seqs, feed=None: replayed.append([s.rid for s in seqs]) or forward(seqs, feed)
    requests = [Request(rid=f"r{i}", prompt=p.ids, images=llava.bus_images(p), max_new_tokens=6, prefill_chunk=chunk)
                for i, (p, chunk) in enumerate(zip(prompts, (None, 9)))]
    results = drive(runner, requests)
    assert [results[f"r{i}"].tokens for i in range(2)] == [tokens for tokens, _ in expected]
    assert ["r0", "r1"] in replayed, replayed
