"""The Triton kernels of the Triton attention backend (``triton.py``), and their launch wrappers.

One kernel, ``paged_attention``, attends every query row of a step in one launch per layer: decode rows,
prompt chunks over their cached blocks and speculative rows alike, each query token attending its own
sequence's keys up to its own position, or up to its limit where the step gives ``key_limits`` (Gemma 3's
image rows see their whole image; the kernel is compiled apart for such steps, ``LIMITS``), within the layer's
sliding window if any, its scores soft-capped (Gemma 2, ``SOFTCAP``) and its softmax joined by the layer's sink
logits (gpt-oss, ``SINKS``) where the layer has them. It reads K/V where they lie in the paged pool, through each
sequence's block table, one tile of keys at a time with an online softmax (flash attention's running maximum and
sum), so no step materializes a mask, a padded gather or a ``[query, context]`` score matrix: its memory is the
output alone, whatever the step's shape.

A program is one tile of up to ``BLOCK_Q`` consecutive query tokens of one sequence under one KV head, and
all the query heads that share that KV head (GQA): its ``BLOCK_Q * BLOCK_H`` rows are token-major, so the
tile's K/V are read once for the whole GQA group. Which tile of which sequence each program takes comes
from the host (``base.step_index``'s ``programs``), so the grid has exactly as many programs as tiles.

Decode-only steps with few sequences give too few programs to occupy a GPU (batch 1: one per KV head), so
there the keys of each row are split between several programs (flash-decoding, ``key_splits``), each
writing its running maximum, sum and unnormalised output, which ``_combine_splits_kernel`` merges.

Numerics: scores, softmax and the output accumulate in float32; the probabilities are rounded to the
compute dtype before they multiply V (as flash attention and the portable backend's bfloat16 path do).
Float32 dot products stay IEEE unless torch allows TF32 (``torch.set_float32_matmul_precision``), so a
float32 model's tokens match transformers'. Triton's interpreter multiplies bfloat16 operands of ``tl.dot``
wrongly (triton 3.7: products of the raw bits), so there the operands, rounded to bfloat16 first, are
widened to float32 for the product: the same values, each product exact in float32 as on the GPU.

``rotary_kv_write`` comes before it in a layer (``TritonAttentionBackend.forward_rotary``): RoPE on the
queries and keys (straight from the QKV projection's output) and the write of keys and values into their
pool slots, one launch instead of the rotary kernel and the write's copies. It rotates with ``gpu_ops``'
own rotation (``_gpu_ops_kernels.rotate_halves``), rounds to the activations' dtype and then to the pool's,
so the pool holds the bits the separate rotary kernel and ``PagedKVCache.write`` would have stored.

This module imports triton at import time and decorates its kernels then: ``triton.jit`` reads
``TRITON_INTERPRET`` at that moment, so the interpreter (CPU) must be asked for before the first import.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmbus.workers._gpu_ops_kernels import cdiv, next_power_of_2, rotate_halves

# Keys per tile of the softmax loop (independent of the pool's block size: each key finds its block).
BLOCK_N = 64
# ... where the launch writes the step's keys as it attends (NEW_KV; see paged_attention).
NEW_KV_BLOCK_N = 32
# A program's query rows (tokens x GQA heads) are at least this many: tl.dot's smallest M.
MIN_ROWS = 16
# The running maximum starts finite, so a row whose first tiles are all masked (a sliding window's start,
# a padded row) keeps exp2(-inf - start) = 0 instead of exp2(-inf - -inf) = NaN.
_NEG_START = -1.0e30
LOG2E = 1.4426950408889634
# Flash-decoding: at most this many programs share one decode row's keys (``key_splits``).
MAX_SPLITS = 16
# What ``key_splits`` takes the CPU for under the interpreter, so tests run split steps.
INTERPRETER_PROCESSORS = 8


# A step's padded block table is as wide as its longest sequence's blocks: its stride changes with the step,
# and a kernel specialised on it (1, or a multiple of 16) would compile again mid-serving.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, program_seq_ptr, program_row_ptr,
        query_starts_ptr, query_lens_ptr, num_computed_ptr,
        partial_out_ptr, partial_ml_ptr,
        new_k_ptr, new_v_ptr, slots_ptr, key_limits_ptr, sinks_ptr,
        qk_scale, window, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs, stride_table,
        stride_nkt, stride_nkh, stride_nvt, stride_nvh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr,
        PRECISION: tl.constexpr, NEG_START: tl.constexpr, UPCAST: tl.constexpr, SPLITS: tl.constexpr,
        NEW_KV: tl.constexpr, LIMITS: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(program_seq_ptr + program)
    first_row = tl.load(program_row_ptr + program)  # the tile's first row of the flat token batch
    seq_start = tl.load(query_starts_ptr + seq)
    seq_end = seq_start + tl.load(query_lens_ptr + seq)
    if seq_end == seq_start:  # a whole graph's program past the step's own (MixedGraphIndex): attends nothing
        return
    computed = tl.load(num_computed_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    offs_m = tl.arange(0, BLOCK_M)
    rows = first_row + offs_m // BLOCK_H
    head_in_group = offs_m % BLOCK_H
    row_valid = (rows < seq_end) & (head_in_group < QUERIES_PER_KV)
    heads = kv_head * QUERIES_PER_KV + head_in_group
    query_pos = computed + rows - seq_start  # each row's position in its sequence
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    DTYPE: tl.constexpr = q.dtype  # the compute dtype: K/V and probabilities are rounded to it
    if UPCAST:
        q = q.to(tl.float32)

    # Keys the tile's rows can see: up to its last row's position; from its first row's window start.
    last_row = tl.minimum(first_row + BLOCK_Q, seq_end) - 1
    kv_end = computed + last_row - seq_start + 1
    key_last = query_pos  # each row's last visible key
    if LIMITS:
        # An image's rows see up to its last placeholder, which may lie past the tile's last row (a later row
        # of the step); kept within the sequence's keys, so that a wrong limit reads no other sequence's.
        key_last = tl.load(key_limits_ptr + rows, mask=rows < seq_end, other=0)
        kv_end = tl.minimum(tl.max(key_last, 0) + 1, computed + seq_end - seq_start)
    kv_start = kv_end * 0
    if SLIDING:
        kv_start = tl.maximum(computed + first_row - seq_start - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    if NEW_KV:
        # The step's own keys and values are not in the pool yet: this launch writes them there, the tile's
        # tokens under this KV head by its first split's program (the lanes of each row's first query head),
        # and reads them from new_k/new_v, never from the pool, where another program may be writing them.
        new_k_head = new_k_ptr + kv_head.to(tl.int64) * stride_nkh
        new_v_head = new_v_ptr + kv_head.to(tl.int64) * stride_nvh
        writes = (rows < seq_end) & (head_in_group == 0) & (split == 0)
        slots = tl.load(slots_ptr + rows, mask=writes, other=0).to(tl.int64)
        slot_blocks = (slots // BLOCK_SIZE)[:, None]
        in_block_m = (slots % BLOCK_SIZE)[:, None]
        written = writes[:, None] & d_valid[None, :]
        wide_rows = rows.to(tl.int64)[:, None]
        # (names of their own: one the key loop assigns too would be taken for a loop-carried value, whose
        # shape may not change in the loop; the interpreter would not say so, the compiler would)
        tile_k = tl.load(new_k_head + wide_rows * stride_nkt + offs_d[None, :], mask=written, other=0.0)
        tl.store(k_head + slot_blocks * stride_kb + in_block_m * stride_ks + offs_d[None, :],
                 tile_k.to(k_ptr.dtype.element_ty), mask=written)
        tile_v = tl.load(new_v_head + wide_rows * stride_nvt + offs_d[None, :], mask=written, other=0.0)
        tl.store(v_head + slot_blocks * stride_vb + in_block_m * stride_vs + offs_d[None, :],
                 tile_v.to(v_ptr.dtype.element_ty), mask=written)
    if SPLITS > 1:  # this program's share of the keys: whole tiles, the last splits possibly none
        span = tl.cdiv(tl.cdiv(kv_end - kv_start, SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + split * span
        kv_end = tl.minimum(kv_start + span, kv_end)
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        if NEW_KV:
            # Keys from `computed` on are the step's own: each one's row is read from new_k (in the pool's
            # dtype), never from the pool, where another program may be writing it; one load either way.
            fresh = n_valid & (offs_n >= computed)
            step_rows = seq_start + offs_n - computed
            key_at = tl.where(fresh, new_k_head + step_rows * stride_nkt,
                              k_head + blocks * stride_kb + in_block * stride_ks)
            k = tl.load(key_at[None, :] + offs_d[:, None], mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        else:
            k = tl.load(k_head + blocks[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None],
                        mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        k = k.to(DTYPE)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [M, N], log2 units
        if SOFTCAP:  # softcap in log2 units too: cap * tanh(s / cap) scales with its argument's units
            scores = softcap * _tanh(scores / softcap)
        visible = (offs_n[None, :] <= key_last[:, None]) & n_valid[None, :]
        if SLIDING:  # from the row's own position, whatever its limit
            visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if NEW_KV:
            value_at = tl.where(fresh, new_v_head + step_rows * stride_nvt,
                                v_head + blocks * stride_vb + in_block * stride_vs)
            v = tl.load(value_at[:, None] + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            v = tl.load(v_head + blocks[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :],
                        mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        p = p.to(DTYPE)
        v = v.to(DTYPE)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if SPLITS > 1:
        # [T, Hq, SPLITS, BLOCK_D] unnormalised sums and [T, Hq, SPLITS, 2] (max, sum) for _combine_splits
        at = (rows.to(tl.int64) * tl.num_programs(1) * QUERIES_PER_KV + heads) * SPLITS + split
        tl.store(partial_out_ptr + at[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(partial_ml_ptr + at * 2, m_i, mask=row_valid)
        tl.store(partial_ml_ptr + at * 2 + 1, l_i, mask=row_valid)
    else:
        if SINKS:  # one more term of each row's softmax, with no value
            sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0) * 1.4426950408889634
            m_final = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_final)
            l_i = l_i * alpha + tl.math.exp2(sink - m_final)
            acc = acc * alpha[:, None]
        # Every valid row sees at least its own key; padded rows (never stored) may have summed nothing.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _tanh(x):
    """tanh from exp2 (Triton has no tanh of its own that its interpreter runs too); exact at both ends, within
    a few float32 ulps of 1 elsewhere."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2 / ln 2


