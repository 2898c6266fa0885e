"""N-gram speculation: the proposer alone (pure), against a brute-force reading of its definition."""

from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.scheduler.speculation import MAX_NGRAM, NgramIndex


def brute_force(tokens: list[int], k: int) -> list[int]:
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end - 1), 0, -1):
        suffix = tokens[end - n:]
        for e in range(end - 1, n - 1, -1):  # the most recent earlier occurrence first
            if tokens[e - n:e] == suffix:
                return tokens[e:e + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 6), st.integers(0, 40))
def test_proposals_follow_the_most_recent_earlier_occurrence_of_the_longest_suffix(tokens, k, split):
    index = NgramIndex(tokens[:split])
    index.extend(tokens[split:])  # built in two goes, as a request's prompt and then its outputs
    assert index.propose(k) == (brute_force(tokens, k) if len(tokens) >= 2 else [])


def test_a_quoted_span_is_proposed_from_where_it_occurred():
    prompt = [7, 1, 2, 3, 4, 5, 9, 9]
    index = NgramIndex(prompt)
    index.extend([1, 2])  # the output starts quoting the prompt
    assert index.propose(3) == [3, 4, 5]
    assert NgramIndex([1, 2, 3]).propose(4) == []


# ---------------------------------------------------------------------------------------------- policy

from llmbus.bus.messages import SamplingParams, StoppingParams  # noqa: E402
from llmbus.scheduler.kv_blocks import KVBlockManager  # noqa: E402
from llmbus.scheduler.policy import Scheduler, SchedulerConfig  # noqa: E402
from llmbus.scheduler.requests import Request  # noqa: E402
from llmbus.testing.policy_sim import SimWorker, solo_output  # noqa: E402

EOS = 3


def _requests(prompts, max_new):
    return [Request(rid=f"r{i}", frontend_id="f0", prompt_ids=p, sampling=SamplingParams(),
                    stopping=StoppingParams(n, [EOS])) for i, (p, n) in enumerate(zip(prompts, max_new))]


def test_guesses_are_kept_and_rejected_and_steps_shrink():
    prompt = list(range(10, 26))
    s = Scheduler(SchedulerConfig(64, speculate=4), KVBlockManager(64, 4))
    (req,) = _requests([prompt], [40])
    s.add(req)
    worker, steps = SimWorker(4, copy_period=len(prompt)), 0
    while s.has_work:
        batch = s.schedule()
        s.update(batch, worker.run(batch))
        steps += 1
    assert req.output_ids == solo_output(prompt, 40, copy_period=len(prompt))
    assert 0 < req.spec_accepted < req.spec_proposed  # the copying model agrees with most guesses, not all
    assert steps < 40 - req.spec_accepted // 2


def test_no_guesses_in_a_large_batch_or_for_requests_that_cannot_take_them():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    s = Scheduler(SchedulerConfig(64, speculate=3, speculate_max_batch=2), KVBlockManager(64, 4))
    plain = _requests([prompt] * 3, [30, 6, 6])
    penalised = Request(rid="p", frontend_id="f0", prompt_ids=prompt, stopping=StoppingParams(20, []),
                        sampling=SamplingParams(repetition_penalty=1.2))
    for r in plain + [penalised]:
        s.add(r)
    worker = SimWorker(4, copy_period=3)
    while s.has_work:
        batch = s.schedule()
        decodes = sum(q.is_decode for q in batch.seqs)
        assert all(q.num_spec == 0 for q in batch.seqs) or decodes <= 2
        assert all(q.num_spec == 0 for q in batch.seqs if q.request is penalised)
        s.update(batch, worker.run(batch))
    assert penalised.spec_proposed == 0 and plain[0].spec_proposed > 0  # once few decodes remain


# ---------------------------------------------------------------------------------------------- ranks

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from llmbus.testing.runner_driver import save_tiny_llama  # noqa: E402
from llmbus.workers.model_runner import ModelRunner, SeqInput  # noqa: E402

BLOCK = 4
SMALL_VOCAB = 12  # few outcomes, so a chi-square test over them has power with a few thousand draws


@pytest.fixture(scope="module")
def small_runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec"))
    save_tiny_llama(path, tied=True, vocab_size=SMALL_VOCAB)
    runner = ModelRunner(path, block_size=BLOCK, num_blocks=512, max_batch_prefill_tokens=512)
    runner.warmup()
    return runner


