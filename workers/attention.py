"""Attention over the paged KV cache.

A backend does two things: ``build_metadata`` once per step (index tensors shared by every layer) and
``forward`` once per layer (write the step's K/V into their slots, then attend). ``TorchSDPABackend`` is
the portable path: it gathers each sequence's K/V blocks into a padded ``[B, max_ctx]`` batch and runs
``scaled_dot_product_attention`` with a boolean mask carrying causality, each sequence's offset and
its length. Single-token queries (decodes) and multi-token queries (prefills, chunks) are separate
groups, so one long prompt does not pad every decode row to its length. A flash-attention backend for
CUDA can implement the same two methods over the same cache layout.

Sliding-window attention (Mistral, Qwen2's windowed layers) is one more mask term: a query at position
``q`` sees the keys ``k`` with ``q - window < k <= q``, transformers' ``sliding_window_overlay``. The
backend is told each layer's window (None: full attention) when it is made, and ``build_metadata`` builds
one mask per distinct window per group, so a model whose layers all share a window (or none) pays for
one mask, and one mixing full and windowed layers for two. Keys outside the window stay in the cache and
are still gathered, only masked out: the scheduler owns a request's blocks and frees none before it ends.

On CPU, gathering the blocks is the costliest part of a large decode step (at batch 64 it copies ~10 MB
per layer, about a sixth of the step), and it copies nearly the same bytes every step. So the backend
keeps the decode group's gathered K/V between steps (``_DecodeMirror``): while the same sequences decode
in the same order, each step only writes its new token into the mirror, besides the pool. Any other
batch (a sequence joins or leaves, a chunk arrives, ``forget``) rebuilds it with one gather. Where the C
kernel of ``cpu_kernels.py`` builds (a C compiler is there), decode groups attend over the mirror with it:
one pass per layer that also writes the new K/V, instead of four index copies, two batched matmuls and
a softmax; the mirror then holds K/V in the kernel's layout (see ``decode_attention.c``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.workers.cpu_kernels import DecodeAttentionKernel, decode_attention_kernel
from llmbus.workers.kv_cache import PagedKVCache


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one padded SDPA call."""

    batch: int
    max_query_len: int
    token_index: torch.Tensor | None  # [Tg] rows of the step's flat token batch in this group; None: all, in order
    padded_row: torch.Tensor | None  # [Tg] row of each token in the [batch * max_query_len] layout; None: no padding
    # [batch, ctx_blocks] KV block of each block of context, the padding block past a sequence's table;
    # the gathered context spans ctx_blocks * block_size keys, the ones past a sequence's length masked.
    block_index: torch.Tensor
    # [batch, 1, max_query_len, max_ctx] True where the query may attend the key: one mask per distinct
    # window of the backend (``TorchSDPABackend.windows``), in that order.
    masks: tuple[torch.Tensor, ...]
    # Small-query groups only (decodes, short prompt chunks; see SMALL_QUERY_MAX): the masks as additive
    # biases (0 or -inf, cache dtype) in the head-major order of the batched matmuls, [Hkv * batch, 1,
    # max_ctx] for decodes and [Hkv * batch, max_query_len, 1, max_ctx] for chunks; () for other groups.
    matmul_biases: tuple[torch.Tensor, ...] = ()
    # Decode groups on CPU: the mirrored K/V (``_DecodeMirror``) the matmuls read instead of gathering,
    # and each sequence's slot in it ([B], b * capacity + position) where this step's token goes.
    mirror: "_DecodeMirror | None" = None
    mirror_slots: torch.Tensor | None = None
    # Decode groups attended by the C kernel: each sequence's context length with this token, and per
    # window of the backend its first visible key ([B] int64 each); masks and biases are then not built.
    context_lens: torch.Tensor | None = None
    window_starts: tuple[torch.Tensor, ...] = ()


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step index tensors, built once and used by every layer."""

    positions: torch.Tensor  # [T] position of each new token in its sequence (RoPE input)
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    groups: list[AttentionGroup]


def _gather(blocks: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
    """``blocks [Hkv, num_blocks + 1, block_size, D]`` at ``block_index [B, n]`` -> ``[Hkv, B, n *
    block_size, D]``. Whole blocks are contiguous runs: copying them with index_select measured
    several times faster than gathering slot by slot with advanced indexing."""
    num_kv_heads, _, block_size, head_dim = blocks.shape
    batch, n = block_index.shape
    return blocks.index_select(1, block_index.reshape(-1)).view(num_kv_heads, batch, n * block_size, head_dim)


@dataclass(slots=True)
class _DecodeMirror:
    """The decode group's context K/V, kept for the next step: ``[layers, Hkv, B, capacity, D]`` as the
    matmuls read it, or ``[layers, Hkv, B, ...]`` in the C kernel's layout when ``for_kernel``. Valid for
    sequences ``rids`` with block tables starting with ``tables`` and ``lengths`` tokens written;
    positions past a sequence's length hold finite filler (masked)."""

    rids: list[str]
    tables: list[list[int]]
    lengths: list[int]
    key: torch.Tensor
    value: torch.Tensor
    capacity: int
    for_kernel: bool = False

    def follows(self, rids: list[str], tables: list[list[int]], computed: list[int], ctx: int) -> bool:
        """Whether a decode group of ``rids`` at ``computed`` tokens is the last step's one more token on."""
        return (rids == self.rids and computed == self.lengths and ctx <= self.capacity
                and all(table[:len(old)] == old for table, old in zip(tables, self.tables)))


