"""Tokens fed on the device (issue #39, workers/launched_step.py): a step sent ahead takes each running
request's last token (``SAMPLED_LAST``) from the sampled ids of the step launched before it, which the host
has not read. Driven by hand on the CPU (the same tensors a GPU step keeps on the device): a continuous batch
with arrivals, a chunked prompt, a prefix hit and a preemption stays token-exact with transformers, and seeded
sampling over the warpers' grid draws the same tokens as when the host feeds them. A broken feed (a wrong
row, a wrong source) changes the tokens."""

from __future__ import annotations

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.families import family_requests
from llmbus.testing.runner_driver import (BLOCK_SIZE, NUM_BLOCKS, Request, drive, make_prompts,
                                          reference, save_tiny_llama)
from llmbus.workers.launched_step import LaunchedStep, StepOutput, fed_ids_and
from llmbus.workers.model_runner import ModelRunner

VOCAB = 256


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fed_llama")
    save_tiny_llama(str(path), tied=False, vocab_size=VOCAB)
    return str(path)


def _counting_runner(model_dir: str) -> tuple[ModelRunner, list[int]]:
    """A runner whose launches record how many rows each took from the step before on the device."""
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    fed: list[int] = []
    launch = runner.launch
    runner.launch = lambda seqs, feed=None: fed.append(len(feed.rows) if feed else 0) or launch(seqs, feed)
    return runner, fed


def test_a_continuous_batch_fed_on_the_device_is_token_exact(llama_dir):
    prompts = make_prompts(VOCAB)
    expected = reference(llama_dir, prompts)
    runner, fed = _counting_runner(llama_dir)
    results = drive(runner, family_requests(prompts), feed_on_device=True)
    for i in range(len(prompts)):
        assert results[f"r{i}"].tokens == expected.tokens[i], f"r{i}"
        torch.testing.assert_close(torch.tensor(results[f"r{i}"].logprobs), expected.greedy_logprobs(i),
                                   atol=1e-4, rtol=0)
    assert results["hit"].tokens == expected.tokens[4]
    assert results["r1"].preemptions == 1
    # every decode after a request's first token is fed so: most rows of most steps
    assert sum(fed) > 3 * len(prompts) and max(fed) >= 3, fed


GRID = [SamplingParams(do_sample=True, temperature=0.7, seed=11),
        SamplingParams(do_sample=True, temperature=1.3, top_k=20, seed=12),
        SamplingParams(do_sample=True, top_p=0.8, seed=13),
        SamplingParams(do_sample=True, typical_p=0.9, temperature=0.9, seed=14),
        SamplingParams(do_sample=True, min_p=0.05, seed=15),
        SamplingParams(top_n_tokens=3),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4),  # counted on the device
        SamplingParams(do_sample=True, seed=16, presence_penalty=0.8, frequency_penalty=0.3,
                       frequency_per_count=True)]


def test_seeded_sampling_fed_on_the_device_draws_what_the_host_fed_draws(llama_dir):
    """Each parameter set on each prompt, beside the others in one batch: the same tokens and logprobs with
    the tokens fed on the device as with the host feeding them (penalties included: their token counts
    are kept on the device, the fed token counted there)."""
    prompts = make_prompts(VOCAB)

    def requests() -> list[Request]:
        return [Request(rid=f"p{i}-{j}", prompt=prompt, sampling=params, arrival_step=j % 3)
                for i, prompt in enumerate(prompts[:3]) for j, params in enumerate(GRID)]

    runner, fed = _counting_runner(llama_dir)
    on_device = drive(runner, requests(), feed_on_device=True)
    on_host = drive(ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), requests())
    for rid, req in on_host.items():
        assert on_device[rid].tokens == req.tokens, rid
        assert on_device[rid].logprobs == pytest.approx(req.logprobs, abs=1e-5), rid
    assert sum(fed) > len(GRID) * 3