@triton.jit
def _combine_splits_kernel(partial_out_ptr, partial_ml_ptr, out_ptr, sinks_ptr, stride_ot, stride_oh, num_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                           SINKS: tl.constexpr):
    """One (token, head): the splits' online-softmax states merged, as one program over all keys would, with
    the head's sink (``SINKS``) a term of the sum."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * SPLITS
    splits = tl.arange(0, SPLITS)
    maxima = tl.load(partial_ml_ptr + (base + splits) * 2)
    sums = tl.load(partial_ml_ptr + (base + splits) * 2 + 1)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(partial_out_ptr + (base + splits)[:, None] * BLOCK_D + offs_d[None, :])
    maximum = tl.max(maxima, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        maximum = tl.maximum(maximum, sink)
    weight = tl.math.exp2(maxima - maximum)
    total = tl.sum(sums * weight, 0)
    if SINKS:
        total += tl.math.exp2(sink - maximum)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _rotary_kv_write_kernel(qk_ptr, value_ptr, cos_ptr, sin_ptr, slots_ptr, query_ptr, key_slots_ptr,
                            value_slots_ptr, stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st,
                            stride_slots, stride_qt, stride_qh, stride_kh, stride_ks, stride_pvh, stride_pvs,
                            num_heads, num_kv_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """One token's rows, ``BLOCK_H`` at a time: its query heads, then its key heads, then its value heads,
    so a GQA layer's few K/V heads share programs with its queries rather than taking launches of their own."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    in_half = offs[None, :] < HALF
    is_query = rows < num_heads
    rotated = rows < num_heads + num_kv_heads
    is_key = rotated & ~is_query
    is_value = ~rotated & (rows < num_heads + 2 * num_kv_heads)
    slot = tl.load(slots_ptr + token * stride_slots).to(tl.int64)

    first, second = rotate_halves(qk_ptr + token * stride_qkt + rows[:, None] * stride_qkh,
                                  cos_ptr + token * stride_ct, sin_ptr + token * stride_st,
                                  rotated[:, None] & in_half, offs, HALF)
    # Rounded to the activations' dtype first, as the rotary kernel's output is before the write casts it.
    first = first.to(qk_ptr.dtype.element_ty)
    second = second.to(qk_ptr.dtype.element_ty)
    query_rows = query_ptr + token * stride_qt + rows[:, None] * stride_qh
    tl.store(query_rows + offs[None, :], first, mask=is_query[:, None] & in_half)
    tl.store(query_rows + HALF + offs[None, :], second, mask=is_query[:, None] & in_half)
    # 64-bit head offsets, as in paged attention: a large pool's layer can pass 2^31 elements
    key_rows = key_slots_ptr + (rows - num_heads).to(tl.int64)[:, None] * stride_kh + slot * stride_ks
    pool_dtype = key_slots_ptr.dtype.element_ty
    tl.store(key_rows + offs[None, :], first.to(pool_dtype), mask=is_key[:, None] & in_half)
    tl.store(key_rows + HALF + offs[None, :], second.to(pool_dtype), mask=is_key[:, None] & in_half)

    value_heads = (rows - num_heads - num_kv_heads).to(tl.int64)
    value_rows = value_ptr + token * stride_vt + value_heads[:, None] * stride_vh
    value_mask = is_value[:, None] & in_half
    pool_rows = value_slots_ptr + value_heads[:, None] * stride_pvh + slot * stride_pvs
    pool_dtype = value_slots_ptr.dtype.element_ty
    tl.store(pool_rows + offs[None, :],
             tl.load(value_rows + offs[None, :], mask=value_mask, other=0.0).to(pool_dtype), mask=value_mask)
    tl.store(pool_rows + HALF + offs[None, :],
             tl.load(value_rows + HALF + offs[None, :], mask=value_mask, other=0.0).to(pool_dtype), mask=value_mask)