def _decode(runner, rid: str, prompt: list[int], n: int, sampling, first_block: int) -> list[int]:
    """n tokens one step at a time (no speculation): the reference."""
    table = list(range(first_block, first_block + 16))
    out = runner.step([SeqInput(rid, prompt, 0, table, True, sampling)])
    tokens = list(out.token_ids)
    while len(tokens) < n:
        position = len(prompt) + len(tokens) - 1
        out = runner.step([SeqInput(rid, [tokens[-1]], position, table, True, sampling)])
        tokens += out.token_ids
    runner.drop([rid])
    return tokens


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.3, seed=7),
                                      SamplingParams(do_sample=True, top_k=5, top_p=0.9, seed=2 ** 63 + 5)],
                         ids=["greedy", "seeded", "seeded_top_k_top_p"])
def test_verified_guesses_give_the_tokens_of_one_at_a_time_decoding(small_runner, sampling):
    """Guesses right, wrong and mixed, several sequences in one step beside a plain decode: every kept token
    is the one-at-a-time token (greedy and seeded: a position's draw depends on seed and position only)."""
    prompt = [1, 5, 2, 7, 3]
    want = _decode(small_runner, "ref", prompt, 24, sampling, first_block=0)
    tokens = [want[0]]
    runner = small_runner
    table = list(range(32, 48))
    other_table = list(range(64, 80))
    runner.step([SeqInput("spec", prompt, 0, table, True, sampling),
                 SeqInput("other", prompt, 0, other_table, True, sampling)])
    other = [want[0]]
    step = 0
    while len(tokens) < 20:
        step += 1
        truth = want[len(tokens):len(tokens) + 4]
        guesses = [t if (step + i) % 3 else (t + 1) % SMALL_VOCAB for i, t in enumerate(truth)]  # some wrong
        position = len(prompt) + len(tokens) - 1
        out = runner.step([
            SeqInput("other", [other[-1]], len(prompt) + len(other) - 1, other_table, True, sampling),
            SeqInput("spec", [tokens[-1], *guesses], position, table, True, sampling, num_spec=len(guesses)),
        ])
        assert out.rids == ["other", "spec"] and out.num_tokens[0] == 1
        other.append(out.token_ids[0])
        kept = out.token_ids[1:]
        assert len(kept) == out.num_tokens[1] and 1 <= len(kept) <= len(guesses) + 1
        assert kept[:-1] == guesses[:len(kept) - 1]  # the kept guesses, then a sample
        tokens += kept
    runner.drop(["spec", "other"])
    assert tokens[:20] == want[:20]
    assert other == want[:len(other)]


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    expected = p * counts.sum()
    keep = expected >= 5
    return float((((counts - expected) ** 2) / expected)[keep].sum()), int(keep.sum()) - 1


def test_kept_tokens_follow_the_target_distribution(small_runner):
    """For a guess the target finds plausible but not likely, the first kept token over thousands of seeds is
    distributed as the target's own next-token distribution (chi-square). A naive rule that keeps a
    plausible guess (probability above uniform) would always output the guess: the same test rejects it."""
    prompt = [3, 1, 4, 1, 5]
    probe = small_runner.step([SeqInput("q", prompt, 0, [0, 1], True, SamplingParams(top_n_tokens=SMALL_VOCAB))])
    small_runner.drop(["q"])
    ids, logprobs = probe.top_tokens[0]
    p = torch.zeros(SMALL_VOCAB)
    p[torch.tensor(ids)] = torch.tensor(logprobs).exp()
    p = p / p.sum()
    order = torch.argsort(p, descending=True)
    guess = next(int(t) for t in order[1:] if p[t] >= 1 / SMALL_VOCAB)  # plausible, not the argmax
    counts = torch.zeros(SMALL_VOCAB)
    seed = 0
    for _ in range(40):
        seqs = []
        for i in range(64):
            seed += 1
            seqs.append(SeqInput(f"s{seed}", prompt + [guess], 0, [2 * i + 2, 2 * i + 3], True,
                                 SamplingParams(do_sample=True, seed=seed), num_spec=1))
        out = small_runner.step(seqs)
        small_runner.drop([s.rid for s in seqs])
        offset = 0
        for n in out.num_tokens:
            counts[out.token_ids[offset]] += 1
            offset += n
    chi2, dof = _chi2(counts, p)
    bound = dof + 4 * math.sqrt(2 * dof)  # about 4 standard deviations above the mean of chi2(dof)
    assert chi2 < bound, (chi2, dof, counts.tolist(), (p * counts.sum()).tolist())
    assert 0 < counts[guess] < counts.sum()
    naive = torch.zeros(SMALL_VOCAB)
    naive[guess] = counts.sum()
    assert _chi2(naive, p)[0] > bound


