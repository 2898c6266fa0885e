"""The sampler's processed distribution against transformers' logits processors (and TGI's formula where
transformers has none), top_n_tokens, the watermark, and a seeded request through the real stack.

The distribution a row is sampled from is read back through ``top_n_tokens``: asking for the whole
vocabulary returns every token the warpers kept, with its logprob. The reference applies TGI's
``NextTokenChooser`` order with transformers' processors: watermark, repetition penalty, frequency
penalty, then temperature, top-k, top-p and typical-p (transformers' ``generate`` orders its warpers
the same way).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
                                                    WatermarkLogitsProcessor)

from llmbus.bus.messages import SamplingParams
from llmbus.testing import Server
from llmbus.testing.http import post
from llmbus.workers.sampling import apply_warpers, apply_watermark, sample

VOCAB = 300
HASH_KEY = 15485863


def _watermark_processor(vocab: int, gamma: float = 0.5, delta: float = 2.0) -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(vocab_size=vocab, device="cpu", greenlist_ratio=gamma, bias=delta,
                                    hashing_key=HASH_KEY, seeding_scheme="lefthash")


def _reference_logprobs(logits: torch.Tensor, p: SamplingParams, history: torch.Tensor) -> torch.Tensor:
    """Row ``logits [vocab]`` through transformers' processors in TGI's order; ``history`` ends with the
    token before the sampled one."""
    scores = logits[None].clone()
    input_ids = history[None]
    if p.logit_bias_ids:  # OpenAI's logit_bias: single-token sequences, biased whatever came before
        bias = [[[t], v] for t, v in zip(p.logit_bias_ids, p.logit_bias_values)]
        scores = SequenceBiasLogitsProcessor(bias)(input_ids, scores)
    if p.watermark:
        scores = _watermark_processor(len(logits))(input_ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    if p.frequency_penalty != 0.0:
        # transformers has no frequency penalty; TGI's: logit -= penalty * count(token) / len(history).
        counts = torch.bincount(history, minlength=len(logits)).float()
        scores = scores - p.frequency_penalty * counts / len(history)
    if p.do_sample:
        if p.temperature != 1.0:
            scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
        scores = _transformers_warpers(scores, p)
    return torch.log_softmax(scores[0], dim=-1)


def _transformers_warpers(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, top-p and typical-p of ``scores [1, vocab]``, the ones ``p`` asks for, in TGI's order."""
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.typical_p < 1.0:
        scores = TypicalLogitsWarper(p.typical_p)(None, scores)
    return scores


def test_warper_masks_match_transformers_processors():
    torch.manual_seed(3)
    logits = torch.randn(5, 200) * 3
    params = [SamplingParams(do_sample=True, top_k=10),
              SamplingParams(do_sample=True, top_p=0.7),
              SamplingParams(do_sample=True, typical_p=0.6),
              SamplingParams(do_sample=True, top_k=40, top_p=0.9, typical_p=0.8),
              SamplingParams(do_sample=True)]
    ours = apply_warpers(logits, params)
    for row, p in enumerate(params):
        assert torch.equal(ours[row:row + 1], _transformers_warpers(logits[row:row + 1], p)), f"row {row}: {p}"
    assert torch.isfinite(ours[4]).all()  # no warper asked, nothing masked

    # top-p over a vocabulary larger than its candidate shortlist: a peaked row (nucleus inside the
    # shortlist) alone, then together with a flat row (which forces the full sort).
    peaked, flat = torch.randn(1, 3000) * 8, torch.randn(1, 3000) * 0.1
    top_p = SamplingParams(do_sample=True, top_p=0.9)
    for batch in (peaked, torch.cat((peaked, flat))):
        ours = apply_warpers(batch, [top_p] * len(batch))
        assert torch.equal(ours, TopPLogitsWarper(0.9)(None, batch))
    assert torch.isfinite(ours[1]).sum() > 256  # the flat row's nucleus did exceed the shortlist


