"""The scheduling policy alone: hand-made requests and step results, no model, no sockets."""

import pytest

from llmbus.bus.messages import FinishReason, SamplingParams, StoppingParams
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request, RequestStatus
from llmbus.testing.policy_sim import SimWorker, drive, solo_output


def make_request(rid: str, prompt_len: int = 4, max_new_tokens: int = 4, eos: int = 2, first: int = 10,
                 prompt: list[int] | None = None, prompt_logprobs: bool = False) -> Request:
    return Request(rid=rid, frontend_id="f0", prompt_ids=prompt or list(range(first, first + prompt_len)),
                   sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens, [eos]),
                   prompt_logprobs=prompt_logprobs)


def make_scheduler(num_blocks=64, block_size=4, prefill=4096, max_batch_size=None, chunking=True,
                   caching=True, hash_fn=None, **cfg) -> Scheduler:
    kv_kw = {"hash_fn": hash_fn} if hash_fn else {}
    return Scheduler(SchedulerConfig(prefill, max_batch_size, prefill_chunking=chunking, **cfg),
                     KVBlockManager(num_blocks, block_size, prefix_caching=caching, **kv_kw))


def step(s: Scheduler, token: int = 100):
    batch = s.schedule()
    assert batch is not None
    events = s.update(batch, {seq.request.rid: (token, -0.5) for seq in batch.seqs if seq.sample})
    return batch, events


def rids(batch):
    return [q.request.rid for q in batch.seqs]


# ---------------------------------------------------------------------------------------------- basics

def test_new_requests_join_running_batch_between_steps():
    s = make_scheduler()
    s.add(make_request("a", max_new_tokens=10))
    b1, _ = step(s)
    assert rids(b1) == ["a"] and b1.seqs[0].num_computed == 0 and b1.concat_reason is None
    s.add(make_request("b", prompt_len=6, first=50))
    b2, _ = step(s)
    # a decodes one token, b is prefilled, in the same step
    assert [(q.request.rid, len(q.token_ids), q.num_computed) for q in b2.seqs] == [("a", 1, 4), ("b", 6, 0)]
    assert [r.rid for r in b2.new_requests] == ["b"] and b2.concat_reason == "chunking"
    assert s.counters.concat["chunking"] == 1


def test_length_finishes_before_eos_and_frees_blocks():
    s = make_scheduler(num_blocks=8, block_size=4, caching=False)
    s.add(make_request("a", prompt_len=4, max_new_tokens=2))
    step(s, token=100)
    assert s.kv.num_free == 8 - 1  # the prompt's block only: blocks grow as tokens come
    _, events = step(s, token=2)  # EOS id on the last allowed token: TGI reports length
    assert events[0].finish_reason is FinishReason.LENGTH
    assert s.kv.num_free == 8 and not s.has_work


def test_eos_finishes_and_ignore_eos_does_not():
    s = make_scheduler()
    s.add(make_request("a", max_new_tokens=5))
    r = make_request("b", max_new_tokens=5, first=40)
    r.stopping.ignore_eos = True
    s.add(r)
    _, events = step(s, token=2)
    reasons = {e.request.rid: e.finish_reason for e in events}
    assert reasons == {"a": FinishReason.EOS_TOKEN, "b": FinishReason.NONE}
    batch = s.schedule()
    assert batch.finished_rids == ["a"]  # workers are told to drop a's state