def interpreted() -> bool:
    """Whether this module's kernels were decorated for Triton's interpreter (``TRITON_INTERPRET=1`` when it
    was imported)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def query_tile(max_query_len: int) -> int:
    """Query tokens per program for a step whose longest query is ``max_query_len``: one for a decode-only
    step, else up to 16 (a power of two), fewer for short speculative rows."""
    return min(16, next_power_of_2(max_query_len))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    """The GPU's multiprocessors, asked once (``key_splits`` runs at every layer of an eager step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def key_splits(programs: int, num_kv_heads: int, block_q: int, device: torch.device) -> int:
    """How many programs share one tile's keys (flash-decoding's split): for decode-only steps (``block_q``
    1) whose programs alone would leave most of the GPU's multiprocessors idle (a batch-1 step has one per
    KV head), enough for about two per multiprocessor, at most ``MAX_SPLITS``. It depends on the step's
    shape alone, so a CUDA graph of a batch size keeps it. Under the interpreter, as if there were 8."""
    if block_q != 1:
        return 1
    processors = _multiprocessors(device.index) if device.type == "cuda" else INTERPRETER_PROCESSORS
    wanted = 2 * processors // max(1, programs * num_kv_heads)
    return min(MAX_SPLITS, 1 << max(0, wanted.bit_length() - 1)) if wanted > 1 else 1