MIXED = [
    SamplingParams(),  # greedy, nothing asked: the raw log-softmax
    SamplingParams(do_sample=True, seed=1),  # sampled, nothing asked: the raw log-softmax too
    SamplingParams(do_sample=True, temperature=0.6, seed=2),
    SamplingParams(do_sample=True, temperature=1.7, top_k=12, seed=3),
    SamplingParams(do_sample=True, top_p=0.8, seed=4),
    SamplingParams(do_sample=True, typical_p=0.7, seed=5),
    SamplingParams(do_sample=True, temperature=0.8, top_k=60, top_p=0.9, typical_p=0.9, seed=6),
    SamplingParams(do_sample=True, temperature=1.3, repetition_penalty=1.4, top_p=0.95, seed=7),
    SamplingParams(do_sample=True, frequency_penalty=0.8, top_k=40, seed=8),
    SamplingParams(do_sample=True, temperature=0.7, watermark=True, repetition_penalty=1.2, frequency_penalty=0.3,
                   top_k=30, top_p=0.9, typical_p=0.95, seed=9),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),  # greedy: penalties only
    SamplingParams(watermark=True),  # greedy: watermark only
    SamplingParams(top_k=5, top_p=0.5, temperature=0.1),  # greedy: the warpers' settings are ignored
    # OpenAI's logit_bias, before the penalties (a biased token the history holds is then penalised too)
    SamplingParams(logit_bias_ids=[3, 77, 120], logit_bias_values=[-100.0, 9.5, 0.25]),  # greedy
    SamplingParams(repetition_penalty=1.3, logit_bias_ids=[4, 6, 200], logit_bias_values=[7.0, -3.0, 100.0]),
    SamplingParams(do_sample=True, temperature=0.9, top_k=50, frequency_penalty=0.5, watermark=True, seed=10,
                   logit_bias_ids=[1, 2, 3, 40], logit_bias_values=[4.0, 4.0, -4.0, 2.0]),
]


def _mixed_batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), VOCAB, generator=generator) * 3
    # A narrow id range makes repeated ids (counts above 1) common.
    histories = [torch.randint(0, 50, (int(n),), generator=generator)
                 for n in torch.randint(1, 40, (len(MIXED),), generator=generator)]
    return logits, histories


def _sample(logits, params, histories):
    return sample(logits, params, [len(h) for h in histories], histories, [int(h[-1]) for h in histories])


def test_processed_distribution_matches_transformers_processors():
    logits, histories = _mixed_batch(0)
    params = [_with(p, top_n_tokens=VOCAB) for p in MIXED]
    original = logits.clone()
    out = _sample(logits, params, histories)
    assert torch.equal(logits, original), "the caller's logits were modified in place"
    for row, p in enumerate(params):
        expected = _reference_logprobs(logits[row], p, histories[row])
        ids, values = out.top_tokens[row]
        kept = torch.isfinite(expected).nonzero().squeeze(1)
        assert sorted(ids) == kept.tolist(), f"row {row}: another set of tokens kept than transformers' ({p})"
        torch.testing.assert_close(torch.tensor(values), expected[ids], rtol=0, atol=1e-5, msg=f"row {row}: {p}")
        assert values == sorted(values, reverse=True)
        chosen = int(out.token_ids[row])
        assert torch.isfinite(expected[chosen])
        torch.testing.assert_close(out.logprobs[row], expected[chosen], rtol=0, atol=1e-5)
        if not p.do_sample:
            assert chosen == int(expected.argmax())
    # The rows that asked for nothing keep the whole vocabulary.
    assert len(out.top_tokens[0][0]) == len(out.top_tokens[1][0]) == VOCAB


def _with(p: SamplingParams, **changes) -> SamplingParams:
    fields = {name: getattr(p, name) for name in SamplingParams.__dataclass_fields__}
    return SamplingParams(**{**fields, **changes})


def test_top_n_tokens_are_the_topk_of_the_processed_distribution():
    logits, histories = _mixed_batch(1)
    counts = [3, 0, 5, 1, 2, 0, 4, 5, 3, 5, 2, 4, 1, 2, 0, 3]
    params = [_with(p, top_n_tokens=n) for p, n in zip(MIXED, counts)]
    params[3] = _with(params[3], top_k=2, top_n_tokens=5)  # fewer tokens kept than asked for
    out = _sample(logits, params, histories)
    assert len(out.top_tokens) == len(params)
    for row, p in enumerate(params):
        if p.top_n_tokens == 0:
            assert out.top_tokens[row] == [], f"row {row} asked for no top tokens"
            continue
        expected = _reference_logprobs(logits[row], p, histories[row]).topk(p.top_n_tokens)
        finite = torch.isfinite(expected.values)
        ids, values = out.top_tokens[row]
        assert ids == expected.indices[finite].tolist(), f"row {row}: {p}"
        torch.testing.assert_close(torch.tensor(values), expected.values[finite], rtol=0, atol=1e-5)
        chosen = int(out.token_ids[row])
        if chosen in ids:  # always so for greedy rows: the argmax is the first
            assert values[ids.index(chosen)] == pytest.approx(float(out.logprobs[row]), abs=1e-6)
        if not p.do_sample:
            assert ids[0] == chosen
    assert len(out.top_tokens[3][0]) == 2  # top_k=2 left two tokens with a probability
    # Nobody asks: no per-row lists at all.
    assert _sample(logits, MIXED, histories).top_tokens == []