# ---------------------------------------------------------------------------------------------- stack

PASSAGE = ("The river town grew around a stone bridge built in the twelfth century. Merchants crossed it with "
           "wool and salt, and a market square formed at its northern end.")
GROUNDED = [f"Repeat this exactly: {PASSAGE}\nRepeated: ",
            "Copy the list: apples, pears, plums, cherries, apples, pears, plums, cherries.\nCopy: ",
            "def add(a, b):\n    return a + b\n\n# the same function again\n"]


def test_smollm2_speculating_server_keeps_transformers_greedy_tokens(smollm2_server, smollm2_transformers):
    """The shared SmolLM2 server runs with --speculate 4: grounded prompts alone and beside other requests
    give transformers' float32 greedy tokens, guesses are proposed and kept (/metrics), and streams cut
    mid-way leave every KV block free."""
    from concurrent.futures import ThreadPoolExecutor

    from llmbus.testing.greedy import greedy_reference, served_greedy
    from llmbus.testing.http import all_blocks_free, metrics, wait_for_metrics
    from llmbus.workers.placement import resolve_dtype

    if resolve_dtype("auto", torch.device("cpu")) != torch.float32:
        pytest.skip("the shared server computes in bf16 here; exactness is checked in float32")
    model, tokenizer = smollm2_transformers
    want = [greedy_reference(model, tokenizer, prompt, 32) for prompt in GROUNDED]
    before = metrics(smollm2_server.url)
    for prompt, expected in zip(GROUNDED, want):
        assert served_greedy(smollm2_server, prompt, 32) == expected, prompt
    after = metrics(smollm2_server.url)
    proposed = after["llmbus_speculative_proposed_tokens_total"] - before["llmbus_speculative_proposed_tokens_total"]
    accepted = after["llmbus_speculative_accepted_tokens_total"] - before["llmbus_speculative_accepted_tokens_total"]
    assert proposed > 0 and 0 < accepted <= proposed, (proposed, accepted)
    assert "acceptance_rate=" in smollm2_server.stderr.text  # the request log line says how guesses went
    # beside each other and beside requests that do not speculate (penalised, sampled with top_n_tokens)
    with ThreadPoolExecutor(6) as pool:
        together = [pool.submit(served_greedy, smollm2_server, p, 32) for p in GROUNDED]
        others = [pool.submit(post_generate, smollm2_server, GROUNDED[0], params) for params in (
            {"repetition_penalty": 1.3}, {"do_sample": True, "seed": 3, "top_n_tokens": 2}, {})]
        assert [f.result() for f in together] == want
        assert all(f.result() for f in others)
    # cancelled speculative streams return their blocks
    import http.client
    import json

    host, port = smollm2_server.url.removeprefix("http://").split(":")
    for prompt in GROUNDED * 2:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/generate_stream", json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 200}}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = 0
        while events < 6:
            events += resp.readline().startswith(b"data:")
        conn.close()
    wait_for_metrics(smollm2_server.url, all_blocks_free)


def post_generate(server, prompt: str, params: dict) -> str:
    from llmbus.testing.http import post

    status, _, body = post(f"{server.url}/generate", {"inputs": prompt, "parameters": {"max_new_tokens": 16, **params}})
    assert status == 200, body
    return body["generated_text"]


def test_tensor_parallel_ranks_verify_guesses_as_one(tmp_path):
    """At TP=2 (two gloo ranks) guesses kept and rejected in a continuous batch (chunked prefills beside,
    a preemption) give transformers' greedy tokens: rank 1 computes the same guessed positions, and learns
    what was kept from the next step, as from any step."""
    from llmbus.testing.runner_driver import drive_tensor_parallel, make_prompts, mixed_requests, reference

    path = str(tmp_path / "model")
    save_tiny_llama(path, tied=False, vocab_size=509)
    prompts = make_prompts(509)
    ref = reference(path, prompts)
    requests = mixed_requests(prompts)
    for req, tokens in zip(requests, ref.tokens):
        req.speculate, req.oracle = 3, tokens
    requests[1].preempt_after, requests[1].resume_cached_blocks = 5, 1
    out = drive_tensor_parallel(path, {"spec": requests}, str(tmp_path))["spec"]
    for req, tokens in zip(requests, ref.tokens):
        assert out[req.rid][0] == tokens, req.rid


