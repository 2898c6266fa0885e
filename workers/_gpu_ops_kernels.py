"""The Triton kernels behind ``gpu_ops.py`` (imported only where triton is installed)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The launch wrappers' arithmetic on host ints. triton.next_power_of_2 and triton.cdiv are constexpr functions
# whose Python calls go through a wrapper (about 1.5 us each in triton 3.7, against 0.03 us), and a layer's
# launches make several: the same values, computed plainly.
def next_power_of_2(n: int) -> int:
    """The least power of two at least ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, as ``triton.cdiv``."""
    return -(-a // b)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_out, width, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_residual + offs, mask=valid, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * stride_residual + offs, x, mask=valid)
    mean_square = tl.sum(x * x, axis=0) / width
    normed = x / tl.sqrt_rn(mean_square + eps)
    weight = tl.load(weight_ptr + offs, mask=valid, other=0.0)
    # As transformers: the normalised row is rounded to the weight's dtype, then scaled in it.
    scaled = normed.to(weight.dtype).to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, scaled.to(out_ptr.dtype.element_ty), mask=valid)


def launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                    eps: float) -> None:
    rows, width = x.shape
    block = next_power_of_2(width)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, x.stride(0),
                              residual.stride(0) if residual is not None else 0, out.stride(0), width, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=block,
                              num_warps=min(16, max(1, block // 256)))


@triton.jit
def rotate_halves(x_rows, cos_row, sin_row, valid, offs, HALF: tl.constexpr):
    """The rows at ``x_rows`` (``[BLOCK_H, 1]`` pointers) rotated in float32, as their first and second halves:
    one definition for every kernel that rotates (``attention/triton_kernels.py`` too), so they store the
    same bits."""
    first = tl.load(x_rows + offs[None, :], mask=valid, other=0.0).to(tl.float32)
    second = tl.load(x_rows + HALF + offs[None, :], mask=valid, other=0.0).to(tl.float32)
    cos_first = tl.load(cos_row + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_row + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_row + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_row + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    # out = x * cos + rotate(x) * signed_sin, rotate(x) = cat(second half, first half)
    return (first * cos_first[None, :] + second * sin_first[None, :],
            second * cos_second[None, :] + first * sin_second[None, :])


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                   stride_oh, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    valid = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    out_first, out_second = rotate_halves(x_ptr + token * stride_xt + heads[:, None] * stride_xh,
                                          cos_ptr + token * stride_ct, sin_ptr + token * stride_st, valid, offs,
                                          HALF)
    out_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(out_row + offs[None, :], out_first.to(out_ptr.dtype.element_ty), mask=valid)
    tl.store(out_row + HALF + offs[None, :], out_second.to(out_ptr.dtype.element_ty), mask=valid)


def launch_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor) -> None:
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rotary needs contiguous head dimensions")
    half = dim // 2
    block_h = min(16, next_power_of_2(heads))
    _rotary_kernel[(tokens, cdiv(heads, block_h))](
        x, cos, signed_sin, out, x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0), out.stride(0),
        out.stride(1), heads, HALF=half, BLOCK_H=block_h, BLOCK_D=next_power_of_2(half), num_warps=4)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < width
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + offs, mask=valid, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=valid)


def launch_silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    rows, width = out.shape
    block = min(1024, next_power_of_2(width))
    _silu_and_mul_kernel[(rows, cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                            BLOCK=block, num_warps=4)


# Split over the input width: a decode step has a row or a few, and one program walking 14336 inputs alone is
# latency-bound (run 5 on an H200: 2.15x the base step at batch 1). Each program reduces LORA_SPAN inputs into
# its own partial; the expansion sums the partials in a fixed order, so a row's delta never depends on timing.
LORA_SPAN = 512


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, s_ptr, stride_x, stride_a_slot, stride_a_rank, stride_s_row,
                        stride_s_split, width, rank, SPAN: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = slot > 0  # slot 0: the base model's row, whose delta is nothing: nothing is read for it
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, SPAN, BLOCK_K):
        offs = split * SPAN + start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs, mask=live & (offs < width), other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + offs[None, :],
                    mask=live & (ranks[:, None] < rank) & (offs[None, :] < width), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(s_ptr + row * stride_s_row + split * stride_s_split + ranks, acc, mask=ranks < rank)


@triton.jit
def _lora_expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, stride_s_row, stride_s_split, stride_b_slot, stride_b_out,
                        stride_y, out_features, rank, splits, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = slot > 0
    parts = tl.arange(0, BLOCK_SPLITS)
    delta = tl.zeros((BLOCK_O,), dtype=tl.float32)
    # ranks in chunks: q, k and v stacked can reach 3 x 64, more than a tile should hold
    for start in range(0, rank, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        partial = tl.load(s_ptr + row * stride_s_row + parts[:, None] * stride_s_split + ranks[None, :],
                          mask=live & (parts[:, None] < splits) & (ranks[None, :] < rank), other=0.0)
        s = tl.sum(partial, axis=0)
        b = tl.load(b_ptr + slot * stride_b_slot + outs[:, None] * stride_b_out + ranks[None, :],
                    mask=live & (outs[:, None] < out_features) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        delta += tl.sum(b * s[None, :], axis=1)
    kept = live & (outs < out_features)
    y = tl.load(y_ptr + row * stride_y + outs, mask=kept, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + outs, (y + delta).to(y_ptr.dtype.element_ty), mask=kept)


def launch_lora(x: torch.Tensor, y: torch.Tensor, shrink: torch.Tensor, expand: torch.Tensor,
                slots: torch.Tensor) -> None:
    rows, width = x.shape
    rank, out_features = shrink.shape[1], expand.shape[1]
    splits = cdiv(width, LORA_SPAN)
    s = torch.empty((rows, splits, rank), dtype=torch.float32, device=x.device)
    block_r = min(32, next_power_of_2(rank))
    _lora_shrink_kernel[(rows, cdiv(rank, block_r), splits)](
        x, shrink, slots, s, x.stride(0), shrink.stride(0), shrink.stride(1), s.stride(0), s.stride(1), width, rank,
        SPAN=LORA_SPAN, BLOCK_R=block_r, BLOCK_K=128, num_warps=4)
    block_o = 128
    _lora_expand_kernel[(rows, cdiv(out_features, block_o))](
        s, expand, slots, y, s.stride(0), s.stride(1), expand.stride(0), expand.stride(1), y.stride(0), out_features,
        rank, splits, BLOCK_O=block_o, BLOCK_R=min(32, next_power_of_2(rank)),
        BLOCK_SPLITS=next_power_of_2(splits), num_warps=4)


# A row of logits in chunks of this many: a vocabulary of 128k is 32 programs per row, where torch's argmax
# and log-softmax each took one block per row and about 28 us apiece at batch 1 (run 5, H200).
GREEDY_CHUNK = 4096


@triton.jit
def _greedy_chunk_kernel(logits_ptr, max_ptr, index_ptr, sum_ptr, stride_logits, vocab, chunks,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0, tie_break_left=True)
    # a chunk of -inf only (masked tokens) adds nothing, rather than exp(-inf - -inf) = NaN
    total = tl.where(top == float("-inf"), 0.0, tl.sum(tl.exp(x - top), axis=0))
    tl.store(max_ptr + row * chunks + chunk, top)
    tl.store(index_ptr + row * chunks + chunk, chunk * BLOCK + first)
    tl.store(sum_ptr + row * chunks + chunk, total)


@triton.jit
def _greedy_combine_kernel(max_ptr, index_ptr, sum_ptr, ids_ptr, logprobs_ptr, chunks, vocab,
                           BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_C)
    valid = parts < chunks
    tops = tl.load(max_ptr + row * chunks + parts, mask=valid, other=float("-inf"))
    top = tl.max(tops, axis=0)
    # the first chunk holding the row's maximum holds its first argmax, as torch.argmax picks
    index = tl.load(index_ptr + row * chunks + parts, mask=valid, other=0)
    first = tl.min(tl.where(valid & (tops == top), index, 2147483647), axis=0)
    # a row of NaNs matches no chunk: its id is still one the vocabulary has, or the next step's embedding
    # lookup would fault the device
    first = tl.where(first < vocab, first, 0)
    scaled = tl.load(sum_ptr + row * chunks + parts, mask=valid, other=0.0) * tl.exp(tops - top)
    total = tl.sum(tl.where(tops == float("-inf"), 0.0, scaled), axis=0)
    tl.store(ids_ptr + row, first.to(tl.int64))
    tl.store(logprobs_ptr + row, -tl.log(total))  # the maximum's own term: top - (top + log(total))


def launch_greedy(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
    rows, vocab = logits.shape
    chunks = cdiv(vocab, GREEDY_CHUNK)
    # three tensors, not views of one: a view's alignment would follow the rows, and Triton compiles again
    # for each alignment it meets
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    sums = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _greedy_chunk_kernel[(rows, chunks)](logits, maxima, index, sums, logits.stride(0), vocab, chunks,
                                         BLOCK=GREEDY_CHUNK, num_warps=8)
    _greedy_combine_kernel[(rows,)](maxima, index, sums, ids, logprobs, chunks, vocab,
                                    BLOCK_C=max(16, next_power_of_2(chunks)), num_warps=1)


@triton.jit
def _unpack_decode_rows_kernel(staged_ptr, fed_ptr, small_ptr, tables_ptr, slot_tables_ptr, batch, stride_small,
                               max_blocks, block_size, ROW_FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    fields = staged_ptr + row
    token = tl.load(fields).to(tl.int64)
    position = tl.load(fields + batch).to(tl.int64)
    slot = tl.load(fields + 2 * batch).to(tl.int64)
    known = tl.load(fields + ROW_FIELDS * batch)
    length = tl.load(fields + (ROW_FIELDS + 1) * batch)
    offset = tl.load(fields + (ROW_FIELDS + 2) * batch)
    pick = tl.load(fields + (ROW_FIELDS + 3) * batch)
    if pick > 0:  # the id the step before sampled, still on the device
        token = tl.load(fed_ptr + pick - 1)
    tl.store(small_ptr + row, token)
    tl.store(small_ptr + stride_small + row, position)
    for field in tl.static_range(3, ROW_FIELDS):  # the optional ones: adapter slot, rotation shift
        tl.store(small_ptr + field * stride_small + row, tl.load(fields + field * batch).to(tl.int64))
    # The row's table: the slot's first ``known`` blocks (on the device since earlier steps), then the ones
    # staged for it, which the slot keeps for the next steps. Only this row's program touches its slot.
    blocks = staged_ptr + (ROW_FIELDS + 4) * batch + offset - known
    slot_table = slot_tables_ptr + slot * max_blocks
    wanted = position // block_size
    kv_block = tl.zeros((), dtype=tl.int64)
    for start in range(0, length, BLOCK):
        k = start + tl.arange(0, BLOCK)
        inside = k < length
        new = inside & (k >= known)
        table = tl.where(new, tl.load(blocks + k, mask=new, other=0).to(tl.int64),
                         tl.load(slot_table + k, mask=inside & (k < known), other=0))
        tl.store(slot_table + k, table, mask=new)
        tl.store(tables_ptr + row.to(tl.int64) * max_blocks + k, table, mask=inside)
        kv_block += tl.sum(tl.where(k == wanted, table, 0), axis=0)
    tl.store(small_ptr + 2 * stride_small + row, kv_block * block_size + position % block_size)


def launch_unpack_decode_rows(staged: torch.Tensor, fed: torch.Tensor, small: torch.Tensor, tables: torch.Tensor,
                              slot_tables: torch.Tensor, batch: int, block_size: int) -> None:
    row_fields = small.shape[0]
    _unpack_decode_rows_kernel[(batch,)](staged, fed, small, tables, slot_tables, batch, small.stride(0),
                                         slot_tables.shape[1], block_size, ROW_FIELDS=row_fields, BLOCK=128,
                                         num_warps=1)