def test_request_stop_ids_end_it_as_eos_does_and_under_ignore_eos():
    """vLLM's stop_token_ids end a request as EOS does, ignore_eos or not. min_tokens is no rule here: rank 0 masks
    the stop ids until then, and lets one through only where a complete grammar allows nothing else, which must
    end the request."""
    s = make_scheduler()
    plain = make_request("a", max_new_tokens=8)
    plain.stopping.request_stop_ids = [7]
    ignoring = make_request("b", max_new_tokens=8, first=40)
    ignoring.stopping.ignore_eos, ignoring.stopping.request_stop_ids = True, [7]
    held = make_request("c", max_new_tokens=8, first=60)
    held.sampling = SamplingParams(min_new_tokens=4)
    for r in (plain, ignoring, held):
        s.add(r)
    reasons = []
    for token in (5, 2, 7):
        _, events = step(s, token=token)
        reasons.append({e.request.rid: e.finish_reason for e in events})
    assert reasons == [{"a": FinishReason.NONE, "b": FinishReason.NONE, "c": FinishReason.NONE},
                       {"a": FinishReason.EOS_TOKEN, "b": FinishReason.NONE, "c": FinishReason.EOS_TOKEN},
                       {"b": FinishReason.EOS_TOKEN}]


def test_request_that_can_never_fit_is_refused():
    s = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the 8"):
        s.add(make_request("a", prompt_len=4, max_new_tokens=6))


def test_abort_waiting_and_running():
    s = make_scheduler(num_blocks=16, block_size=4, max_batch_size=1, caching=False)
    s.add(make_request("a", max_new_tokens=10))
    s.add(make_request("b"))
    batch = s.schedule()
    aborted = s.abort(["a", "b", "unknown"])
    assert {r.rid for r in aborted} == {"a", "b"}
    assert all(r.status is RequestStatus.FINISHED for r in aborted)
    assert s.kv.num_free == 16
    # the in-flight step's token for an aborted request is dropped
    assert s.update(batch, {"a": (100, 0.0)}) == []
    assert not s.has_work
    assert s.schedule() is None


def test_release_more_than_taken_is_caught():
    kv = KVBlockManager(4, 16, prefix_caching=False)
    blocks = kv.allocate(2)
    kv.release(blocks)
    with pytest.raises(AssertionError):
        kv.release(blocks[:1])


# ------------------------------------------------------------- TGI's queue tests (backends/v3 queue.rs)
# TGI's entries there have an empty prompt and max_new_tokens 1; ours carry one prompt token, so a
# budget of n tokens admits n of them. Without chunking, as in those tests.

def one_token(rid: str) -> Request:
    return make_request(rid, prompt_len=1, max_new_tokens=1, first=10 + len(rid))


def test_next_batch_min_size():
    s = make_scheduler(prefill=8, chunking=False, waiting_served_ratio=1.0, max_waiting_tokens=100)
    s.add(make_request("run1", max_new_tokens=50))
    s.add(make_request("run2", max_new_tokens=50, first=30))
    b = s.schedule()
    assert rids(b) == ["run1", "run2"]
    s.update(b, {"run1": (100, 0.0), "run2": (100, 0.0)})
    s.add(one_token("c"))
    # A batch of 2 runs and the ratio is 1.0: one waiting request is not worth pausing it for.
    b = s.schedule()
    assert rids(b) == ["run1", "run2"] and [(r.rid, r.block_table) for r in s.waiting] == [("c", [])]
    s.update(b, {"run1": (100, 0.0), "run2": (100, 0.0)})
    s.add(one_token("d"))
    b = s.schedule()  # now two wait: admitted together, in order
    assert rids(b) == ["run1", "run2", "c", "d"] and b.concat_reason == "backpressure"


def test_next_batch_min_size_gives_way_after_max_waiting_tokens():
    s = make_scheduler(prefill=8, chunking=False, waiting_served_ratio=1.0, max_waiting_tokens=3)
    s.add(make_request("run1", max_new_tokens=50))
    s.add(make_request("run2", max_new_tokens=50, first=30))
    step(s)
    s.add(one_token("c"))
    seen = [rids(step(s)[0]) for _ in range(3)]
    # steps without admission: 1 (c alone is below min_size 2), 2, then 3 = max_waiting_tokens
    assert seen[:2] == [["run1", "run2"]] * 2 and seen[2] == ["run1", "run2", "c"]
    assert s.counters.concat == {"chunking": 0, "backpressure": 0, "wait_exceeded": 1}