def paged_attention(query: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                    tables: torch.Tensor, programs: torch.Tensor, block_q: int, query_starts: torch.Tensor,
                    query_lens: torch.Tensor, num_computed: torch.Tensor, scale: float,
                    window: int | None, out: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    key_limits: torch.Tensor | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``query [T, Hq, D]`` of a step over one layer's pool -> ``[T, Hq, D]`` in ``query``'s dtype (``out``
    where given, rows of unit-stride heads).

    ``key_blocks``/``value_blocks [Hkv, blocks, block_size, D]``: the layer's pool, the step's K/V already
    written; ``tables [N, >= blocks per sequence]`` each sequence's blocks in order; ``programs``:
    ``step_index(..., query_tile=block_q).programs``; ``query_starts``/``query_lens``/``num_computed [N]``: each
    sequence's first row, its new tokens and its tokens cached before them; ``window``: keys less than this
    many positions behind a query are visible (None: all). ``new_kv``: (``key``, ``value`` ``[T, Hkv, D]``,
    ``slot_mapping [T]``) of the step's tokens in the pool's dtype, which the launch writes into the pool at
    their slots as it attends (the pool must not hold them yet: the cached positions are read from it, the
    step's from these), in tiles of ``NEW_KV_BLOCK_N`` keys; None: the pool holds them already.
    ``key_limits [T]`` int64: each row's last visible position (``AttentionBackend.build_metadata``'s), at most its
    sequence's last; None: its own (causal). The window still starts from the row's own position. ``softcap``:
    each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``; ``sinks [Hq]`` float32: a logit per head
    that joins its softmax with no value (None: neither; each compiles a kernel of its own)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_blocks.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_attention's out must be {tuple(query.shape)} {query.dtype} with unit-stride "
                         f"heads, not {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    per_kv = num_heads // num_kv_heads
    block_h = max(next_power_of_2(per_kv), MIN_ROWS // block_q)
    block_d = max(16, next_power_of_2(head_dim))
    precision = "ieee"
    if query.dtype == torch.float32 and query.is_cuda and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"  # asked for (--tf32 / torch's setting); float32 stays exact otherwise
    # Eight warps for big tiles: each thread holds its share of the [D, BLOCK_N] K tile and its 64-bit
    # addresses (every key finds its own block); with four, bfloat16 at head dim 128 spills on sm_90.
    rows = block_q * block_h
    splits = key_splits(programs.shape[1], num_kv_heads, block_q, query.device)
    partial_out = partial_ml = out
    if splits > 1:
        partial_out = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32,
                                  device=query.device)
        partial_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=query.device)
    if new_kv is None:  # the arguments unread (NEW_KV is off): the same ones every time, one compiled kernel
        new_key = new_value = slots = query
        new_strides = (0, 0, 0, 0)
    else:
        new_key, new_value, slots = new_kv
        key_strides, value_strides = new_key.stride(), new_value.stride()
        if key_strides[-1] != 1 or value_strides[-1] != 1:
            raise ValueError("paged_attention's new keys and values need contiguous head dimensions")
        if new_key.dtype != key_blocks.dtype or new_value.dtype != value_blocks.dtype:
            raise ValueError(f"paged_attention's new keys and values must have the pool's dtype "
                             f"({key_blocks.dtype}), not {new_key.dtype}: write them first")
        new_strides = (*key_strides[:2], *value_strides[:2])
    limits = query if key_limits is None else key_limits  # unread without LIMITS, as new_kv's
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_heads,)):
        raise ValueError(f"paged_attention's sinks must be float32 [{num_heads}], not {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    sink_logits = query if sinks is None else sinks
    grid = (programs.shape[1], num_kv_heads, splits)
    # (NEW_KV's tiles are half as many keys: choosing each key's row took registers that at 64 keys ptxas found
    # only by spilling, 488 bytes at head dim 128 in bfloat16; at 32, none)
    # (each stride() a call into torch: the tuples once, ~0.2 us a call saved about 12 times a launch)
    _paged_attention_kernel[grid](
        query, key_blocks, value_blocks, out, tables, programs[0], programs[1],
        query_starts, query_lens, num_computed, partial_out, partial_ml, new_key, new_value, slots, limits,
        sink_logits, scale * LOG2E, window or 0, (softcap or 1.0) * LOG2E, *query.stride()[:2], *out.stride()[:2],
        *key_blocks.stride()[:3], *value_blocks.stride()[:3], tables.stride(0), *new_strides,
        HEAD_DIM=head_dim, BLOCK_D=block_d, QUERIES_PER_KV=per_kv, BLOCK_H=block_h, BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N if new_kv is None else NEW_KV_BLOCK_N, BLOCK_SIZE=block_size,
        SLIDING=window is not None, PRECISION=precision,
        NEG_START=_NEG_START, UPCAST=query.dtype == torch.bfloat16 and interpreted(), SPLITS=splits,
        NEW_KV=new_kv is not None, LIMITS=key_limits is not None, SOFTCAP=softcap is not None,
        SINKS=sinks is not None, num_warps=8 if rows > 64 or block_d >= 128 else 4)
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](partial_out, partial_ml, out, sink_logits, out.stride(0),
                                                        out.stride(1), num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                                        SPLITS=splits, SINKS=sinks is not None, num_warps=4)
    return out