def test_a_step_offers_its_tokens_only_for_the_requests_it_sampled():
    ids = torch.tensor([7, 9])
    launched = LaunchedStep(lambda: None, None, ids, ["a", "b"])
    assert launched.can_feed(["b", "a"]) and not launched.can_feed(["a", "c"])
    feed = launched.feed([2, 0], ["a", "b"])
    row = torch.tensor([-2, 5, -2])
    feed.write(row)
    assert row.tolist() == [9, 5, 7]
    # nothing to offer: a step finished on the host, or one that speculated (no ids kept)
    assert not LaunchedStep.finished(StepOutput(["a"], [7], [0.0], 0.0, 0.0)).can_feed(["a"])
    assert not LaunchedStep(lambda: None, None, None, ["a"]).can_feed(["a"])


def test_a_steps_tokens_logprobs_and_top_tokens_come_back_in_one_copy():
    """What a GPU step copies to the host (launched_step.pack, one float64 vector) reads back (unpack) as the
    CPU path's lists: ids, logprobs, and each asking row's top tokens with masked ones left out."""
    from llmbus.workers.launched_step import pack, unpack
    from llmbus.workers.sampling import sample

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_n_tokens=3), SamplingParams(),
              SamplingParams(do_sample=True, top_k=2, top_n_tokens=5, seed=1), SamplingParams(top_n_tokens=1)]
    out = sample(logits, params, [7] * 4)
    expected = (out.token_ids.tolist(), out.logprobs.tolist(), out.top_tokens)
    assert expected[2][1] == [] and len(expected[2][2][0]) == 2  # top_k=2 masks the rest
    assert unpack(pack(out.token_ids, out.logprobs, out.top).tolist(), 4, out.top) == expected
    greedy = sample(logits, [SamplingParams()] * 4, [7] * 4)
    assert greedy.top is None
    assert unpack(pack(greedy.token_ids, greedy.logprobs, None).tolist(), 4, None) == (
        greedy.token_ids.tolist(), greedy.logprobs.tolist(), [])
    # a replayed graph packs all of its 4 rows (the third of cuda_graphs.DecodeGraphs.greedy); a step of 3 reads its own
    assert unpack(pack(greedy.token_ids, greedy.logprobs, None).tolist(), 3, None, logprobs_at=4) == (
        greedy.token_ids[:3].tolist(), greedy.logprobs[:3].tolist(), [])


@pytest.mark.parametrize("source_rows", [3, 9], ids=["fits", "longer than the buffer"])
def test_a_feed_gathers_its_ids_where_a_graph_reads_them(source_rows):
    """``DeviceFeed.gather_into``: a CUDA graph reads fed ids at a fixed address. Each row's index into the
    buffer picks the id the step before sampled for it, whether the source is copied whole or, longer than
    the buffer, gathered down to the picks first."""
    sampled = torch.arange(100, 100 + source_rows)
    step = LaunchedStep(lambda: None, sampled_ids=sampled, rids=[f"r{i}" for i in range(source_rows)])
    feed = step.feed([0, 1, 2], ["r2", "r0", "r1"])
    buffer = torch.full((4,), -1, dtype=torch.long)
    picks = feed.gather_into(buffer)
    assert [int(buffer[p]) for p in picks] == [102, 100, 101]


def test_a_steps_ids_their_feed_and_its_logits_rows_go_over_in_one_copy():
    """On a GPU each copy from the host is a tensor made, a pinned staging and a launch: an eager step sends
    its ids, the feed's rows and picks and its logits rows together."""
    launched = LaunchedStep(lambda: None, None, torch.tensor([7, 9]), ["a", "b"])
    feed = launched.feed([2, 0], ["a", "b"])
    ids, rows = fed_ids_and([[-2, 5], [-2]], feed, [1, 2], torch.device("cpu"))
    assert ids.tolist() == [9, 5, 7] and rows.tolist() == [1, 2]
    assert ids.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    ids, rows = fed_ids_and([[3, 4]], None, [], torch.device("cpu"))
    assert ids.tolist() == [3, 4] and rows.tolist() == []