def test_next_batch_max_size():
    s = make_scheduler(prefill=2, chunking=False, max_batch_size=1)
    s.add(one_token("a"))
    s.add(one_token("b"))
    b = s.schedule()
    assert rids(b) == ["a"] and [r.rid for r in s.waiting] == ["b"]


def test_next_batch_token_budget():
    s = make_scheduler(prefill=1, chunking=False)
    s.add(one_token("a"))
    s.add(one_token("b"))
    b = s.schedule()
    assert rids(b) == ["a"] and [r.rid for r in s.waiting] == ["b"]
    s.update(b, {"a": (100, 0.0)})  # a finishes (max_new_tokens 1)
    s.config.max_batch_prefill_tokens = 3
    s.add(one_token("c"))
    b = s.schedule()
    assert rids(b) == ["b", "c"]


def test_next_batch_dropped_receiver():
    # The client went away before its request was scheduled: the frontend aborts it, nothing runs.
    s = make_scheduler()
    s.add(one_token("a"))
    s.abort(["a"])
    assert s.schedule() is None and not s.has_work


def test_prefill_budget_and_head_of_line_without_chunking():
    s = make_scheduler(prefill=10, chunking=False)
    for rid, n, first in (("a", 6, 10), ("b", 6, 30), ("c", 2, 50)):
        s.add(make_request(rid, prompt_len=n, first=first))
    b1 = s.schedule()
    # b does not fit in the budget, and c may not jump the queue
    assert rids(b1) == ["a"]


def test_oversized_prompt_admitted_alone_without_chunking():
    s = make_scheduler(prefill=4, chunking=False)
    s.add(make_request("a", prompt_len=6))
    assert rids(s.schedule()) == ["a"]


# ------------------------------------------------------------------------------------ chunked prefill

def test_long_prompt_is_chunked_beside_running_decodes():
    s = make_scheduler(prefill=8, block_size=4)
    for i in range(3):
        s.add(make_request(f"r{i}", prompt_len=2, max_new_tokens=30, first=10 + 5 * i))
    step(s)
    s.add(make_request("long", prompt_len=20, max_new_tokens=3, first=200))
    chunks = []
    while True:
        b, _ = step(s)
        assert {"r0", "r1", "r2"} <= set(rids(b)), "a running stream was paused"
        seq = next(q for q in b.seqs if q.request.rid == "long")
        chunks.append((seq.num_computed, len(seq.token_ids), seq.sample))
        if seq.sample:
            break
    # 8 tokens per step, 3 of them decodes: 5 prompt tokens per step, sampling after the last chunk
    assert chunks == [(0, 5, False), (5, 5, False), (10, 5, False), (15, 5, True)]


def test_chunking_on_and_off_give_the_same_tokens():
    outputs = {}
    for chunking in (True, False):
        s = make_scheduler(prefill=16 if chunking else 64, block_size=4, chunking=chunking)
        reqs = [make_request(f"r{i}", prompt_len=3 + 11 * i, max_new_tokens=8, first=7 * i) for i in range(5)]
        for r in reqs:
            s.add(r)
        drive(s, SimWorker(4))
        outputs[chunking] = {r.rid: r.output_ids for r in reqs}
    assert outputs[True] == outputs[False]
    assert outputs[True]["r4"] == solo_output(list(range(28, 28 + 47)), 8)


# --------------------------------------------------------------------------------------- prefix cache

def test_shared_prefix_skips_cached_blocks():
    s = make_scheduler(block_size=4)
    system = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prompt=system + [1, 2, 3], max_new_tokens=2)
    s.add(a)
    worker = SimWorker(4)
    drive(s, worker)
    b = make_request("b", prompt=system + [7, 8], max_new_tokens=4)
    s.add(b)
    batch = s.schedule()
    seq = batch.seqs[0]
    assert seq.num_computed == 12 and seq.token_ids == [7, 8]
    assert s.counters.prefix_cache_hit_tokens == 12
    s.update(batch, worker.run(batch))
    drive(s, worker)
    assert b.output_ids == solo_output(system + [7, 8], 4)


