"""Repetition and frequency penalties: the sampler against transformers and TGI's formula, and greedy
decoding through ModelRunner against ``generate(repetition_penalty=...)``."""

from __future__ import annotations

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import (BLOCK_SIZE, MAX_NEW_TOKENS, MIN_MARGIN, NUM_BLOCKS, Request, drive,
                                          make_prompts, save_tiny_llama)
from llmbus.workers.model_runner import ModelRunner, TokenHistory
from llmbus.workers.sampling import apply_penalties, apply_warpers, sample

VOCAB = 300


def _histories(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # A narrow id range makes repeats (and so counts above 1) common.
    return [torch.randint(0, 40, (n,), generator=generator) for n in lengths]


def test_repetition_penalty_matches_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(5)
    logits = torch.randn(6, VOCAB) * 3  # both signs among the penalised ids
    histories = _histories([1, 7, 30, 12, 50, 3])
    params = [SamplingParams(repetition_penalty=1.3),
              SamplingParams(),  # unpenalised, between penalised rows
              SamplingParams(repetition_penalty=0.7, do_sample=True, temperature=0.8),
              SamplingParams(repetition_penalty=2.0),
              SamplingParams(do_sample=True, top_k=5),
              SamplingParams(repetition_penalty=1.1, do_sample=True)]
    original = logits.clone()
    ours = apply_penalties(logits, params, histories)
    assert torch.equal(logits, original), "the caller's logits were modified in place"
    for row, p in enumerate(params):
        expected = logits[row:row + 1]
        if p.repetition_penalty != 1.0:
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(histories[row][None], expected)
        assert torch.equal(ours[row:row + 1], expected), f"row {row}: {p}"

    # The distributions sample() draws from: penalty, then temperature and warpers, as transformers'
    # processor list does; logprobs of greedy rows are the penalised log-softmax.
    token_ids, logprobs, _ = sample(logits, params, [len(h) for h in histories],
                                    [h if p.repetition_penalty != 1.0 else None for h, p in zip(histories, params)])
    for row, p in enumerate(params):
        expected = logits[row:row + 1]
        if p.repetition_penalty != 1.0:
            expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(histories[row][None], expected)
        if p.do_sample:
            expected = apply_warpers(expected / p.temperature, [p])
        else:
            assert token_ids[row] == expected.argmax()
        expected_logprobs = torch.log_softmax(expected, dim=-1)[0]
        torch.testing.assert_close(logprobs[row], expected_logprobs[token_ids[row]], rtol=0, atol=1e-6)


def test_frequency_penalty_matches_tgi_formula():
    torch.manual_seed(6)
    logits = torch.randn(5, VOCAB) * 3
    histories = _histories([4, 25, 9, 1, 60], seed=1)
    params = [SamplingParams(frequency_penalty=0.5),
              SamplingParams(),
              SamplingParams(frequency_penalty=-1.5, repetition_penalty=1.2),
              SamplingParams(frequency_penalty=2.0, do_sample=True),
              SamplingParams(repetition_penalty=0.9)]
    ours = apply_penalties(logits, params, histories)
    for row, p in enumerate(params):
        # By hand, one token at a time: repetition penalty on each distinct id, then TGI's
        # logit -= penalty * count / len(history).
        expected = logits[row].clone()
        history = histories[row].tolist()
        for token in set(history):
            if p.repetition_penalty != 1.0:
                value = expected[token]
                expected[token] = value * p.repetition_penalty if value < 0 else value / p.repetition_penalty
        for token in set(history):
            if p.frequency_penalty != 0.0:
                expected[token] -= p.frequency_penalty * history.count(token) / len(history)
        torch.testing.assert_close(ours[row], expected, rtol=0, atol=1e-5, msg=f"row {row}: {p}")
        untouched = torch.ones(VOCAB, dtype=torch.bool)
        untouched[histories[row]] = False
        assert torch.equal(ours[row][untouched], logits[row][untouched])

    # Nothing penalised anywhere: the logits come back as they were.
    assert torch.equal(sample(logits, [SamplingParams()] * 5, [1] * 5)[0], logits.argmax(dim=-1))


def test_penalised_row_without_history_is_refused():
    with pytest.raises(ValueError):
        apply_penalties(torch.zeros(1, 10), [SamplingParams(repetition_penalty=1.2)], None)


def test_token_history_follows_chunks_and_grows():
    """Positions and counts: all of it, and the generated part (from the prompt's length on); a position
    computed again replaces what followed, and its old tokens are no longer counted."""
    history = TokenHistory(vocab=10, prompt_len=3, capacity=2)

    def counts(part: torch.Tensor) -> list[int]:
        return [int(c) for c in part[:10].tolist()]
    history.write(0, [1, 2, 3])
    history.write(3, [4, 5])
    history.write(5, torch.tensor([6]))  # a token fed on the device
    assert history.tokens().tolist() == [1, 2, 3, 4, 5, 6] and len(history) == 6
    history.write(4, [9, 4])  # a recomputed position replaces what followed
    assert history.tokens().tolist() == [1, 2, 3, 4, 9, 4]
    assert counts(history.seen) == [0, 1, 1, 1, 2, 0, 0, 0, 0, 1]
    assert counts(history.generated) == [0, 0, 0, 0, 2, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        history.write(7, [1])


# -- end to end ----------------------------------------------------------------------------------

PENALTY = 1.3


@pytest.fixture(scope="module")
def penalty_checkpoint(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("penalties"))
    save_tiny_llama(path, tied=True, vocab_size=512)
    prompts = make_prompts(512)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = {}
    for penalty in (1.0, PENALTY):
        for i in (1, 4):  # 3 and 40 tokens (the 40 is prefilled in chunks below)
            out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 repetition_penalty=penalty, output_scores=True, return_dict_in_generate=True)
            processed = torch.stack(out.scores)[:, 0].float()  # after the penalty: what the argmax saw
            sequence = out.sequences[0]
            top2 = processed.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "reference margins too thin to compare tokens"
            references[penalty, i] = sequence[len(prompts[i]):].tolist()
    # The penalty must actually change something, or the test proves nothing.
    assert references[PENALTY, 1] != references[1.0, 1] or references[PENALTY, 4] != references[1.0, 4]
    return path, prompts, references


def test_greedy_repetition_penalty_matches_generate_in_a_mixed_batch(penalty_checkpoint):
    path, prompts, references = penalty_checkpoint
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512)
    penalised = SamplingParams(repetition_penalty=PENALTY)
    batch = [Request(rid="plain", prompt=prompts[4], prefill_chunk=16),
             Request(rid="penalised", prompt=prompts[1], sampling=penalised, arrival_step=1),
             Request(rid="penalised_chunked", prompt=prompts[4], sampling=penalised, prefill_chunk=16),
             Request(rid="plain_short", prompt=prompts[1], arrival_step=2)]
    results = drive(runner, batch)
    assert results["plain"].tokens == references[1.0, 4]
    assert results["plain_short"].tokens == references[1.0, 1]
    assert results["penalised"].tokens == references[PENALTY, 1]
    assert results["penalised_chunked"].tokens == references[PENALTY, 4]
    assert runner.histories == {}, "drop() left token histories behind"


