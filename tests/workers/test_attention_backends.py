"""The attention backends agree with each other over the same steps: the CPU backend (the C decode
kernel reading the paged pool in place, the bf16 pool in its own layout, a float16 pool under float32
attention) against the portable torch
backend, over decodes alone, decodes beside a prompt chunk, sequences joining and leaving, a reordered
batch, GQA and a sliding window; and the portable backend's decode groups, split by context length, attend
as one padded group does while gathering at most PADDING_LIMIT times each sequence's own context."""

import pytest
import torch

from llmbus.workers.attention import CPUKernelBackend, TorchSDPABackend, make_attention_backend, torch_sdpa
from llmbus.workers.attention.decode_kernel import decode_attention_kernel
from llmbus.workers.kv_cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
KERNEL = decode_attention_kernel()


def _cache(dtype, block_size) -> PagedKVCache:
    """A pool of ``dtype``; a float16 one is a float32 model's narrower cache (--kv-cache-dtype float16)."""
    return PagedKVCache(num_layers=2, num_blocks=200, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                        head_dim=HEAD_DIM, dtype=dtype, device="cpu",
                        compute_dtype=torch.float32 if dtype == torch.float16 else dtype)


def _run(schedule, backends, caches, lengths, block_size, tolerance):
    """Steps of ``schedule`` (each: sequences in order with their query lengths) through every backend;
    outputs compared with the first's."""
    tables = {rid: list(range(i * 40, i * 40 + 40)) for i, rid in enumerate(lengths)}
    torch.manual_seed(0)
    for step in schedule:
        rids = list(step)
        args = dict(query_lens=[step[r] for r in rids], num_computed=[lengths[r] for r in rids],
                    block_tables=[tables[r][:-(-(lengths[r] + step[r]) // block_size)] for r in rids],
                    device=torch.device("cpu"))
        metas = [b.build_metadata(kv_cache=c, **args) for b, c in zip(backends, caches)]
        total = sum(step.values())
        activations = caches[0].compute_dtype
        for layer in range(2):
            q = torch.randn(total, NUM_HEADS, HEAD_DIM).to(activations)
            k, v = (torch.randn(total, NUM_KV_HEADS, HEAD_DIM).to(activations) for _ in range(2))
            outs = [b.forward(layer, q, k, v, c, m, scale=HEAD_DIM ** -0.5)
                    for b, c, m in zip(backends, caches, metas)]
            for out in outs[1:]:
                torch.testing.assert_close(out.float(), outs[0].float(), rtol=tolerance, atol=tolerance)
        for r in rids:
            lengths[r] += step[r]
    return metas


@pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is optional")
@pytest.mark.parametrize("dtype,block_size,tolerance", [(torch.float32, 4, 1e-5), (torch.float32, 16, 1e-5),
                                                        (torch.bfloat16, 16, 2e-2), (torch.float16, 16, 1e-5)])
def test_cpu_kernel_backend_equals_portable(dtype, block_size, tolerance):
    cpu, portable = CPUKernelBackend([None, 3], KERNEL), TorchSDPABackend([None, 3])
    caches = [_cache(dtype, block_size), _cache(dtype, block_size)]
    # Each step: the sequences (in order) and their query lengths; a 3-token query is a prompt chunk.
    schedule = ([{"a": 5, "b": 9, "c": 1}] + [{"a": 1, "b": 1, "c": 1}] * 7 + [{"a": 1, "b": 1, "c": 1, "d": 12}]
                + [{"a": 1, "b": 1, "c": 1, "d": 3}] * 2 + [{"a": 1, "b": 1, "c": 1, "d": 1}] * 3
                + [{"b": 1, "c": 1, "d": 1}] * 3 + [{"d": 1, "b": 1, "c": 1}] * 20)
    lengths = {"a": 0, "b": 0, "c": 0, "d": 0}
    metas = _run(schedule, [portable, cpu], caches, lengths, block_size, tolerance)
    assert type(metas[1].groups[0]).__name__ == "KernelRows"
    # The pools hold the same K/V, the CPU backend's bf16 blocks in the kernel's layout.
    for name in ("key", "value"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)) or dtype == torch.bfloat16
    assert torch.equal(torch.stack(KERNEL.to_layout(caches[0].key, caches[0].value)),
                       torch.stack((caches[1].key, caches[1].value)))


@pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is optional")
@pytest.mark.parametrize("block_size,dtype", [(4, torch.float32), (16, torch.float32), (16, torch.float16)])
def test_prompt_rows_equal_portable(block_size, dtype):
    """``prompt_rows``: a float32 step with prompts (over a float32 or float16 pool) is one kernel group,
    every token a row of its own that attends its sequence up to itself (a sliding window too), and attends
    as the portable backend does, whatever the step's length (the scores scratch is one slot a thread:
    a long step is never sent to another algorithm)."""
    rows, portable = CPUKernelBackend([None, 3], KERNEL, prompt_rows=True), TorchSDPABackend([None, 3])
    caches = [_cache(dtype, block_size), _cache(dtype, block_size)]
    schedule = ([{"a": 5, "b": 9, "c": 1}] + [{"a": 1, "b": 1, "c": 1}] * 3 + [{"a": 1, "b": 1, "c": 1, "d": 12}]
                + [{"a": 1, "b": 1, "d": 3}] + [{"b": 1, "d": 1}] * 2)
    lengths = {"a": 0, "b": 0, "c": 0, "d": 0}
    metas = _run(schedule[:1], [portable, rows], caches, lengths, block_size, 1e-5)
    assert [type(g).__name__ for g in metas[1].groups] == ["KernelRows"] and metas[1].kernel_rows is metas[1].groups[0]
    assert metas[1].groups[0].context_lens.tolist() == [1, 2, 3, 4, 5, *range(1, 10), 1]
    _run(schedule[1:], [portable, rows], caches, lengths, block_size, 1e-5)
    metas = _run([{"a": 1, "e": 40}], [portable, rows], caches, {**lengths, "e": 0}, block_size, 1e-5)
    assert [type(g).__name__ for g in metas[1].groups] == ["KernelRows"]


def test_decode_groups_split_by_context_length(monkeypatch):
    """One long conversation beside short ones: its context is gathered alone, not every short one
    padded to it; outputs equal one padded group's."""
    block_size = 4
    caches = [_cache(torch.float32, block_size), _cache(torch.float32, block_size)]
    split, padded = TorchSDPABackend([None]), TorchSDPABackend([None])
    lengths = {"long": 0, "s1": 0, "s2": 0, "s3": 0}
    prompt = {"long": 150, "s1": 3, "s2": 5, "s3": 2}
    _run([prompt], [split, padded], caches, lengths, block_size, 1e-5)
    step = {"s1": 1, "long": 1, "s2": 1, "s3": 1}
    monkeypatch.setattr(torch_sdpa, "PADDING_LIMIT", float("inf"))
    one_group = _run([step], [padded], caches[1:], dict(lengths), block_size, 1e-5)[0]
    monkeypatch.undo()
    metas = _run([step] * 3, [split, padded], caches, lengths, block_size, 1e-5)
    assert len(one_group.groups) == 1 and one_group.groups[0].block_index.numel() == 4 * 38
    gathered = sum(g.block_index.numel() for g in metas[0].groups)
    own = sum(-(-n // block_size) for n in lengths.values())
    assert len(metas[0].groups) == 2 and gathered <= torch_sdpa.PADDING_LIMIT * own


def test_backend_choice():
    cpu = make_attention_backend(torch.device("cpu"), [None, 7])
    assert cpu.name == ("cpu_kernel" if KERNEL is not None else "torch_sdpa")
    assert cpu.windows == (None, 7) and cpu.window_index(1) == 1
    assert make_attention_backend(torch.device("meta")).name == "torch_sdpa"