def test_fully_cached_prompt_still_computes_its_last_block():
    s = make_scheduler(block_size=4)
    worker = SimWorker(4)
    prompt = list(range(100, 108))  # exactly 2 blocks
    s.add(make_request("a", prompt=prompt, max_new_tokens=1))
    drive(s, worker)
    s.add(make_request("b", prompt=prompt, max_new_tokens=1))
    batch = s.schedule()
    # the whole prompt is cached, but a token must run to produce logits: the last block is recomputed
    # (into a fresh block: a shared one is never written)
    assert batch.seqs[0].num_computed == 4 and batch.seqs[0].token_ids == prompt[4:]


def test_prompt_logprobs_requests_do_not_reuse_the_cache():
    s = make_scheduler(block_size=4)
    worker = SimWorker(4)
    prompt = list(range(100, 112))
    s.add(make_request("a", prompt=prompt + [1], max_new_tokens=1))
    drive(s, worker)
    s.add(make_request("b", prompt=prompt + [1], max_new_tokens=1, prompt_logprobs=True))
    assert s.schedule().seqs[0].num_computed == 0


def test_a_prefix_is_shared_within_one_lora_adapter_only():
    """The same tokens have other K/V under an adapter's projections: a cached prefix serves requests of the
    adapter (or base model) that computed it, and no other."""
    s = make_scheduler(block_size=4)
    worker = SimWorker(4)
    prompt = list(range(100, 112)) + [1]
    for rid, adapter in (("base", ""), ("sql", "sql")):
        s.add(make_request(rid, prompt=prompt, max_new_tokens=1))
        s.waiting[-1].adapter = adapter
        drive(s, worker)
    for rid, adapter, computed in (("base2", "", 12), ("sql2", "sql", 12), ("poet", "poet", 0)):
        request = make_request(rid, prompt=prompt, max_new_tokens=1)
        request.adapter = adapter
        s.add(request)
        batch = s.schedule()
        assert batch.seqs[0].num_computed == computed, rid
        s.update(batch, worker.run(batch))
        drive(s, worker)
    s.kv.clear_cache()
    assert s.kv.num_free == s.kv.num_blocks  # every adapter's tree is evicted alike


def test_a_prefix_holding_an_image_is_shared_only_with_the_same_image():
    """An image's placeholders are the same token ids whatever the image: the prefix cache keys them by the
    image's digest, so the blocks of one image serve the same image at the same place, never another one;
    the text before it is shared all the same. The ranks get the token ids and the images, never the keys."""
    from llmbus.bus.messages import ImageInput

    s = make_scheduler(block_size=4)
    worker = SimWorker(4)
    prompt = list(range(100, 108)) + [9] * 8 + [1, 2, 3]  # text (2 blocks), an image (2 blocks), text

    def image_request(rid, picture: bytes, offset=8):
        return Request(rid=rid, frontend_id="f0", prompt_ids=list(prompt), sampling=SamplingParams(),
                       stopping=StoppingParams(1, [2]),
                       images=[ImageInput(offset=offset, num_tokens=8, data=picture, digest=picture * 16)])

    s.add(image_request("cat", b"c"))
    drive(s, worker)
    # (request, tokens the cache serves, offsets of the images the ranks must still encode)
    for request, computed, to_encode in ((image_request("cat again", b"c"), 16, []),
                                         (image_request("dog", b"d"), 8, [8]),
                                         (make_request("text", prompt=prompt, max_new_tokens=1), 8, []),
                                         (image_request("cat later", b"c", offset=9), 8, [9])):
        s.add(request)
        batch = s.schedule()
        seq = batch.seqs[0]
        assert seq.num_computed == computed, request.rid
        assert seq.token_ids == prompt[computed:]
        new = batch.new_requests[0]
        sent = new.images_from(computed)
        assert [image.offset for image in sent if image.data] == to_encode
        assert [image.offset for image in sent] == [image.offset for image in new.images]  # the rest as stubs
        s.update(batch, worker.run(batch))
        drive(s, worker)