def rotary_kv_write(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                    num_heads: int, slot_mapping: torch.Tensor, key_slots: torch.Tensor,
                    value_slots: torch.Tensor) -> torch.Tensor:
    """``qk [T, Hq + Hkv, D]`` (queries, then keys, unrotated), ``value [T, Hkv, D]``, ``cos``/``signed_sin
    [T, 1, D]`` (``RotaryEmbedding.cos_sin``: the whole head rotated) -> the rotated queries ``[T, Hq, D]``,
    with the rotated keys and the values written to ``key_slots``/``value_slots [Hkv, slots, D]`` (a layer's
    ``PagedKVCache.layer_slots``) at ``slot_mapping [T]``, in the pool's dtype."""
    num_tokens, _, head_dim = qk.shape
    num_kv_heads = value.shape[1]
    if any(t.stride(-1) != 1 for t in (qk, value, cos, signed_sin, key_slots, value_slots)):
        raise ValueError("rotary_kv_write needs contiguous head dimensions")
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qk.dtype, device=qk.device)
    rows = num_heads + 2 * num_kv_heads
    block_h = min(16, next_power_of_2(rows))
    half = head_dim // 2
    _rotary_kv_write_kernel[(num_tokens, cdiv(rows, block_h))](
        qk, value, cos, signed_sin, slot_mapping, query, key_slots, value_slots,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos.stride(0), signed_sin.stride(0),
        slot_mapping.stride(0), query.stride(0), query.stride(1), key_slots.stride(0), key_slots.stride(1),
        value_slots.stride(0), value_slots.stride(1), num_heads, num_kv_heads,
        HALF=half, BLOCK_H=block_h, BLOCK_D=next_power_of_2(half), num_warps=4)
    return query
