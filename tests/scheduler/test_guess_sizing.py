"""Guess sizing (scheduler/speculation.py GuessRate) alone and in the policy: guesses sized by recent
acceptance, a brake that lets go when the output turns repetitive, probes that stay rare when guesses never
pay, and every request's tokens exactly its solo output whatever the guesses did."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import DRAFT_GUESS, SamplingParams, StoppingParams
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request
from llmbus.scheduler.speculation import PROBE_FIRST, PROBE_MAX, ROW_COST, GuessRate
from llmbus.testing.policy_sim import SimWorker, check_budgets, next_token, solo_output

NEVER_SAMPLED = 1  # the simulated model samples ids >= 10 (and an EOS only when asked)


# ---------------------------------------------------------------------------------------------- GuessRate

def _value(rate: float, k: int) -> float:
    """Expected tokens per unit of step cost of a k-token guess whose positions are each kept with ``rate``."""
    return sum(rate ** i for i in range(k + 1)) / (1 + ROW_COST * k)


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 1), st.integers(0, 8))
def test_the_guess_length_is_the_one_with_most_tokens_per_cost(rate, most):
    k = GuessRate(rate).best_length(most)
    best = max(_value(rate, j) for j in range(most + 1))
    assert 0 <= k <= most and math.isclose(_value(rate, k), best, rel_tol=1e-12)
    assert (k == 0) == (rate <= ROW_COST or most == 0)  # one guess pays exactly when it is kept more than it costs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), max_size=60))
def test_kept_guesses_raise_the_rate_and_a_rejected_one_lowers_it(verdicts):
    g = GuessRate()
    for kept, guessed in verdicts:
        kept = min(kept, guessed)
        before = g.rate
        g.observe(kept, guessed)
        assert 0.0 <= g.rate <= 1.0
        if kept == guessed:
            assert g.rate >= before
        elif kept == 0:
            assert g.rate <= before


def test_a_braked_request_probes_after_a_back_off_that_doubles_while_probes_fail():
    g = GuessRate(0.0)
    probes = [n for n in range(2000) if g.length(4, n, probe=True)]  # every probe fails: the rate stays 0
    gaps = [b - a for a, b in zip([0, *probes], probes)]
    assert gaps[0] == PROBE_FIRST and gaps[1] == 2 * PROBE_FIRST
    assert all(b == min(2 * a, PROBE_MAX) for a, b in zip(gaps[1:], gaps[2:]))
    assert GuessRate(0.0).length(4, 5000, probe=False) == 0  # n-gram lookup watches instead of probing


def test_a_probe_that_is_kept_resumes_guessing_and_a_recovery_resets_the_back_off():
    g = GuessRate(0.0)
    produced = 0
    while not g.length(4, produced, probe=True):
        produced += 1
    g.observe(1, 1)  # the probe was kept
    lengths = []
    for _ in range(6):
        produced += 1
        lengths.append(g.length(4, produced, probe=True))
        g.observe(lengths[-1], lengths[-1])  # ... and so is everything after it
    assert all(lengths) and lengths == sorted(lengths) and lengths[-1] == 4
    assert g.backoff == PROBE_FIRST


# ---------------------------------------------------------------------------------------------- policy

def _request(rid: str, prompt: list[int], max_new: int) -> Request:
    return Request(rid=rid, frontend_id="f0", prompt_ids=prompt, sampling=SamplingParams(),
                   stopping=StoppingParams(max_new, []))


class DraftingWorker(SimWorker):
    """The simulated ranks behind a draft model: before the step, each open guess (DRAFT_GUESS) is filled with
    the token the model samples there when ``right(request, position)``, else with one it never samples."""

    def __init__(self, block_size: int, right, copy_period: int | None = None):
        super().__init__(block_size, copy_period=copy_period)
        self.right = right

    def run(self, batch):
        for seq in batch.seqs:
            for i, token in enumerate(seq.token_ids):
                if token == DRAFT_GUESS:
                    prefix = seq.request.tokens(0, seq.num_computed) + seq.token_ids[:i]
                    good = self.right(seq.request, len(prefix))
                    seq.token_ids[i] = next_token(tuple(prefix), None, self.copy_period) if good else NEVER_SAMPLED
        return super().run(batch)


def _drive(s: Scheduler, worker: SimWorker, req: Request) -> list[tuple[int, int, int]]:
    """Run to the end; per decode step of ``req``: (output length before it, tokens guessed, guesses kept)."""
    trace = []
    while s.has_work:
        batch = s.schedule()
        check_budgets(s, batch)
        mine = [q for q in batch.seqs if q.request is req and q.is_decode]
        before, kept_before = len(req.output_ids), req.spec_accepted
        s.update(batch, worker.run(batch))
        s.kv.check([r.block_table for r in s.running])
        if mine:
            trace.append((before, mine[0].num_spec, req.spec_accepted - kept_before))
    return trace


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["ngram", "draft"]), st.integers(2, 5), st.integers(24, 80), st.integers(0, 2 ** 16))
def test_output_that_turns_repetitive_resumes_guessing(method, k, free, seed):
    """Free output (no guess is ever right) for ``free`` tokens, then output that repeats itself: the request
    stops guessing during the free part (where the first 24 guesses alone used to brake it for good) and
    guesses again, and keeps most guesses, once the output repeats. Tokens: exactly its solo output."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 30) for _ in range(8)]
    period = len(prompt) + free  # from output token `free` on, the model mostly copies its own output
    turn, max_new = free, free + 160
    s = Scheduler(SchedulerConfig(64, speculate=k, speculate_method=method), KVBlockManager(128, 4))
    req = _request("r", prompt, max_new)
    s.add(req)
    if method == "draft":  # a draft that is wrong on free output and right once it repeats
        worker = DraftingWorker(4, lambda r, position: position - len(r.prompt_ids) >= turn, copy_period=period)
    else:
        worker = SimWorker(4, copy_period=period)
    trace = _drive(s, worker, req)
    assert req.output_ids == solo_output(prompt, max_new, copy_period=period)
    free_part = [(guessed, kept) for at, guessed, kept in trace if at < turn]
    repeating = [(guessed, kept) for at, guessed, kept in trace if at >= turn]
    assert sum(kept for _, kept in free_part) <= 1  # (a hash the copy happens to hit)
    assert sum(guessed for guessed, _ in free_part) <= 3 + turn // PROBE_FIRST  # its first guesses, and probes
    assert any(guessed == 0 for guessed, _ in free_part)  # braked
    kept_late, guessed_late = sum(kept for _, kept in repeating), sum(guessed for guessed, _ in repeating)
    # resumed: an eighth of the tokens came free (the simulated model copies 3 tokens in 4, so some seeds keep
    # only a fifth: a quarter failed 4 examples in 1,500); and pays: each kept guess saves a step, each
    # guessed row costs ROW_COST of one
    assert kept_late >= 160 // 8, (kept_late, repeating)
    assert kept_late > ROW_COST * guessed_late, (kept_late, guessed_late)
    steps_late = len(repeating)
    assert steps_late < 160 - kept_late // 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["ngram", "draft"]), st.integers(1, 5), st.integers(20, 600))
