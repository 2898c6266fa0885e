"""Sequences that do not start from an empty cache: prefix-cache hits and recomputation after preemption.

A prefix-cache hit starts a request with ``num_computed = k * block_size`` on a block table whose first
k blocks another request wrote (that request finished and dropped, or still running beside it), and
only the rest of its prompt to compute. A preempted request is dropped from the runner and comes back as
a new sequence recomputing its prompt and every token it had generated, sampling after the last of
them. Both must give exactly the tokens of an uninterrupted run from scratch: greedy ones (checked
against transformers), seeded samples (the draw is a function of seed and position only) and penalised
ones (the token history must hold the cached prefix). Same tiny float32 Llama and hand-driven scheduler
as ``test_model_runner.py`` (``llmbus.testing.runner_driver``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from llmbus.bus import messages as m
from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import (BLOCK_SIZE, NUM_BLOCKS, Request, drive, drive_tensor_parallel, make_prompts,
                                          reference, save_tiny_llama)
from llmbus.workers.model_runner import ModelRunner, SeqInput
from llmbus.workers.process import Worker

VOCAB = 512
CACHED_BLOCKS = 4  # the prefix the two prompts share: 18 tokens, of which 4 full blocks (16) are cached
CACHED_TOKENS = CACHED_BLOCKS * BLOCK_SIZE
PREEMPT_AFTER = 5  # tokens generated before the preemption

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5)
SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, temperature=1.4, top_k=80, seed=2**64 - 7),
    "penalised_greedy": SamplingParams(**PENALTIES),
    "penalised_seeded": SamplingParams(do_sample=True, temperature=1.2, top_p=0.95, seed=11, **PENALTIES),
}


@dataclass
class Setup:
    path: str
    runner: ModelRunner
    donor: list[int]  # 19 tokens
    prompt: list[int]  # the donor's first 18 tokens, then 9 of its own
    other: list[int]  # 7 unrelated tokens
    expected: dict[str, list[int]]  # transformers' greedy tokens of donor, prompt and other


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    path = str(tmp_path_factory.mktemp("recompute"))
    save_tiny_llama(path, tied=True, vocab_size=VOCAB)
    prompts = make_prompts(VOCAB)
    donor, other = prompts[3], prompts[2]
    rng = random.Random(5)
    prompt = donor[:CACHED_TOKENS + 2] + [rng.randrange(VOCAB) for _ in range(9)]
    ref = reference(path, [donor, prompt, other])
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512)
    return Setup(path, runner, donor, prompt, other,
                 dict(donor=ref.tokens[0], prompt=ref.tokens[1], other=ref.tokens[2]))


def _each_sampling_alone(runner: ModelRunner, prompt: list[int]) -> dict[str, Request]:
    """``prompt`` under each sampling of ``SAMPLINGS``, alone, from scratch and uninterrupted."""
    return {name: drive(runner, [Request(rid=name, prompt=prompt, sampling=sampling)])[name]
            for name, sampling in SAMPLINGS.items()}


@pytest.fixture(scope="module")
def from_scratch(setup) -> dict[str, Request]:
    return _each_sampling_alone(setup.runner, setup.prompt)


def _hit(setup: Setup, donor_blocks: list[int], sampling: SamplingParams, chunk: int | None,
         **kwargs) -> Request:
    """``setup.prompt`` as a prefix-cache hit on the donor's first blocks; the rest of the prompt in one
    step (``chunk`` None) or in chunks of ``chunk``."""
    return Request(rid="hit", prompt=setup.prompt, sampling=sampling, prefill_chunk=chunk,
                   computed=CACHED_TOKENS, blocks=donor_blocks[:CACHED_BLOCKS], **kwargs)


# -- prefix-cache hits ---------------------------------------------------------------------------


def test_reference_prompts_share_exactly_the_cached_blocks(setup):
    assert setup.prompt[:CACHED_TOKENS] == setup.donor[:CACHED_TOKENS]
    assert setup.expected["prompt"] != setup.expected["donor"]


@pytest.mark.parametrize("chunk", [None, 6], ids=["rest_in_one_step", "rest_in_2_chunks"])
def test_prefix_hit_on_a_dropped_request_matches_transformers(setup, chunk):
    donor = drive(setup.runner, [Request(rid="donor", prompt=setup.donor)])["donor"]
    assert donor.tokens == setup.expected["donor"]
    # The donor is finished and dropped; its blocks keep their K/V.
    hit = drive(setup.runner, [_hit(setup, donor.blocks, SamplingParams(), chunk)])["hit"]
    assert hit.tokens == setup.expected["prompt"]


@pytest.mark.parametrize("chunk", [None, 6], ids=["rest_in_one_step", "rest_in_2_chunks"])
def test_prefix_hit_on_a_running_request_in_the_same_batch(setup, chunk):
    # The donor's first blocks are given up front so the hit can name them; it arrives while the donor
    # decodes (writing its own later blocks) and an unrelated request runs beside both.
    donor = Request(rid="donor", prompt=setup.donor, blocks=[155, 151, 158, 150, 153])
    other = Request(rid="other", prompt=setup.other, arrival_step=1)
    hit = _hit(setup, donor.blocks, SamplingParams(), chunk, arrival_step=2)
    results = drive(setup.runner, [donor, other, hit])
    assert results["hit"].tokens == setup.expected["prompt"]
    assert results["donor"].tokens == setup.expected["donor"]
    assert results["other"].tokens == setup.expected["other"]


def test_prefix_hit_reads_the_cached_blocks(setup):
    # The same hit on blocks holding another prompt's K/V must go wrong, or the tests above would pass
    # with the cached blocks ignored.
    stranger = drive(setup.runner, [Request(rid="stranger", prompt=setup.donor[::-1])])["stranger"]
    hit = drive(setup.runner, [_hit(setup, stranger.blocks, SamplingParams(), None)])["hit"]
    assert hit.tokens != setup.expected["prompt"]


@pytest.mark.parametrize("donor_running", [False, True], ids=["donor_dropped", "donor_running"])
@pytest.mark.parametrize("chunk", [None, 6], ids=["rest_in_one_step", "rest_in_2_chunks"])
@pytest.mark.parametrize("name", ["seeded", "penalised_greedy", "penalised_seeded"])
def test_prefix_hit_samples_as_a_run_from_scratch(setup, from_scratch, name, chunk, donor_running):
    sampling = SAMPLINGS[name]
    if donor_running:
        donor = Request(rid="donor", prompt=setup.donor, blocks=[155, 151, 158, 150, 153])
        results = drive(setup.runner, [donor, _hit(setup, donor.blocks, sampling, chunk, arrival_step=1)])
    else:
        donor = drive(setup.runner, [Request(rid="donor", prompt=setup.donor)])["donor"]
        results = drive(setup.runner, [_hit(setup, donor.blocks, sampling, chunk)])
    assert results["hit"].tokens == from_scratch[name].tokens
    torch.testing.assert_close(torch.tensor(results["hit"].logprobs), torch.tensor(from_scratch[name].logprobs),
                               rtol=0, atol=1e-4)


def test_sampling_kinds_differ(from_scratch):
    # Otherwise the sampling tests above would prove nothing about penalties or seeds.
    tokens = [tuple(r.tokens) for r in from_scratch.values()]
    assert len(set(tokens)) == len(tokens)


def test_penalised_history_starts_with_the_cached_prefix(setup):
    donor = drive(setup.runner, [Request(rid="donor", prompt=setup.donor)])["donor"]
    rest = setup.prompt[CACHED_TOKENS:]
    seq = SeqInput(rid="hit", token_ids=rest[:4], num_computed=CACHED_TOKENS,
                   block_table=donor.blocks[:CACHED_BLOCKS] + [100, 101, 102], sample=False,
                   sampling=SAMPLINGS["penalised_greedy"], prompt_len=len(setup.prompt),
                   cached_ids=setup.prompt[:CACHED_TOKENS])
    setup.runner.step([seq])
    assert setup.runner.histories["hit"].tokens().tolist() == setup.prompt[:CACHED_TOKENS + 4]
    seq.token_ids, seq.num_computed, seq.sample = rest[4:], CACHED_TOKENS + 4, True
    setup.runner.step([seq])
    assert setup.runner.histories["hit"].tokens().tolist() == setup.prompt
    setup.runner.drop(["hit"])
    assert setup.runner.histories == {}
    # Unpenalised requests keep no history, cached prefix or not.
    seq = SeqInput(rid="plain", token_ids=rest, num_computed=CACHED_TOKENS, block_table=seq.block_table,
                   sample=True, sampling=SAMPLINGS["seeded"], cached_ids=setup.prompt[:CACHED_TOKENS])
    setup.runner.step([seq])
    assert setup.runner.histories == {}


# -- preemption ----------------------------------------------------------------------------------

# (prefill_chunk, neighbours, resume_cached_blocks): the recomputation of 19 prompt + 5 generated tokens
# in one step or in 2 chunks of 13 (the prompt too), alone or in a batch, from scratch or on a cache hit
# of its own first blocks (5 blocks: 19 prompt tokens and its first generated one).
PREEMPTIONS = [(None, False, 0), (13, True, 0), (None, True, 4), (13, False, 5)]


@pytest.fixture(scope="module")
def uninterrupted(setup) -> dict[str, Request]:
    return _each_sampling_alone(setup.runner, setup.donor)


def _neighbours(setup: Setup) -> list[Request]:
    return [Request(rid="long", prompt=setup.prompt, prefill_chunk=8),
            Request(rid="sampled", prompt=setup.other, arrival_step=3,
                    sampling=SamplingParams(do_sample=True, seed=3, typical_p=0.7))]


def _preempted(setup: Setup, name: str, chunk: int | None, cached_blocks: int) -> Request:
    return Request(rid=name, prompt=setup.donor, sampling=SAMPLINGS[name], prefill_chunk=chunk,
                   preempt_after=PREEMPT_AFTER, resume_cached_blocks=cached_blocks, arrival_step=1)


@pytest.mark.parametrize("chunk, neighbours, cached_blocks", PREEMPTIONS,
                         ids=[f"chunk{c}-{'batch' if n else 'alone'}-cached{k}" for c, n, k in PREEMPTIONS])
@pytest.mark.parametrize("name", ["seeded", "penalised_seeded", "penalised_greedy"])
def test_preempted_request_continues_as_if_uninterrupted(setup, uninterrupted, name, chunk, neighbours,
                                                         cached_blocks):
    uninterrupted = uninterrupted[name]
    requests = [_preempted(setup, name, chunk, cached_blocks)] + (_neighbours(setup) if neighbours else [])
    results = drive(setup.runner, requests)
    assert results[name].preemptions == 1
    assert results[name].tokens == uninterrupted.tokens
    torch.testing.assert_close(torch.tensor(results[name].logprobs), torch.tensor(uninterrupted.logprobs),
                               rtol=0, atol=1e-4)
    if neighbours:
        assert results["long"].tokens == setup.expected["prompt"]


def test_preemption_at_tensor_parallel_2(setup, tmp_path):
    names = ["seeded", "penalised_seeded"]
    batches = {
        "uninterrupted": [Request(rid=n, prompt=setup.donor, sampling=SAMPLINGS[n], arrival_step=1) for n in names],
        "preempted": [_preempted(setup, "seeded", 13, 0), _preempted(setup, "penalised_seeded", None, 5)]
                     + _neighbours(setup),
    }
    results = drive_tensor_parallel(setup.path, batches, str(tmp_path))
    single = drive(setup.runner, batches["uninterrupted"])
    for name in names:
        tokens, logprobs = results["preempted"][name]
        assert tokens == results["uninterrupted"][name][0] == single[name].tokens, name
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(single[name].logprobs), rtol=0, atol=1e-4)


# -- the worker's side ---------------------------------------------------------------------------


class _RecordingRunner:
    def __init__(self):
        self.dropped: list[list[str]] = []

    def drop(self, rids: list[str]) -> None:
        self.dropped.append(list(rids))


def test_worker_hands_cached_ids_to_the_runner_and_restarts_resent_requests():
    worker = Worker.__new__(Worker)  # apply() needs no sockets
    worker.states, worker._seq_input, worker.runner = {}, SeqInput, _RecordingRunner()
    penalised = m.SamplingParams(repetition_penalty=1.2)

    def step(new: list[m.NewRequestData], num_computed: int, tokens: list[int], finished=()) -> SeqInput:
        [seq] = worker.apply(m.StepCommand(step_id=1, new_requests=new, rids=["r"], num_computed=[num_computed],
                                           num_new=[len(tokens)], token_ids=tokens, sample=[True],
                                           finished_rids=list(finished)))
        return seq

    seq = step([m.NewRequestData("r", penalised, [3, 4, 5], 10, cached_ids=list(range(8)))], 8, [8, 9])
    assert (seq.cached_ids, seq.num_computed, seq.block_table, seq.prompt_len) == (list(range(8)), 8, [3, 4, 5], 10)
    assert step([], 10, [42]).cached_ids == list(range(8))  # unchanged; the runner reads it only once
    assert worker.runner.dropped == []
    # Preempted, then re-sent as a new request with nothing cached: listed as finished first, as the
    # scheduler does, or (defensively) not.
    for finished in (["r"], []):
        seq = step([m.NewRequestData("r", penalised, [6, 7, 8], 10)], 0, list(range(11)), finished)
        assert (seq.cached_ids, seq.num_computed, seq.block_table) == ([], 0, [6, 7, 8])
        assert worker.runner.dropped == [["r"]]
        worker.runner.dropped.clear()