def test_presence_penalty_counts_generated_tokens_only():
    torch.manual_seed(11)
    logits = torch.randn(3, VOCAB)
    prompt = torch.tensor([5, 6, 7])
    histories = [torch.cat([prompt, torch.tensor([7, 8, 8])]), torch.cat([prompt, torch.tensor([9])]), prompt]
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(presence_penalty=-1.0),
              SamplingParams(presence_penalty=2.0)]  # nothing generated yet: nothing to penalise
    ours = apply_penalties(logits, params, histories, prompt_lens=[3, 3, 3])
    expected = logits.clone()
    expected[0, [7, 8]] -= 0.5  # once per token, however often it was generated
    expected[1, 9] += 1.0
    assert torch.equal(ours, expected)


def test_presence_penalty_changes_greedy_choice_and_stacks_with_frequency():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.8
    history = [torch.tensor([1, 2, 3])]  # token 3 was generated (prompt_len 2)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)]
    out = sample(logits, params, [3], history, prompt_lens=[2])
    assert out.token_ids.tolist() == [4]
    penalised = apply_penalties(logits, params, history, prompt_lens=[2])
    assert penalised[0, 3].item() == pytest.approx(2.0 - 0.3 / 3 - 0.5)


def test_overflowing_temperature_samples_the_argmax_instead_of_crashing():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB) * 50
    params = [SamplingParams(do_sample=True, temperature=1e-38, seed=s) for s in range(3)]
    params.append(SamplingParams(do_sample=True, temperature=0.7, seed=9))
    out = sample(logits, params, [10, 10, 10, 10])
    assert out.token_ids[:3].tolist() == logits[:3].argmax(dim=-1).tolist()
    assert out.logprobs[:3].tolist() == [0.0, 0.0, 0.0]
    nan_row = torch.full((1, VOCAB), float("nan"))
    assert 0 <= sample(nan_row, [SamplingParams(do_sample=True, seed=1)], [0]).token_ids.item() < VOCAB


def test_openai_frequency_penalty_counts_generated_tokens_undivided():
    # one history, prompt [5, 5, 5] then generated [7, 7, 9]: OpenAI's row subtracts count x penalty over
    # the generated part only; TGI's row (same history) count / length over all of it
    history = torch.tensor([5, 5, 5, 7, 7, 9])
    params = [SamplingParams(frequency_penalty=0.5, frequency_per_count=True), SamplingParams(frequency_penalty=0.5),
              SamplingParams(frequency_penalty=-1.0, frequency_per_count=True), SamplingParams()]
    out = apply_penalties(torch.zeros(4, VOCAB), params, [history] * 4, [3] * 4)
    assert (out[0, 5].item(), out[0, 7].item(), out[0, 9].item()) == (0.0, -1.0, -0.5)
    assert out[1, 5].item() == pytest.approx(-0.5 * 3 / 6) and out[1, 7].item() == pytest.approx(-0.5 * 2 / 6)
    assert (out[2, 7].item(), out[2, 9].item()) == (2.0, 1.0)  # a negative penalty favours repeats
    assert not out[3].any()
    with pytest.raises(ValueError, match="prompt lengths"):
        apply_penalties(torch.zeros(1, VOCAB), params[:1], [history], None)
