"""The portable backend: gather each group's K/V blocks into a padded batch, then attend with torch ops.

Single-token queries (decodes) and multi-token queries (prefills, chunks) are separate groups, so one
long prompt does not pad every decode row to its length; and decodes are split by context length
(``bucket_by_context``), so one long conversation does not pad every other sequence's gathered context to
its length either. A group gathers its sequences' blocks into ``[Hkv, B, ctx, D]`` and attends either with
``scaled_dot_product_attention`` and a boolean mask (long queries), or with two batched matmuls and a
float32 softmax (at most ``SMALL_QUERY_MAX`` query tokens per sequence), the mask then an additive bias.
A mask carries causality, each sequence's length and offset, and the layer's sliding window; one is built
per distinct window per group, so a model whose layers share a window (or none) pays for one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.workers.attention.base import (AttentionBackend, AttentionMetadata, StepIndex, exclusive_cumsum,
                                           group_token_index, into, step_index)
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import to_device

# Groups whose sequences bring at most this many query tokens attend with two batched matmuls instead of
# SDPA: a short chunk of a long prompt (chunked prefill beside decodes) is faster that way on CPU at a long
# context, where SDPA's tiling costs more than the work; longer queries favour SDPA (design notes,
# "Chunked prefill and budgets").
SMALL_QUERY_MAX = 8
# Decode groups of at most this many sequences attend with one SDPA call instead of the batched matmuls:
# at batch 1 it is the faster (small bf16 batched matmuls have a high fixed cost); from batch 4 on SDPA is
# the slower one (design notes, "Attention backends").
SDPA_DECODE_MAX_BATCH = 2
# A decode group's gathered context (every sequence padded to the group's longest) may be at most this
# many times its sequences' own: longer contexts go to a group of their own.
PADDING_LIMIT = 2.0
# The float32 scores a soft-capped or sinked group holds at once (``_shaped``): a long prompt's are computed a
# slice of queries at a time, as a 4k-token chunk over an 8k context would otherwise take gigabytes.
SHAPED_SCORES_BYTES = 64 << 20


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one padded call."""

    batch: int
    max_query_len: int
    token_index: torch.Tensor | None  # [Tg] rows of the step's flat token batch in this group; None: all, in order
    padded_row: torch.Tensor | None  # [Tg] row of each token in the [batch * max_query_len] layout; None: no padding
    # [batch, ctx_blocks] KV block of each block of context, the spare block past a sequence's table; the
    # gathered context spans ctx_blocks * block_size keys, the ones past a sequence's length masked.
    block_index: torch.Tensor
    # [batch, 1, max_query_len, max_ctx] True where the query may attend the key: one mask per window of
    # the backend (``AttentionBackend.windows``), in that order.
    masks: tuple[torch.Tensor, ...]
    # Small-query groups only (see SMALL_QUERY_MAX): the masks as additive biases (0 or -inf, compute dtype)
    # in the head-major order of the batched matmuls, [Hkv * batch, 1, max_ctx] for decodes and
    # [Hkv * batch, max_query_len, 1, max_ctx] for chunks; () for other groups.
    matmul_biases: tuple[torch.Tensor, ...] = ()