@pytest.mark.parametrize("gamma,delta", [(0.5, 2.0), (0.25, 5.0)])
def test_watermark_matches_transformers_processor(gamma, delta):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=generator) * 2
    last_tokens = [0, 17, VOCAB - 1, 17, 123_456, 5]  # a token id beyond the vocabulary still seeds
    params = [SamplingParams(watermark=w) for w in (True, True, True, False, True, False)]
    ours = apply_watermark(logits, params, last_tokens, gamma, delta)
    processor = _watermark_processor(VOCAB, gamma, delta)
    for row, p in enumerate(params):
        expected = logits[row:row + 1]
        if p.watermark:
            expected = processor(torch.tensor([[3, last_tokens[row]]]), expected)
        assert torch.equal(ours[row:row + 1], expected), f"row {row}: {p}"
    # Every row asking (the path without row selection) gives the same rows.
    assert torch.equal(apply_watermark(logits[:3], params[:3], last_tokens[:3], gamma, delta), ours[:3])
    # Rows 1 and 3 share a previous token: one is biased, the other left alone.
    assert int((ours[1] != logits[1]).sum()) == int(VOCAB * gamma)
    with pytest.raises(ValueError):
        apply_watermark(logits, params, None)


def test_sample_takes_the_watermark_settings_it_is_given():
    """The workers' --watermark-gamma/--watermark-delta reach sampling as arguments (no module reads
    WATERMARK_GAMMA/DELTA at import); unset, TGI's defaults."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(watermark=True, top_n_tokens=3)] * 2
    out = sample(logits, params, [1, 1], last_tokens=[5, 9], watermark_gamma=0.25, watermark_delta=50.0)
    biased = apply_watermark(logits, params, [5, 9], 0.25, 50.0)
    assert out.token_ids.tolist() == biased.argmax(dim=-1).tolist()
    default = sample(logits, params, [1, 1], last_tokens=[5, 9])
    assert default.token_ids.tolist() == apply_watermark(logits, params, [5, 9], 0.5, 2.0).argmax(dim=-1).tolist()


def test_greedy_watermark_moves_the_argmax_only_through_the_bias():
    generator = torch.Generator().manual_seed(3)
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=generator)
    last_tokens = torch.randint(0, VOCAB, (rows,), generator=generator).tolist()
    params = [SamplingParams(watermark=i % 4 != 3) for i in range(rows)]
    out = sample(logits, params, [1] * rows, last_tokens=last_tokens)
    biased = _watermark_processor(VOCAB)
    moved = 0
    for row, p in enumerate(params):
        raw_best, chosen = int(logits[row].argmax()), int(out.token_ids[row])
        if not p.watermark:
            assert chosen == raw_best
            continue
        scores = biased(torch.tensor([[last_tokens[row]]]), logits[row:row + 1])[0]
        assert chosen == int(scores.argmax())
        torch.testing.assert_close(out.logprobs[row], torch.log_softmax(scores, -1)[chosen], rtol=0, atol=1e-6)
        if chosen != raw_best:
            moved += 1
            # Only a green token within delta of a red best can overtake it.
            assert scores[chosen] > logits[row, chosen] and scores[raw_best] == logits[row, raw_best]
            assert logits[row, raw_best] - logits[row, chosen] < 2.0
    assert moved > 5, "the watermark never changed a greedy choice: the test proves nothing"


def test_watermark_detector_finds_text_sampled_with_watermark():
    from transformers import PretrainedConfig
    from transformers.generation import WatermarkDetector

    # A bigram "language model": the next token's logits depend on the previous token only.
    vocab, length, rows = 1000, 120, 8
    generator = torch.Generator().manual_seed(4)
    table = torch.randn(vocab, vocab, generator=generator) * 1.5
    params = [SamplingParams(do_sample=True, temperature=0.9, top_p=0.98, seed=100 + i, watermark=i % 2 == 0)
              for i in range(rows)]
    tokens = [[7 + i] for i in range(rows)]
    for position in range(1, length + 1):
        last = [seq[-1] for seq in tokens]
        out = sample(table[last], params, [position] * rows, last_tokens=last)
        for seq, token in zip(tokens, out.token_ids.tolist()):
            seq.append(token)
    detector = WatermarkDetector(
        model_config=PretrainedConfig(vocab_size=vocab, bos_token_id=vocab), device="cpu",
        watermarking_config=dict(greenlist_ratio=0.5, bias=2.0, hashing_key=HASH_KEY, seeding_scheme="lefthash",
                                 context_width=1))
    z = detector(torch.tensor(tokens), return_dict=True).z_score
    for row, p in enumerate(params):
        if p.watermark:
            assert z[row] > 5, f"row {row}: watermark not detected, z={z[row]:.2f}"
        else:
            assert abs(z[row]) < 3, f"row {row}: watermark detected in plain text, z={z[row]:.2f}"


# -- through the real stack ----------------------------------------------------------------------

SEED = 20240607
SEEDED = {"do_sample": True, "seed": SEED, "temperature": 0.7, "top_k": 20, "top_p": 0.95, "typical_p": 0.95,
          "repetition_penalty": 1.2, "top_n_tokens": 3, "watermark": True, "details": True, "max_new_tokens": 12}
PROMPT = "The quick brown fox"


def _others() -> list[tuple[str, dict]]:
    """15 different requests, longer than the seeded one so that it runs inside their batch."""
    base = {"details": True, "max_new_tokens": 20}
    others = []
    for i in range(15):
        params = dict(base)
        if i % 3 == 0:
            params.update(top_n_tokens=1 + i % 5)  # greedy with top tokens
        elif i % 3 == 1:
            params.update(do_sample=True, seed=i, temperature=1.1, top_k=50, watermark=i % 2 == 0,
                          frequency_penalty=0.2)
        others.append((f"Request number {i} says", params))
    return others


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(["--model-id", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "64",
                  "--max-input-tokens", "32", "--num-blocks", "128", "--block-size", "16"])
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.stderr.text[-3000:]


def _generate(server, prompt: str, params: dict) -> dict:
    status, _, body = post(f"{server.url}/generate", {"inputs": prompt, "parameters": params})
    assert status == 200, body
    return body["details"]


def _check_top_tokens(details: dict, n: int, greedy: bool) -> None:
    tokens, top = details["tokens"], details.get("top_tokens", [])
    if n == 0:
        assert top == []
        return
    assert len(top) == len(tokens), "one list of top tokens per generated token"
    for token, alternatives in zip(tokens, top):
        logprobs = [a["logprob"] for a in alternatives]
        if len(alternatives) < n:
            # Fewer tokens than asked survived top-k/top-p/typical-p: they are all there (as in TGI, a
            # token with probability 0 is no top token).
            assert not greedy and sum(math.exp(lp) for lp in logprobs) == pytest.approx(1.0, abs=1e-4)
        else:
            assert len(alternatives) == n
        assert logprobs == sorted(logprobs, reverse=True)
        assert all({"id", "text", "logprob", "special"} <= a.keys() for a in alternatives)
        ids = [a["id"] for a in alternatives]
        if greedy:
            assert ids[0] == token["id"]
        if token["id"] in ids:
            assert alternatives[ids.index(token["id"])]["logprob"] == pytest.approx(token["logprob"], abs=1e-6)


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_16(server):
    alone = _generate(server, PROMPT, SEEDED)
    assert alone["seed"] == SEED
    _check_top_tokens(alone, 3, greedy=False)
    assert sum(len(top) == 3 for top in alone["top_tokens"]) > len(alone["tokens"]) // 2

    others = _others()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_generate, server, prompt, params) for prompt, params in others]
        batched = pool.submit(_generate, server, PROMPT, SEEDED).result()
        other_details = [f.result() for f in futures]
    assert batched["seed"] == SEED
    assert [t["id"] for t in batched["tokens"]] == [t["id"] for t in alone["tokens"]]
    # Token ids exactly; logprobs to float32 noise: the kernels of a larger step (other matmul shapes,
    # another attention path) round this request's activations differently in the last bits, and the
    # differences grow a little along the KV cache (about 4e-5 after 12 tokens here).
    assert [t["logprob"] for t in batched["tokens"]] == pytest.approx([t["logprob"] for t in alone["tokens"]],
                                                                      rel=0, abs=1e-3)
    assert [[a["id"] for a in top] for top in batched["top_tokens"]] == \
        [[a["id"] for a in top] for top in alone["top_tokens"]]
    assert [a["logprob"] for top in batched["top_tokens"] for a in top] == \
        pytest.approx([a["logprob"] for top in alone["top_tokens"] for a in top], rel=0, abs=1e-3)
    for (_, params), details in zip(others, other_details):
        _check_top_tokens(details, params.get("top_n_tokens", 0), greedy=not params.get("do_sample"))


def test_a_rows_token_and_logprob_do_not_depend_on_a_neighbour_asking_for_top_tokens():
    """A row asking for top_n_tokens took every row of its step through torch's log-softmax, the others' logprobs
    off by ~1e-5 from what the sampling kernels give them alone (tokens were the same): each row is computed
    now as it is alone, greedy and seeded, warped or not."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152) * 4  # a real vocabulary's width: where the two sums part
    params = [SamplingParams(), SamplingParams(top_n_tokens=3),
              SamplingParams(do_sample=True, seed=7, temperature=0.8),
              SamplingParams(do_sample=True, seed=8, temperature=0.7, top_n_tokens=2),
              SamplingParams(do_sample=True, seed=9, top_k=20, top_p=0.9),
              SamplingParams(do_sample=True, seed=10, top_p=0.8, top_n_tokens=1)]
    positions = [5, 6, 7, 8, 9, 10]
    for rows in ([0, 1], [2, 3], [4, 5], [0, 1, 2, 3, 4, 5]):
        together = sample(logits[rows], [params[i] for i in rows], [positions[i] for i in rows])
        for k, i in enumerate(rows):
            alone = sample(logits[i:i + 1], [params[i]], [positions[i]])
            assert together.token_ids[k] == alone.token_ids[0], (rows, i)
            assert together.logprobs[k].item() == alone.logprobs[0].item(), (rows, i)
            assert together.top_tokens[k] == (alone.top_tokens[0] if alone.top_tokens else []), (rows, i)