@pytest.fixture(scope="module")
def checkpoint_512(tmp_path_factory):
    from llmbus.testing.runner_driver import make_prompts, reference

    path = str(tmp_path_factory.mktemp("spec512"))
    save_tiny_llama(path, tied=True, vocab_size=512)
    prompts = make_prompts(512)
    return path, prompts, reference(path, prompts)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_guesses_of_every_length_in_a_mixed_batch_with_a_preemption(checkpoint_512, k):
    from llmbus.testing.runner_driver import drive, mixed_requests

    path, prompts, ref = checkpoint_512
    runner = ModelRunner(path, block_size=4, num_blocks=256, max_batch_prefill_tokens=512)
    requests = mixed_requests(prompts)
    for req, tokens in zip(requests, ref.tokens):
        req.speculate, req.oracle = k, tokens
    requests[2].preempt_after, requests[2].resume_cached_blocks = 4, 1
    done = drive(runner, requests)
    for req, tokens in zip(requests, ref.tokens):
        assert done[req.rid].tokens == tokens, req.rid
    assert sum(r.kept_guesses for r in requests) > 0 and requests[2].preemptions == 1


# ---------------------------------------------------------------------------------------------- draft model

def test_a_draft_model_guesses_and_the_output_stays_the_target_s(tmp_path):
    """Guesses from a draft with other weights (mostly wrong) and from the target itself (always right):
    transformers' tokens either way, and the right draft's guesses are kept."""
    from llmbus.testing.runner_driver import drive, make_prompts, mixed_requests, reference

    target, other = str(tmp_path / "target"), str(tmp_path / "other")
    save_tiny_llama(target, tied=True, vocab_size=512)
    torch.manual_seed(1)
    save_tiny_llama(other, tied=True, vocab_size=512)
    prompts = make_prompts(512)
    ref = reference(target, prompts)
    for draft_path in (other, target):
        runner = ModelRunner(target, block_size=4, num_blocks=256, max_batch_prefill_tokens=512)
        runner.attach_draft(ModelRunner(draft_path, block_size=4, num_blocks=256, max_batch_prefill_tokens=512))
        requests = mixed_requests(prompts)
        for req in requests:
            req.speculate = 3
        requests[3].preempt_after, requests[3].resume_cached_blocks = 5, 1  # the draft recomputes it too
        done = drive(runner, requests)
        for req, tokens in zip(requests, ref.tokens):
            assert done[req.rid].tokens == tokens, (draft_path, req.rid)
        if draft_path == target:
            assert all(r.kept_guesses > len(r.tokens) // 2 for r in requests), [r.kept_guesses for r in requests]


def test_draft_model_through_the_stack_at_tp2(tiny_model_dir, reference):
    """`llmbus up --gpus 2 --draft-model-id`, the tiny model drafting for itself (every guess right), a KV
    pool small enough to preempt: rank 0's draft guesses reach rank 1 by broadcast, greedy output is
    transformers', /metrics counts kept guesses under method="draft" and preemptions."""
    from concurrent.futures import ThreadPoolExecutor

    from llmbus.testing import Server
    from llmbus.testing.greedy import served_greedy
    from llmbus.testing.http import metrics
    from llmbus.testing.tiny_prompts import QUESTIONS, SYSTEM

    prompts = [SYSTEM + q for q in QUESTIONS[:8]]
    want = [reference(p, 20) for p in prompts]
    server = Server(["--model-id", str(tiny_model_dir), "--draft-model-id", str(tiny_model_dir), "--speculate", "3",
                     "--gpus", "2", "--dtype", "float32", "--max-total-tokens", "96", "--max-input-tokens", "64",
                     "--num-blocks", "40", "--block-size", "4", "--max-batch-prefill-tokens", "24"])
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: served_greedy(server, p, 20), prompts))
        samples = metrics(server.url, labels=True)
    finally:
        assert server.stop() == 0, server.stderr.text[-3000:]
    for g, w in zip(got, want):
        assert g == w[:len(g)] and (len(g) == 20 or g[-1] == 1), (g, w)  # 1: the tiny model's EOS
    assert samples['llmbus_speculative_accepted_tokens_total{method="draft"}'] > 0, samples
    assert samples["llmbus_preemptions_total"] > 0, samples


def test_a_draft_with_another_vocabulary_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    import subprocess

    from llmbus.testing import free_port

    other = tmp_path / "other"
    save_tiny_llama(str(other), tied=True, vocab_size=509)
    proc = subprocess.run(["llmbus", "up", "--model-id", str(tiny_model_dir), "--draft-model-id", str(other),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "draft model's vocabulary (509 tokens)" in proc.stderr, proc.stderr[-2000:]