def test_a_step_takes_new_images_up_to_the_limit_past_its_first_request():
    """A step command carries its new requests' images: past the first request, admission stops before they
    would exceed MAX_IMAGE_BYTES together, so the command stays far below the bus's payload limit."""
    from llmbus.bus.messages import MAX_IMAGE_BYTES, ImageInput

    s = make_scheduler(block_size=4)
    big = b"x" * (MAX_IMAGE_BYTES * 3 // 5)
    for rid in ("a", "b", "c"):
        s.add(Request(rid=rid, frontend_id="f0", prompt_ids=[5] * 4, sampling=SamplingParams(),
                      stopping=StoppingParams(3, [2]),
                      images=[ImageInput(offset=0, num_tokens=4, data=big, digest=bytes(16))]))
    s.add(make_request("text", prompt_len=4))
    first = s.schedule()
    assert [r.rid for r in first.new_requests] == ["a"]
    s.update(first, {seq.request.rid: (100, -0.5) for seq in first.seqs if seq.sample})
    assert [r.rid for r in s.schedule().new_requests] == ["b"]


def _cached_tokens_of_new_requests(s):
    """``computed_for(rid, prompt)``: run a one-token request to the end, and say how many of its prompt's
    tokens the prefix cache served."""
    worker = SimWorker(4)

    def computed_for(rid, prompt):
        s.add(make_request(rid, prompt=prompt, max_new_tokens=1))
        batch = s.schedule()
        s.update(batch, worker.run(batch))
        drive(s, worker)
        return batch.seqs[0].num_computed

    return computed_for


def test_longrope_prompts_past_the_original_length_cache_their_prefixes_apart():
    """A LongRoPE model rotates a prompt past its original length with the long factors from its first token:
    the same tokens have other K/V in a shorter prompt. Prefixes are shared among prompts on one side of it
    (rope_split_tokens, from WorkerReady) and never across."""
    s = make_scheduler(block_size=4, rope_split_tokens=10)
    computed_for = _cached_tokens_of_new_requests(s)
    shared = list(range(100, 108))  # two blocks
    assert computed_for("short", shared + [1]) == 0  # 9 tokens: within the original length
    assert computed_for("long", shared + [1, 2, 3, 4]) == 0  # 12: past it, not served the short one's blocks
    assert computed_for("short2", shared + [5, 6]) == 8  # 10: within, the short one's
    assert computed_for("long2", shared + [7, 8, 9, 10, 11]) == 8  # 13: past, the long one's


def test_dynamic_ntk_prompts_past_the_original_length_share_prefixes_only_at_their_length():
    """A dynamic NTK model rotates a prompt past its original length with a base its own length picks: prefixes
    are shared within the original length, and past it only among prompts of the same length."""
    s = make_scheduler(block_size=4, rope_split_tokens=10, rope_split_by_length=True)
    computed_for = _cached_tokens_of_new_requests(s)
    shared = list(range(100, 108))  # two blocks
    assert computed_for("short", shared + [1]) == 0
    assert computed_for("long12", shared + [1, 2, 3, 4]) == 0  # past it: not the short one's blocks
    assert computed_for("long13", shared + [5, 6, 7, 8, 9]) == 0  # another length: not the 12-token one's
    assert computed_for("again12", shared + [7, 8, 9, 10]) == 8  # the same length: the 12-token one's
    assert computed_for("short2", shared + [5, 6]) == 8  # within: the short one's


def test_prefix_caching_off():
    s = make_scheduler(block_size=4, caching=False)
    worker = SimWorker(4)
    for rid in "ab":
        s.add(make_request(rid, prompt=list(range(100, 113)), max_new_tokens=1))
        batch = s.schedule()
        assert batch.seqs[0].num_computed == 0
        s.update(batch, worker.run(batch))
    assert s.kv.num_free == s.kv.num_blocks and s.kv.num_cached == 0


def test_a_running_requests_prompt_is_reusable_before_it_finishes():
    s = make_scheduler(block_size=4)
    worker = SimWorker(4)
    system = list(range(100, 108))
    s.add(make_request("a", prompt=system + [1], max_new_tokens=50))
    b = s.schedule()
    s.update(b, worker.run(b))
    s.add(make_request("b", prompt=system + [2], max_new_tokens=2))
    b = s.schedule()
    assert [(q.request.rid, q.num_computed) for q in b.seqs] == [("a", 9), ("b", 8)]
    # the two share blocks now: a's first two are b's first two
    assert s.running[0].block_table[:2] == s.running[1].block_table[:2]
    s.update(b, worker.run(b))
    drive(s, worker)


def test_hash_collisions_cannot_mix_up_prefixes():
    s = make_scheduler(block_size=4, hash_fn=lambda chunk: 0)  # every chunk collides
    worker = SimWorker(4)
    prompts = [[i, i + 1, i + 2, i + 3] * 3 + [5] for i in range(0, 40, 4)] + [[0, 1, 2, 3] * 2 + [9] * 5]
    reqs = [make_request(f"r{i}", prompt=p, max_new_tokens=3) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
        drive(s, worker)  # one by one, so later ones find earlier ones cached
    for r, p in zip(reqs, prompts):
        assert r.output_ids == solo_output(p, 3)
    assert s.counters.prefix_cache_hit_tokens == 8  # only the last one shares two real blocks


def test_lru_leaves_are_evicted_first():
    s = make_scheduler(num_blocks=6, block_size=4)
    worker = SimWorker(4)
    old, new = list(range(100, 109)), list(range(200, 209))
    for rid, prompt in (("old", old), ("new", new)):
        s.add(make_request(rid, prompt=prompt, max_new_tokens=1))
        drive(s, worker)
    assert s.kv.num_cached == 4 and s.kv.num_free == 2
    s.add(make_request("third", prompt=list(range(300, 311)), max_new_tokens=1))  # needs 3 blocks
    drive(s, worker)
    s.add(make_request("new-again", prompt=new[:8] + [5], max_new_tokens=1))
    assert s.schedule().seqs[0].num_computed == 8, "the more recently used prefix was evicted"


# ------------------------------------------------------------------------------------------- preemption

def test_youngest_is_preempted_and_recomputed_with_identical_output():
    s = make_scheduler(num_blocks=6, block_size=4, caching=False)
    reqs = [make_request(f"r{i}", prompt_len=4, max_new_tokens=12, first=20 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    preempted_at = []

    def watch(step):
        if s.counters.preemptions and not preempted_at:
            preempted_at.append([r.rid for r in s.waiting])

    drive(s, SimWorker(4), on_step=watch)
    assert s.counters.preemptions >= 1
    assert preempted_at[0][0] == "r2", "the most recently admitted request goes first"
    for r in reqs:
        assert r.output_ids == solo_output(r.prompt_ids, 12)
    assert s.kv.num_free == 6


def test_preempted_request_recomputes_prompt_and_generated_tokens():
    s = make_scheduler(num_blocks=4, block_size=4, caching=False)
    a = make_request("a", prompt_len=4, max_new_tokens=9)
    b = make_request("b", prompt_len=4, max_new_tokens=9, first=50)
    s.add(a)
    s.add(b)
    worker = SimWorker(4)
    recompute = None
    while s.has_work:
        batch = s.schedule()
        for seq in batch.seqs:
            if seq.request is b and b.num_preemptions and recompute is None:
                recompute = (seq.num_computed, list(seq.token_ids), seq.sample, list(b.output_ids))
        s.update(batch, worker.run(batch))
    n_computed, tokens, sample, outputs_then = recompute
    assert n_computed == 0 and tokens == b.prompt_ids + outputs_then and sample
    assert b.output_ids == solo_output(b.prompt_ids, 9)


def test_restart_after_a_lost_step_recomputes_everything_on_the_new_ranks():
    """The ranks died during a step (its result never came): on new ranks with an empty pool, every
    request resumes from its prompt and the tokens it had, with the output of an undisturbed run."""
    s = make_scheduler(num_blocks=32, block_size=4)
    reqs = [make_request(f"r{i}", prompt_len=5, max_new_tokens=10, first=20 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    worker = SimWorker(4)
    for _ in range(4):
        batch = s.schedule()
        s.update(batch, worker.run(batch))
    s.add(make_request("late", prompt_len=6, max_new_tokens=10, first=90))
    lost = s.schedule()  # sent, never answered
    assert [r.rid for r in lost.new_requests] == ["late"]
    had = {r.rid: list(r.output_ids) for r in reqs}
    assert s.restart(KVBlockManager(24, 4, prefix_caching=True)) == []
    assert [r.rid for r in s.waiting] == ["r0", "r1", "r2", "late"] and not s.running
    assert all(r.num_computed == 0 and not r.block_table for r in s.waiting)
    assert {r.rid: r.output_ids for r in reqs} == had  # nothing of the lost step was applied
    drive(s, SimWorker(4))  # a new worker: any read of the old ranks' K/V (or cached prefix) fails
    for r in reqs:
        assert r.output_ids == solo_output(r.prompt_ids, 10)
    assert s.kv.num_available == 24


def test_restart_onto_a_smaller_pool_drops_what_no_longer_fits():
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add(make_request("big", prompt_len=20, max_new_tokens=20))
    s.add(make_request("small", prompt_len=2, max_new_tokens=2, first=60))
    step(s)
    dropped = s.restart(KVBlockManager(4, 4))
    assert [r.rid for r in dropped] == ["big"] and [r.rid for r in s.waiting] == ["small"]


def test_preemption_reuses_the_victims_cached_blocks():
    s = make_scheduler(num_blocks=5, block_size=4)
    a = make_request("a", prompt_len=4, max_new_tokens=9)
    b = make_request("b", prompt_len=8, max_new_tokens=9, first=50)
    s.add(a)
    s.add(b)
    drive(s, SimWorker(4))
    assert s.counters.preemptions >= 1 and s.counters.prefix_cache_hit_tokens > 0
    assert b.output_ids == solo_output(b.prompt_ids, 9)


def test_preempted_mid_prompt_keeps_prompt_logprobs_in_order():
    s = make_scheduler(num_blocks=5, block_size=4, prefill=6)
    a = make_request("a", prompt_len=4, max_new_tokens=12)
    b = make_request("b", prompt_len=16, max_new_tokens=2, first=50, prompt_logprobs=True)
    s.add(a)
    s.add(b)
    events, inside_prompt = {}, False
    while s.has_work:
        batch = s.schedule()
        inside_prompt |= bool(b.num_preemptions and not b.output_ids)
        out = {seq.request.rid: (7, -0.5) for seq in batch.seqs if seq.sample}
        # the fake prompt logprob of a token is minus its position
        plp = {seq.request.rid: [-float(p) for p in range(max(1, seq.num_computed),
                                                           seq.num_computed + len(seq.token_ids))]
               for seq in batch.seqs if seq.request.wants_prompt_logprobs}
        for ev in s.update(batch, out, plp):
            events.setdefault(ev.request.rid, ev.prompt_logprobs) if ev.prompt_logprobs else None
    assert inside_prompt, "meant to preempt b inside its prompt"
    assert events["b"] == [-float(p) for p in range(1, 16)]