def test_output_where_guesses_never_pay_guesses_rarely(method, k, max_new):
    """Guesses never right, for as long as the request runs: after its first few, n-gram guessing watches for
    free and spends no row; a draft probes once after each back-off, so its guessed rows stay a small bounded
    share of the output (at most one in PROBE_MAX tokens once the back-off has grown)."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    s = Scheduler(SchedulerConfig(64, speculate=k, speculate_method=method), KVBlockManager(256, 4))
    req = _request("r", prompt, max_new)
    s.add(req)
    worker = DraftingWorker(4, lambda r, position: False) if method == "draft" else SimWorker(4)
    _drive(s, worker, req)
    assert req.output_ids == solo_output(prompt, max_new)
    assert req.spec_accepted <= 1
    first = 3  # the prior's one-token guesses until three misses brake it
    if method == "ngram":
        assert req.spec_proposed <= first + 1
    else:
        growing = int(math.log2(PROBE_MAX // PROBE_FIRST)) + 1  # probes while the back-off doubles
        assert req.spec_proposed <= first + growing + max_new // PROBE_MAX


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["ngram", "draft"]), st.integers(1, 5), st.integers(1, 6), st.integers(6, 40),
       st.booleans(), st.integers(0, 2 ** 16))
def test_every_request_gets_its_solo_output_whatever_its_guesses_did(method, k, n_requests, num_blocks, caching,
                                                                    seed):
    """Requests that start free and turn repetitive at different points, side by side, with preemption (few
    blocks), chunked prompts and the prefix cache, guesses sized, braked, watched and probed: every token
    exactly once, in order (the solo output), never past max_new_tokens, every block back at the end."""
    rng = random.Random(seed)
    period = rng.randrange(2, 30)
    prompts = [[rng.randrange(10, 30) for _ in range(rng.randrange(1, 12))] for _ in range(n_requests)]
    max_new = [rng.randrange(1, 60) for _ in range(n_requests)]
    s = Scheduler(SchedulerConfig(16, prefill_chunking=True, speculate=k, speculate_max_batch=4,
                                  speculate_method=method), KVBlockManager(num_blocks, 4, prefix_caching=caching))
    reqs = [_request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    for r in reqs:
        if s.kv.blocks_for(r.max_kv_tokens) <= num_blocks:
            s.add(r)
    right = {}  # the draft is right or wrong at random, the same way each time a position is guessed
    worker = (DraftingWorker(4, lambda r, position: right.setdefault((r.rid, position), rng.random() < 0.6),
                             copy_period=period) if method == "draft" else SimWorker(4, copy_period=period))
    for _ in range(20_000):
        batch = s.schedule()
        if batch is None:
            break
        check_budgets(s, batch)
        s.update(batch, worker.run(batch))
        s.kv.check([r.block_table for r in s.running])
    assert not s.has_work
    for r in reqs:
        if r.status.value == "finished":
            assert r.output_ids == solo_output(r.prompt_ids, r.stopping.max_new_tokens, copy_period=period)
            assert r.spec_accepted <= r.spec_proposed
    assert s.counters.spec_accepted <= s.counters.spec_proposed
    assert s.kv.num_available == num_blocks