# Decode groups of at most this many sequences attend with one SDPA call instead of the batched matmuls:
# at batch 1 it measured ~30 us a layer against ~63 us for baddbmm + softmax + bmm (small bf16 batched
# matmuls have a high fixed cost); from batch 4 on SDPA is the slower one.
SDPA_DECODE_MAX_BATCH = 2
# A rebuilt mirror has room for this many more tokens per sequence, so it is regathered once every this
# many steps of an unchanged batch.
MIRROR_SLACK = 32
# The mirror may take at most this share of the KV pool's bytes; larger groups gather every step.
MIRROR_POOL_SHARE = 0.5
# The C kernel reads keys 16 at a time: its mirror's capacity is a multiple of this.
KERNEL_BLOCK = 16


# Groups whose sequences bring at most this many query tokens attend with two batched matmuls instead of
# SDPA: a short chunk of a long prompt (chunked prefill beside decodes) measured ~2x faster that way on
# CPU at a 2k-token context, where SDPA's tiling costs more than the work; longer queries favour SDPA.
SMALL_QUERY_MAX = 8


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


class TorchSDPABackend:
    """Portable paged attention: gather K/V by slot, then ``F.scaled_dot_product_attention``."""

    name = "torch_sdpa"

    def __init__(self, sliding_windows: list[int | None] | tuple[int | None, ...] = (),
                 decode_kernel: DecodeAttentionKernel | None = None):
        """``sliding_windows[layer]``: that layer's window in tokens, None for full attention (layers
        not listed attend fully). ``decode_kernel``: the C kernel for decode groups on CPU, if built."""
        windows = list(dict.fromkeys(sliding_windows)) or [None]
        self.windows: tuple[int | None, ...] = tuple(windows)
        self.mask_of_layer: tuple[int, ...] = tuple(windows.index(w) for w in sliding_windows)
        self.decode_kernel = decode_kernel
        self._mirror: _DecodeMirror | None = None

    def forget(self) -> None:
        """Drop the decode mirror: a sequence it holds was dropped, or the pool was written outside steps
        (warmup). Needed for correctness only when a dropped request comes back under the same id."""
        self._mirror = None

    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device,
                       seq_ids: list[str] | None = None) -> AttentionMetadata:
        """Index tensors for one step. Host work is per sequence, never per token; the shapes come from
        the host lists so that nothing here waits on the device. ``seq_ids`` (request ids) let a CPU
        decode group reuse the last step's gathered K/V; without them every step gathers."""
        block_size = kv_cache.block_size
        num_seqs = len(query_lens)
        num_tokens = sum(query_lens)
        padding_block = kv_cache.num_blocks
        max_blocks = max(len(table) for table in block_tables)

        query_lens_t = torch.tensor(query_lens, dtype=torch.long, device=device)
        num_computed_t = torch.tensor(num_computed, dtype=torch.long, device=device)
        blocks_per_seq = torch.tensor([len(table) for table in block_tables], dtype=torch.long, device=device)
        flat_blocks = torch.tensor(list(itertools.chain.from_iterable(block_tables)), dtype=torch.long,
                                   device=device)
        # Padded [N, max_blocks] block table, filled by scatter rather than by padding lists in Python.
        tables = torch.full((num_seqs, max_blocks), padding_block, dtype=torch.long, device=device)
        table_rows = torch.repeat_interleave(torch.arange(num_seqs, device=device), blocks_per_seq,
                                             output_size=flat_blocks.numel())
        table_cols = (torch.arange(flat_blocks.numel(), device=device)
                      - torch.repeat_interleave(_exclusive_cumsum(blocks_per_seq), blocks_per_seq,
                                                output_size=flat_blocks.numel()))
        tables[table_rows, table_cols] = flat_blocks

        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens_t,
                                               output_size=num_tokens)
        query_starts = _exclusive_cumsum(query_lens_t)
        positions = (torch.arange(num_tokens, device=device) - query_starts[seq_of_token]
                     + num_computed_t[seq_of_token])
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

        decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
        prefill_seqs = [i for i, n in enumerate(query_lens) if n > 1]
        groups = []
        for members in (decode_seqs, prefill_seqs):
            if not members:
                continue
            max_query_len = max(query_lens[i] for i in members)
            max_ctx = max(num_computed[i] + query_lens[i] for i in members)
            group_tokens = sum(query_lens[i] for i in members)
            members_t = torch.tensor(members, dtype=torch.long, device=device)
            lens = query_lens_t[members_t]
            computed = num_computed_t[members_t]
            context_lens = computed + lens
            batch = len(members)

            group_starts = _exclusive_cumsum(lens)
            within = torch.arange(group_tokens, device=device)
            token_index = within + torch.repeat_interleave(query_starts[members_t] - group_starts, lens,
                                                           output_size=group_tokens)
            if group_tokens == batch * max_query_len:  # equal lengths (decodes, one prompt): no padding
                padded_row = None
            else:
                padded_row = within + torch.repeat_interleave(
                    torch.arange(batch, device=device) * max_query_len - group_starts, lens,
                    output_size=group_tokens)

            ctx_blocks = -(-max_ctx // block_size)
            max_ctx = ctx_blocks * block_size
            block_index = tables[members_t][:, :ctx_blocks]
            mirror = None
            if max_query_len == 1 and seq_ids is not None and device.type == "cpu":
                mirror = self._mirror_for([seq_ids[i] for i in members], [block_tables[i] for i in members],
                                          [num_computed[i] for i in members], max_ctx, block_index, kv_cache)
                if mirror is not None and mirror.for_kernel:
                    groups.append(AttentionGroup(
                        batch=batch, max_query_len=1, token_index=None if group_tokens == num_tokens else token_index,
                        padded_row=None, block_index=block_index, masks=(), mirror=mirror, context_lens=context_lens,
                        window_starts=tuple(torch.zeros_like(context_lens) if window is None
                                            else (context_lens - window).clamp_(min=0) for window in self.windows)))
                    continue
                if mirror is not None:
                    # The matmuls read the mirror's whole rows (a narrower view would make bmm copy it);
                    # the mask covers the unused tail.
                    max_ctx = mirror.capacity
            key_pos = torch.arange(max_ctx, device=device)
            in_context = key_pos[None, :] < context_lens[:, None]  # [B, max_ctx]
            query_pos = computed[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [B, max_q]
            # Padded query rows (beyond a sequence's length) still see its whole context: never a fully
            # masked row, so SDPA returns finite values that are then dropped.
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]
            masks = tuple(self._windowed(mask, key_pos, query_pos, context_lens, window).unsqueeze(1)
                          for window in self.windows)
            matmul_biases = ()
            if max_query_len <= SMALL_QUERY_MAX:
                shape = (batch, 1, max_ctx) if max_query_len == 1 else (batch, max_query_len, 1, max_ctx)
                matmul_biases = tuple(
                    torch.zeros(m.shape, dtype=kv_cache.key.dtype, device=device).masked_fill_(~m, float("-inf"))
                    .view(shape).repeat(kv_cache.num_kv_heads, *[1] * (len(shape) - 1))
                    for m in masks)
            group = AttentionGroup(batch=batch, max_query_len=max_query_len,
                                   token_index=None if group_tokens == num_tokens else token_index,
                                   padded_row=padded_row, block_index=block_index, masks=masks,
                                   matmul_biases=matmul_biases)
            if mirror is not None:
                group.mirror = mirror
                group.mirror_slots = torch.arange(batch) * mirror.capacity + computed
            groups.append(group)
        if seq_ids is not None and not any(g.mirror is not None for g in groups):
            self._mirror = None  # no decode group this step: the next one starts afresh
        return AttentionMetadata(positions=positions, slot_mapping=slot_mapping, groups=groups)

    def _mirror_for(self, rids: list[str], tables: list[list[int]], computed: list[int], max_ctx: int,
                    block_index: torch.Tensor, kv_cache: PagedKVCache) -> _DecodeMirror | None:
        """The mirror holding this decode group's context: the last step's, or one rebuilt with a gather
        for every layer; None (the group gathers) when it would be too big."""
        mirror = self._mirror
        if mirror is None or not mirror.follows(rids, tables, computed, max_ctx):
            self._mirror = None
            kernel = self.decode_kernel
            for_kernel = kernel is not None and kernel.supports(kv_cache.key.dtype, kv_cache.head_dim)
            # The kernel reads each sequence's own context only, so room to grow costs it memory, not time:
            # it gets as much again as the context (one rebuild where the matmuls would need several),
            # or the matmuls' slack if that does not fit.
            for slack in ((max(max_ctx, MIRROR_SLACK), MIRROR_SLACK) if for_kernel else (MIRROR_SLACK,)):
                capacity = max_ctx + slack
                if for_kernel:
                    capacity = -(-capacity // KERNEL_BLOCK) * KERNEL_BLOCK
                shape = (kv_cache.num_layers, kv_cache.num_kv_heads, len(rids), capacity, kv_cache.head_dim)
                if 2 * math.prod(shape) * kv_cache.key.element_size() <= MIRROR_POOL_SHARE * kv_cache.nbytes:
                    break
            else:
                return None
            dense = []
            for pool in (kv_cache.key, kv_cache.value):
                gathered = pool.new_zeros(shape)
                gathered[:, :, :, :max_ctx] = pool.index_select(2, block_index.reshape(-1)).view(
                    *shape[:3], max_ctx, shape[4])
                dense.append(gathered)
            if for_kernel:
                dense = self.decode_kernel.layout(*dense)
            mirror = _DecodeMirror(rids, [], computed, dense[0], dense[1], capacity, for_kernel)
        mirror.tables = [list(t) for t in tables]
        mirror.lengths = [c + 1 for c in computed]
        self._mirror = mirror
        return mirror

    @staticmethod
    def _windowed(mask: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor,
                  context_lens: torch.Tensor, window: int | None) -> torch.Tensor:
        """``mask`` restricted to the keys less than ``window`` positions behind each query."""
        if window is None or window >= key_pos.numel():  # every key is inside every query's window
            return mask
        # Padded query rows take the window of their sequence's last token, so they are never fully
        # masked either.
        last_pos = torch.minimum(query_pos, context_lens[:, None] - 1)
        return mask & (key_pos[None, None, :] > (last_pos - window)[:, :, None])

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` of the step's new tokens -> ``[T, Hq, D]``."""
        key_slots, value_slots = kv_cache.layer_slots(layer)  # [Hkv, slots, D]
        mask_index = self.mask_of_layer[layer] if len(self.windows) > 1 else 0
        if len(meta.groups) == 1 and meta.groups[0].context_lens is not None:
            # Decodes only, by the kernel: it writes the pool too.
            group = meta.groups[0]
            return self.decode_kernel(query, key, value, group.mirror.key[layer], group.mirror.value[layer],
                                      group.context_lens, group.window_starts[mask_index], scale,
                                      pool=(key_slots, value_slots, meta.slot_mapping))
        key_slots.index_copy_(1, meta.slot_mapping, key.transpose(0, 1))
        value_slots.index_copy_(1, meta.slot_mapping, value.transpose(0, 1))
        key_blocks, value_blocks = kv_cache.layer_blocks(layer)

        out = None if len(meta.groups) == 1 else query.new_empty(query.shape)
        for group in meta.groups:
            group_queries = query if group.token_index is None else query.index_select(0, group.token_index)
            if group.mirror is not None:
                group_keys, group_values = ((key, value) if group.token_index is None else
                                            (key.index_select(0, group.token_index),
                                             value.index_select(0, group.token_index)))
                if group.context_lens is not None:  # the kernel, beside other groups: the pool is written
                    attended = self.decode_kernel(group_queries, group_keys, group_values, group.mirror.key[layer],
                                                  group.mirror.value[layer], group.context_lens,
                                                  group.window_starts[mask_index], scale)
                else:
                    attended = self._mirrored(layer, group_queries, group_keys, group_values, group, mask_index,
                                              scale)
            elif group.matmul_biases:
                attended = self._matmul(group_queries, key_blocks, value_blocks, group, mask_index, scale)
            else:
                attended = self._prefill(group_queries, key_blocks, value_blocks, group, mask_index, scale)
            if group.token_index is None:
                return attended
            out.index_copy_(0, group.token_index, attended)
        return out

    @staticmethod
    def _mirrored(layer: int, queries, keys, values, group: AttentionGroup, mask_index: int, scale: float):
        """A decode group over the mirror: this step's K/V go into it, then the matmuls read it in place."""
        contexts = []
        for dense, new in ((group.mirror.key[layer], keys), (group.mirror.value[layer], values)):
            dense.view(dense.shape[0], -1, dense.shape[3]).index_copy_(1, group.mirror_slots, new.transpose(0, 1))
            contexts.append(dense.flatten(0, 1))  # [Hkv * B, capacity, D]
        return TorchSDPABackend._attend(queries, contexts[0], contexts[1], group, mask_index, scale)

    @staticmethod
    def _matmul(queries, key_blocks, value_blocks, group: AttentionGroup, mask_index: int, scale: float):
        """Few queries per sequence: two batched matmuls over ``[Hkv * B]`` with each sequence's queries
        times the GQA group as rows, softmax in float32 (as transformers' eager attention). A fused SDPA
        kernel tiles for long queries and measured several times slower here for decodes at batch 64."""
        keys = _gather(key_blocks, group.block_index).flatten(0, 1)  # [Hkv * B, ctx, D]
        values = _gather(value_blocks, group.block_index).flatten(0, 1)
        return TorchSDPABackend._attend(queries, keys, values, group, mask_index, scale)

    @staticmethod
    def _attend(queries, keys, values, group: AttentionGroup, mask_index: int, scale: float):
        """The matmuls of ``_matmul`` over ``keys``/``values [Hkv * B, ctx, D]``."""
        batch, max_q = group.batch, group.max_query_len
        num_heads, head_dim = queries.shape[1], queries.shape[2]
        num_kv_heads = keys.shape[0] // batch
        per_kv = num_heads // num_kv_heads
        padded = _padded_queries(queries, group)  # [B, max_q, Hq, D]
        # rows of sequence b under kv head h: its queries in order, each times the heads sharing h
        q = padded.view(batch, max_q, num_kv_heads, per_kv, head_dim).permute(2, 0, 1, 3, 4)
        q = q.reshape(num_kv_heads * batch, max_q * per_kv, head_dim)
        bias = group.matmul_biases[mask_index]
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
        attended = torch.bmm(probs, values)  # [Hkv * B, max_q * per_kv, D]
        attended = attended.view(num_kv_heads, batch, max_q, per_kv, head_dim).permute(1, 2, 0, 3, 4)
        return _unpadded(attended.reshape(batch * max_q, num_heads, head_dim), group)

    @staticmethod
    def _prefill(queries, key_blocks, value_blocks, group: AttentionGroup, mask_index: int, scale: float):
        """Multi-token queries: one padded SDPA call with the group's boolean mask."""
        batch, max_q = group.batch, group.max_query_len
        num_heads = queries.shape[1]
        padded_queries = _padded_queries(queries, group)
        keys = _gather(key_blocks, group.block_index).transpose(0, 1)  # [B, Hkv, ctx, D]
        values = _gather(value_blocks, group.block_index).transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            padded_queries.transpose(1, 2), keys, values, attn_mask=group.masks[mask_index], scale=scale,
            enable_gqa=num_heads != keys.shape[1])
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


def make_attention_backend(device: torch.device,
                           sliding_windows: list[int | None] | tuple[int | None, ...] = ()) -> TorchSDPABackend:
    """The attention backend for ``device``: SDPA everywhere (it picks fused kernels itself), with the C
    decode kernel on CPU where it builds. ``sliding_windows``: each layer's window, None for full
    attention (see ``TorchSDPABackend``)."""
    return TorchSDPABackend(sliding_windows, decode_attention_kernel() if device.type == "cpu" else None)
