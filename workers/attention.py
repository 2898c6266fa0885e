"""Attention over the paged KV cache.

A backend does two things: ``build_metadata`` once per step (index tensors shared by every layer) and
``forward`` once per layer (write the step's K/V into their slots, then attend). ``TorchSDPABackend`` is
the portable path: it gathers each sequence's K/V into a padded ``[B, max_ctx]`` batch and runs
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
    # [batch, 1, max_query_len, max_ctx] True where the query may attend the key: one mask per distinct
    # window of the backend (``TorchSDPABackend.windows``), in that order.
    masks: tuple[torch.Tensor, ...]


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

    def __init__(self, sliding_windows: list[int | None] | tuple[int | None, ...] = ()):
        """``sliding_windows[layer]``: that layer's window in tokens, None for full attention (layers
        not listed attend fully)."""
        windows = list(dict.fromkeys(sliding_windows)) or [None]
        self.windows: tuple[int | None, ...] = tuple(windows)
        self.mask_of_layer: tuple[int, ...] = tuple(windows.index(w) for w in sliding_windows)

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
            masks = tuple(self._windowed(mask, key_pos, query_pos, context_lens, window).unsqueeze(1)
                          for window in self.windows)
            groups.append(AttentionGroup(batch=batch, max_query_len=max_query_len,
                                         token_index=None if group_tokens == num_tokens else token_index,
                                         padded_row=padded_row, slot_index=slot_index, masks=masks))
        return AttentionMetadata(positions=positions, slot_mapping=slot_mapping, groups=groups)

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
        key_slots, value_slots = kv_cache.layer_slots(layer)
        key_slots.index_copy_(0, meta.slot_mapping, key)
        value_slots.index_copy_(0, meta.slot_mapping, value)

        num_heads, head_dim = query.shape[1], query.shape[2]
        grouped_query = num_heads != key.shape[1]
        out = None if len(meta.groups) == 1 else torch.empty_like(query)
        mask_index = self.mask_of_layer[layer] if len(self.windows) > 1 else 0
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
                attn_mask=group.masks[mask_index], scale=scale, enable_gqa=grouped_query)
            attended = attended.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
            if group.padded_row is not None:
                attended = attended.index_select(0, group.padded_row)
            if group.token_index is None:
                return attended
            out.index_copy_(0, group.token_index, attended)
        return out


def make_attention_backend(device: torch.device,
                           sliding_windows: list[int | None] | tuple[int | None, ...] = ()) -> TorchSDPABackend:
    """The attention backend for ``device``; SDPA everywhere for now (it picks fused kernels itself).
    ``sliding_windows``: each layer's window, None for full attention (see ``TorchSDPABackend``)."""
    return TorchSDPABackend(sliding_windows)