def test_min_tokens_masks_the_stop_ids_until_then_as_transformers_does():
    """vLLM's min_tokens: each row's ids that would end it get -inf while it has generated fewer tokens (counted from
    its prompt length), as transformers' ``MinNewTokensLengthLogitsProcessor`` masks EOS; then they are back."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, VOCAB, generator=generator) * 3
    logits[:, 9] += 20.0  # the stop id every row would take
    prompt_len, minimum, stops = 6, 3, [9, 40]
    generated = [0, 1, 2, 3, 7]
    params = [SamplingParams(min_new_tokens=minimum, min_tokens_masked_ids=stops, top_n_tokens=VOCAB)] * 4 + [
        SamplingParams(min_new_tokens=minimum, min_tokens_masked_ids=stops, do_sample=True, seed=3, top_k=20)]
    out = sample(logits, params, [prompt_len + g for g in generated], prompt_lens=[prompt_len] * 5)
    processor = MinNewTokensLengthLogitsProcessor(prompt_len, minimum, stops)
    for row, g in enumerate(generated[:4]):
        expected = torch.log_softmax(processor(torch.zeros(1, prompt_len + g, dtype=torch.long),
                                               logits[row:row + 1].clone())[0], dim=-1)
        assert int(out.token_ids[row]) == int(expected.argmax()), row
        assert (int(out.token_ids[row]) in stops) == (g >= minimum), row
        ids, values = out.top_tokens[row]
        assert sorted(ids) == torch.isfinite(expected).nonzero().squeeze(1).tolist(), row
        torch.testing.assert_close(torch.tensor(values), expected[ids], rtol=0, atol=1e-5)
    assert int(out.token_ids[4]) == 9  # past min_tokens a sampled row takes the stop id again
    # a row whose grammar allows nothing but a stop id (complete) keeps it, min_tokens or not: never a row of -inf
    complete = torch.full((2, VOCAB), float("-inf"))
    complete[:, 9] = logits[0, 9]
    done = sample(complete, [SamplingParams(min_new_tokens=minimum, min_tokens_masked_ids=stops),
                             SamplingParams(min_new_tokens=minimum, min_tokens_masked_ids=stops, do_sample=True)],
                  [prompt_len, prompt_len], prompt_lens=[prompt_len] * 2)
    assert done.token_ids.tolist() == [9, 9] and done.logprobs.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="prompt lengths"):
        sample(logits, params, [prompt_len] * 5)
