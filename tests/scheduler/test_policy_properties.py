"""Property tests of the scheduling policy over random arrivals, finishes, aborts and preemptions.

Every step the simulated worker (llmbus.testing.policy_sim) checks that block tables built from the step
diffs match the scheduler's, that every position a sequence relies on holds K/V of that very prefix,
and that no two sequences write one slot; after every step the KV accounting is checked (no block owned
twice or leaked, the prefix cache's invariant); budgets are checked per step; at the end every request
that was not aborted has finished with the tokens it would have produced alone.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import SamplingParams, StoppingParams
from llmbus.scheduler.kv_blocks import KVBlockManager
from llmbus.scheduler.policy import Scheduler, SchedulerConfig
from llmbus.scheduler.requests import Request, RequestStatus
from llmbus.testing.policy_sim import SimWorker, check_budgets, solo_output

EOS = 3

request_st = st.fixed_dictionaries({
    "arrive_at": st.integers(0, 40),
    "prompt": st.lists(st.integers(10, 13), min_size=1, max_size=30),  # few symbols: prefixes get shared
    "shared_prefix": st.integers(0, 3),  # how many 4-token "system prompt" blocks lead the prompt
    "max_new_tokens": st.integers(1, 12),
    "abort_after": st.one_of(st.none(), st.integers(0, 30)),
    "prompt_logprobs": st.booleans(),
})

config_st = st.fixed_dictionaries({
    "num_blocks": st.integers(12, 40),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "prefill": st.integers(1, 48),
    "max_batch_size": st.one_of(st.none(), st.integers(1, 6)),
    "chunking": st.booleans(),
    "caching": st.booleans(),
    "collide": st.booleans(),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=config_st, specs=st.lists(request_st, min_size=1, max_size=12))
def test_random_workloads_keep_every_invariant(config, specs):
    kv = KVBlockManager(config["num_blocks"], config["block_size"], prefix_caching=config["caching"],
                        **({"hash_fn": lambda chunk: len(chunk)} if config["collide"] else {}))
    s = Scheduler(SchedulerConfig(config["prefill"], config["max_batch_size"],
                                  prefill_chunking=config["chunking"], waiting_served_ratio=0.5,
                                  max_waiting_tokens=3), kv)
    worker = SimWorker(config["block_size"], eos=EOS)
    system = [20, 21, 22, 23] * 3
    requests, refused = [], set()
    for i, spec in enumerate(specs):
        prompt = system[:4 * spec["shared_prefix"]] + spec["prompt"]
        requests.append((spec, Request(rid=f"r{i}", frontend_id="f", prompt_ids=prompt,
                                       sampling=SamplingParams(),
                                       stopping=StoppingParams(spec["max_new_tokens"], [EOS]),
                                       prompt_logprobs=spec["prompt_logprobs"])))
    aborted = set()
    step = 0
    while step < 2000:
        for spec, req in requests:
            if spec["arrive_at"] == step:
                try:
                    s.add(req)
                except ValueError:
                    refused.add(req.rid)  # can never fit the pool: refused up front, never admitted
            if (spec["abort_after"] is not None and spec["arrive_at"] + spec["abort_after"] == step
                    and req.status is not RequestStatus.FINISHED and req.rid not in refused):
                if s.abort([req.rid]):
                    aborted.add(req.rid)
        batch = s.schedule()
        if batch is None:
            assert not s.has_work
            if step > max(spec["arrive_at"] for spec, _ in requests):
                break
            step += 1
            continue
        check_budgets(s, batch)
        sampled = worker.run(batch)
        if step % 5 == 0 and s.running:
            s.abort([])  # no-op aborts are harmless
        s.update(batch, sampled)
        kv.check([r.block_table for r in s.running])
        step += 1
    assert not s.has_work, "some admitted request never finished"
    for spec, req in requests:
        if req.rid in refused:
            assert len(req.prompt_ids) + spec["max_new_tokens"] - 1 > kv.num_blocks * kv.block_size
            continue
        assert req.status is RequestStatus.FINISHED
        if req.rid not in aborted:
            assert req.output_ids == solo_output(req.prompt_ids, spec["max_new_tokens"], EOS)
    # nothing leaked: every block is free or only cached, and the cache can give all of them back
    assert kv.num_available == kv.num_blocks
    kv.clear_cache()
    assert kv.num_free == kv.num_blocks


image_request_st = st.fixed_dictionaries({
    "arrive_at": st.integers(0, 20),
    # text runs between images, and each image's placeholder count
    "texts": st.lists(st.lists(st.integers(10, 13), min_size=1, max_size=8), min_size=2, max_size=4),
    "image_sizes": st.lists(st.integers(1, 12), min_size=3, max_size=3),
    "picture": st.sampled_from([b"a", b"b"]),  # the same picture twice: prefix hits that end inside an image
    "max_new_tokens": st.integers(1, 6),
})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(14, 40), block_size=st.sampled_from([1, 2, 4]), prefill=st.integers(1, 24),
       caching=st.booleans(), specs=st.lists(image_request_st, min_size=1, max_size=6))
def test_whole_images_are_never_cut_between_steps(num_blocks, block_size, prefill, caching, specs):
    """Where the ranks compute an image's placeholders in one step (Gemma 3's attend each other both ways), no
    step ends inside an image, whatever the budget, prefix hits (block-aligned, so they may end inside one) and
    preemptions (a small pool) do; a step exceeds the prefill budget only by the rest of an image it starts inside
    (one that starts before an image ends before it); and every request still gets the tokens it would have alone."""
    from llmbus.bus.messages import ImageInput

    kv = KVBlockManager(num_blocks, block_size, prefix_caching=caching)
    s = Scheduler(SchedulerConfig(prefill, None, prefill_chunking=True, whole_images=True), kv)
    worker = SimWorker(block_size, eos=EOS)
    requests, refused = [], set()
    for i, spec in enumerate(specs):
        prompt, images = list(spec["texts"][0]), []
        for text, size in zip(spec["texts"][1:], spec["image_sizes"]):
            images.append(ImageInput(offset=len(prompt), num_tokens=size, data=spec["picture"],
                                     digest=spec["picture"] * 16))
            prompt += [9] * size + text
        requests.append((spec, Request(rid=f"r{i}", frontend_id="f", prompt_ids=prompt, sampling=SamplingParams(),
                                       stopping=StoppingParams(spec["max_new_tokens"], [EOS]), images=images)))
    step = 0
    while step < 2000:
        for spec, req in requests:
            if spec["arrive_at"] == step:
                try:
                    s.add(req)
                except ValueError:
                    refused.add(req.rid)
        batch = s.schedule()
        if batch is None:
            if step > max(spec["arrive_at"] for spec, _ in requests):
                break
            step += 1
            continue
        overshoot = 0
        for seq in batch.seqs:
            start, end = seq.num_computed, seq.num_computed + len(seq.token_ids)
            for image in seq.request.images:
                first, stop = image.offset, image.offset + image.num_tokens
                assert not first < end < stop, (seq.request.rid, start, end, first, stop)
                if first <= start < stop:  # a step that starts inside an image takes its rest
                    overshoot = max(overshoot, stop - start)
        prefill_rows = sum(len(q.token_ids) for q in batch.seqs if not q.is_decode)
        decodes = sum(1 for q in batch.seqs if q.is_decode)
        assert prefill_rows <= max(prefill - decodes, 0) + overshoot
        s.update(batch, worker.run(batch))
        kv.check([r.block_table for r in s.running])
        step += 1
    assert not s.has_work
    for spec, req in requests:
        if req.rid not in refused:
            assert req.output_ids == solo_output(req.prompt_ids, spec["max_new_tokens"], EOS)
