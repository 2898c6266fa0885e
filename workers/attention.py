"""Attention over the paged KV cache.

A backend does two things: ``build_metadata`` once per step (index tensors shared by every layer) and
``forward`` once per layer (write the step's K/V into their slots, then attend). ``TorchSDPABackend`` is
the portable path: it gathers each sequence's K/V into a padded ``[B, max_ctx]`` batch and runs
``scaled_dot_product_attention`` with a boolean mask carrying causality, each sequence's offset and
its length. Single-token queries (decodes) and multi-token queries (prefills, chunks) are separate
groups, so one long prompt does not pad every decode row to its length. A flash-attention backend for
CUDA can implement the same two methods over the same cache layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.workers.kv_cache import PagedKVCache


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one padded SDPA call."""

    batch: int
    max_query_len: int
    token_index: torch.Tensor | None  # [Tg] rows of the step's flat token batch in this group; None: all, in order
    padded_row: torch.Tensor | None  # [Tg] row of each token in the [batch * max_query_len] layout; None: no padding
    slot_index: torch.Tensor  # [batch, max_ctx] KV slot of each context position, the padding slot past the end
    mask: torch.Tensor  # [batch, 1, max_query_len, max_ctx] True where the query may attend the key


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step index tensors, built once and used by every layer."""

    positions: torch.Tensor  # [T] position of each new token in its sequence (RoPE input)
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    groups: list[AttentionGroup]


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


class TorchSDPABackend:
    """Portable paged attention: gather K/V by slot, then ``F.scaled_dot_product_attention``."""

    name = "torch_sdpa"

    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device) -> AttentionMetadata:
        """Index tensors for one step. Host work is per sequence, never per token; the shapes come from
        the host lists so that nothing here waits on the device."""
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

            key_pos = torch.arange(max_ctx, device=device)
            in_context = key_pos[None, :] < context_lens[:, None]  # [B, max_ctx]
            slots = (tables[members_t][:, key_pos // block_size] * block_size + key_pos % block_size)
            slot_index = torch.where(in_context, slots, kv_cache.padding_slot)
            query_pos = computed[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [B, max_q]
            # Padded query rows (beyond a sequence's length) still see its whole context: never a fully
            # masked row, so SDPA returns finite values that are then dropped.
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]
            groups.append(AttentionGroup(batch=batch, max_query_len=max_query_len,
                                         token_index=None if group_tokens == num_tokens else token_index,
                                         padded_row=padded_row, slot_index=slot_index,
                                         mask=mask.unsqueeze(1)))
        return AttentionMetadata(positions=positions, slot_mapping=slot_mapping, groups=groups)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` of the step's new tokens -> ``[T, Hq, D]``."""
        key_slots, value_slots = kv_cache.layer_slots(layer)
        key_slots.index_copy_(0, meta.slot_mapping, key)
        value_slots.index_copy_(0, meta.slot_mapping, value)

        num_heads, head_dim = query.shape[1], query.shape[2]
        grouped_query = num_heads != key.shape[1]
        out = None if len(meta.groups) == 1 else torch.empty_like(query)
        for group in meta.groups:
            batch, max_q = group.batch, group.max_query_len
            group_queries = query if group.token_index is None else query.index_select(0, group.token_index)
            if group.padded_row is None:
                padded_queries = group_queries.view(batch, max_q, num_heads, head_dim)
            else:
                padded_queries = query.new_zeros(batch * max_q, num_heads, head_dim)
                padded_queries.index_copy_(0, group.padded_row, group_queries)
                padded_queries = padded_queries.view(batch, max_q, num_heads, head_dim)
            keys = key_slots[group.slot_index]  # [B, max_ctx, Hkv, D]
            values = value_slots[group.slot_index]
            attended = F.scaled_dot_product_attention(
                padded_queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=group.mask, scale=scale, enable_gqa=grouped_query)
            attended = attended.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
            if group.padded_row is not None:
                attended = attended.index_select(0, group.padded_row)
            if group.token_index is None:
                return attended
            out.index_copy_(0, group.token_index, attended)
        return out


def make_attention_backend(device: torch.device) -> TorchSDPABackend:
    """The attention backend for ``device``; SDPA everywhere for now (it picks fused kernels itself)."""
    return TorchSDPABackend()