def bucket_by_context(members: list[int], contexts: list[int], block_size: int) -> list[list[int]]:
    """``members`` split so that no group's padded context exceeds ``PADDING_LIMIT`` times its own; one
    group, in the given order, when that holds for all of them."""
    buckets, current, own_blocks = [], [], 0
    for i in sorted(members, key=lambda i: contexts[i]):
        blocks = -(-contexts[i] // block_size)
        if current and (len(current) + 1) * blocks > PADDING_LIMIT * (own_blocks + blocks):
            buckets.append(current)
            current, own_blocks = [], 0
        current.append(i)
        own_blocks += blocks
    buckets.append(current)
    return [members] if len(buckets) == 1 else buckets


class TorchSDPABackend(AttentionBackend):
    """Portable paged attention: gather K/V by block, then SDPA or batched matmuls. Subclasses change how
    a pool is written and read (``_write``, ``_context``) and how groups are formed and attended."""

    name = "torch_sdpa"

    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device,
                       key_limits: list[int] | None = None) -> AttentionMetadata:
        index = step_index(query_lens, num_computed, block_tables, kv_cache, device)
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        prefills = [i for i, n in enumerate(query_lens) if n > 1]
        # (a decode row's limit is its own position: a limit past it lies in the same step)
        groups = [self._decode_group(index, members, query_lens, num_computed, kv_cache, device)
                  for members in self._decode_groups(decodes, query_lens, num_computed, kv_cache)]
        if prefills:
            ahead = None if key_limits is None else to_device(key_limits, torch.long, device) - index.positions
            groups.append(self._padded_group(index, prefills, query_lens, num_computed, kv_cache, device, ahead))
        return AttentionMetadata(positions=index.positions, slot_mapping=index.slot_mapping, groups=groups,
                                 sequence_starts=index.query_starts)

    def _decode_groups(self, decodes: list[int], query_lens: list[int], num_computed: list[int],
                       kv_cache: PagedKVCache) -> list[list[int]]:
        if not decodes:
            return []
        contexts = [c + n for c, n in zip(num_computed, query_lens)]
        return bucket_by_context(decodes, contexts, kv_cache.block_size)

    def _decode_group(self, index: StepIndex, members: list[int], query_lens: list[int], num_computed: list[int],
                      kv_cache: PagedKVCache, device: torch.device):
        return self._padded_group(index, members, query_lens, num_computed, kv_cache, device)

    def _padded_group(self, index: StepIndex, members: list[int], query_lens: list[int], num_computed: list[int],
                      kv_cache: PagedKVCache, device: torch.device,
                      ahead: torch.Tensor | None = None) -> AttentionGroup:
        """``ahead [T]``: how far past its own position each token of the step attends (``key_limits``)."""
        block_size = kv_cache.block_size
        max_query_len = max(query_lens[i] for i in members)
        ctx_blocks = -(-max(num_computed[i] + query_lens[i] for i in members) // block_size)
        max_ctx = ctx_blocks * block_size
        group_tokens = sum(query_lens[i] for i in members)
        batch = len(members)
        members_t, token_index = group_token_index(index, members, query_lens, device)
        lens = index.query_lens[members_t]
        computed = index.num_computed[members_t]
        context_lens = computed + lens
        if group_tokens == batch * max_query_len:  # equal lengths (decodes, one prompt): no padding
            padded_row = None
        else:
            padded_row = torch.arange(group_tokens, device=device) + torch.repeat_interleave(
                torch.arange(batch, device=device) * max_query_len - exclusive_cumsum(lens), lens,
                output_size=group_tokens)
        key_pos = torch.arange(max_ctx, device=device)
        in_context = key_pos[None, :] < context_lens[:, None]  # [B, max_ctx]
        query_pos = computed[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [B, max_q]
        limit_pos = query_pos
        if ahead is not None:
            padded_ahead = torch.zeros(batch * max_query_len, dtype=torch.long, device=device)
            group_ahead = ahead if token_index is None else ahead.index_select(0, token_index)
            if padded_row is None:
                padded_ahead.copy_(group_ahead)
            else:
                padded_ahead.index_copy_(0, padded_row, group_ahead)
            limit_pos = query_pos + padded_ahead.view(batch, max_query_len)
        # Padded query rows (beyond a sequence's length) still see its whole context: never a fully
        # masked row, so SDPA returns finite values that are then dropped.
        mask = (key_pos[None, None, :] <= limit_pos[:, :, None]) & in_context[:, None, :]
        masks = tuple(_windowed(mask, key_pos, query_pos, context_lens, window).unsqueeze(1)
                      for window in self.windows)
        matmul_biases = ()
        if max_query_len <= SMALL_QUERY_MAX or self.shapes_scores:  # SDPA can neither cap nor sink
            shape = (batch, 1, max_ctx) if max_query_len == 1 else (batch, max_query_len, 1, max_ctx)
            matmul_biases = tuple(
                torch.zeros(m.shape, dtype=kv_cache.compute_dtype, device=device).masked_fill_(~m, float("-inf"))
                .view(shape).repeat(kv_cache.num_kv_heads, *[1] * (len(shape) - 1))
                for m in masks)
        return AttentionGroup(batch=batch, max_query_len=max_query_len, token_index=token_index,
                              padded_row=padded_row, block_index=index.tables[members_t][:, :ctx_blocks],
                              masks=masks, matmul_biases=matmul_biases)

    # -- per layer ---------------------------------------------------------------------------------

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        self._write(layer, kv_cache, meta.slot_mapping, key, value)
        window = self.window_index(layer)
        if len(meta.groups) == 1 and meta.groups[0].token_index is None:
            return into(out, self._attend(layer, meta.groups[0], query, kv_cache, window, scale))
        out = query.new_empty(query.shape) if out is None else out
        for group in meta.groups:
            rows = group.token_index
            out.index_copy_(0, rows, self._attend(layer, group, query.index_select(0, rows), kv_cache, window, scale))
        return out

    def _write(self, layer: int, kv_cache: PagedKVCache, slots: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> None:
        """The step's new ``key``/``value [T, Hkv, D]`` into the pool at ``slots [T]``."""
        kv_cache.write(layer, slots, key, value)

    def _context(self, layer: int, kv_cache: PagedKVCache,
                 block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks ``block_index [B, n]`` of one layer as ``[Hkv, B, n * block_size, D]`` K and V, in the
        pool's dtype. Whole blocks are contiguous runs: index_select copies them several times faster than
        gathering slot by slot with advanced indexing."""
        return tuple(_gather(blocks, block_index) for blocks in kv_cache.layer_blocks(layer))

    def _attend(self, layer: int, group, queries: torch.Tensor, kv_cache: PagedKVCache, window: int,
                scale: float) -> torch.Tensor:
        """One group's ``queries [Tg, Hq, D]`` over its context -> ``[Tg, Hq, D]``."""
        keys, values = (t.to(kv_cache.compute_dtype) for t in self._context(layer, kv_cache, group.block_index))
        if group.matmul_biases:
            return _matmul(queries, keys.flatten(0, 1), values.flatten(0, 1), group, window, scale,
                           self.layer_softcap(layer), self.layer_sinks(layer))
        return _sdpa(queries, keys.transpose(0, 1), values.transpose(0, 1), group, window, scale)


def _gather(blocks: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
    """``blocks [Hkv, num_blocks + 1, block_size, D]`` at ``block_index [B, n]`` -> ``[Hkv, B, n *
    block_size, D]``."""
    num_kv_heads, _, block_size, head_dim = blocks.shape
    batch, n = block_index.shape
    return blocks.index_select(1, block_index.reshape(-1)).view(num_kv_heads, batch, n * block_size, head_dim)


def _windowed(mask: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, context_lens: torch.Tensor,
              window: int | None) -> torch.Tensor:
    """``mask`` restricted to the keys less than ``window`` positions behind each query."""
    if window is None or window >= key_pos.numel():  # every key is inside every query's window
        return mask
    # Padded query rows take the window of their sequence's last token, so they are never fully masked.
    last_pos = torch.minimum(query_pos, context_lens[:, None] - 1)
    return mask & (key_pos[None, None, :] > (last_pos - window)[:, :, None])


def _matmul(queries, keys, values, group: AttentionGroup, window: int, scale: float,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Few queries per sequence, over ``keys``/``values [Hkv * B, ctx, D]``: two batched matmuls with each
    sequence's queries times the GQA group as rows, softmax in float32 (as transformers' eager
    attention). A fused SDPA kernel tiles for long queries and is several times slower on CPU for decodes
    at batch 64 (design notes, "Attention backends"). The layer's ``softcap`` and ``sinks`` (which SDPA
    cannot apply) shape the scores as transformers' eager attention does: capped before the mask, and the
    sinks a column of the softmax that is dropped after it."""
    batch, max_q = group.batch, group.max_query_len
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    num_kv_heads = keys.shape[0] // batch
    per_kv = num_heads // num_kv_heads
    padded = _padded_queries(queries, group)  # [B, max_q, Hq, D]
    # rows of sequence b under kv head h: its queries in order, each times the heads sharing h
    q = padded.view(batch, max_q, num_kv_heads, per_kv, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads * batch, max_q * per_kv, head_dim)
    bias = group.matmul_biases[window]
    if softcap is not None or sinks is not None:
        return _shaped(q, keys, values, group, bias, scale, softcap, sinks, num_kv_heads, per_kv)
    if max_q == 1 and batch <= SDPA_DECODE_MAX_BATCH:
        # Each [Hkv * B] row is a batch entry with one head; its GQA group's queries are the rows.
        attended = F.scaled_dot_product_attention(q[:, None], keys[:, None], values[:, None],
                                                  attn_mask=bias[:, None], scale=scale)
        return attended.view(num_kv_heads, batch, per_kv, head_dim).transpose(0, 1).reshape(
            batch, num_heads, head_dim)
    if max_q == 1:
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)
        scores.view(num_kv_heads * batch, max_q, per_kv, -1).add_(bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return _heads(torch.bmm(probs, values), group, num_kv_heads, per_kv)


def _heads(attended: torch.Tensor, group: AttentionGroup, num_kv_heads: int, per_kv: int) -> torch.Tensor:
    """The batched matmuls' ``[Hkv * B, max_q * per_kv, D]`` as the group's ``[Tg, Hq, D]`` rows."""
    batch, max_q, head_dim = group.batch, group.max_query_len, attended.shape[-1]
    attended = attended.view(num_kv_heads, batch, max_q, per_kv, head_dim).permute(1, 2, 0, 3, 4)
    return _unpadded(attended.reshape(batch * max_q, num_kv_heads * per_kv, head_dim), group)


def _shaped(q, keys, values, group: AttentionGroup, bias: torch.Tensor, scale: float, softcap: float | None,
            sinks: torch.Tensor | None, num_kv_heads: int, per_kv: int) -> torch.Tensor:
    """``_matmul``'s rows ``q [Hkv * B, max_q * per_kv, D]`` with a soft cap and/or sinks, as many queries at a
    time as ``SHAPED_SCORES_BYTES`` of scores hold (each query's GQA rows together)."""
    batch, max_q = group.batch, group.max_query_len
    pairs, context = q.shape[0], keys.shape[1]
    per_slice = max(1, SHAPED_SCORES_BYTES // (4 * pairs * per_kv * context))  # queries
    # row (h, b, q, g) of the scores is query head h * per_kv + g
    column = None if sinks is None else sinks.view(num_kv_heads, 1, 1, per_kv).expand(
        num_kv_heads, batch, max_q, per_kv).reshape(pairs, max_q * per_kv, 1)
    out = q.new_empty(pairs, max_q * per_kv, values.shape[-1])
    for first in range(0, max_q, per_slice):
        last = min(first + per_slice, max_q)
        rows = slice(first * per_kv, last * per_kv)
        scores = torch.bmm(q[:, rows], keys.transpose(1, 2)).mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        if max_q == 1:
            scores.add_(bias)
        else:
            scores.view(pairs, last - first, per_kv, -1).add_(bias[:, first:last])
        if column is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(torch.cat((scores.float(), column[:, rows]), dim=-1), dim=-1)[..., :-1]
        torch.bmm(probs.to(values.dtype), values, out=out[:, rows])
    return _heads(out, group, num_kv_heads, per_kv)


def _sdpa(queries, keys, values, group: AttentionGroup, window: int, scale: float) -> torch.Tensor:
    """Multi-token queries over ``keys``/``values [B, Hkv, ctx, D]``: one padded SDPA call with the
    group's boolean mask."""
    batch, max_q = group.batch, group.max_query_len
    num_heads = queries.shape[1]
    attended = F.scaled_dot_product_attention(
        _padded_queries(queries, group).transpose(1, 2), keys, values, attn_mask=group.masks[window],
        scale=scale, enable_gqa=num_heads != keys.shape[1])
    return _unpadded(attended.transpose(1, 2).reshape(batch * max_q, num_heads, -1), group)


def _padded_queries(queries: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's ``[Tg, Hq, D]`` queries as ``[B, max_query_len, Hq, D]``, zeros where a sequence is short."""
    num_heads, head_dim = queries.shape[1], queries.shape[2]
    if group.padded_row is None:
        return queries.reshape(group.batch, group.max_query_len, num_heads, head_dim)
    padded = queries.new_zeros(group.batch * group.max_query_len, num_heads, head_dim)
    padded.index_copy_(0, group.padded_row, queries)
    return padded.view(group.batch, group.max_query_len, num_heads, head_dim)


def _unpadded(attended: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``[B * max_query_len, Hq, D]`` back to the group's ``[Tg, Hq, D]`` rows."""
    return attended if group.padded_row is None else attended.index_select(0, group.padded_row)
