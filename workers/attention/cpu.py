"""The CPU backend: decodes by the C kernel of ``decode_kernel.py``, reading the paged pool in place.

A decode step's attention is memory-bound: each sequence's K/V rows are read once per layer. The kernel
reads them where they lie, through each sequence's block table, and writes the step's new K/V itself:
one call per layer instead of a gather that copies every context, padded to the longest, plus two batched
matmuls of tiny GEMVs and a softmax. Groups with longer queries (prompts, chunks) attend as the portable
backend does, unless ``prompt_rows`` makes their tokens kernel rows too (``KernelRows``); in a step with both, every new
token is written first by the kernel's writer, then the kernel attends the decodes.

For bfloat16 the pool's blocks are kept in the kernel's layout (``DecodeAttentionKernel.to_layout``: the
operand order of AVX512-BF16's dot products), so the torch paths convert blocks back as they gather them;
float32 blocks are stored as torch reads them, and so are float16 ones (a float32 model's narrower cache,
``--kv-cache-dtype float16``: the kernel rounds K/V as it writes them and widens them as it reads). A pool
the kernel cannot take (another dtype, or bf16 blocks of a size not a multiple of 16) is handled entirely by
the portable path.
"""

from __future__ import annotations

import torch

from llmbus.workers.attention.base import (AttentionMetadata, KernelRows, StepIndex, group_token_index, into,
                                          step_index)
from llmbus.workers.attention.decode_kernel import DecodeAttentionKernel, decode_attention_kernel
from llmbus.workers.attention.torch_sdpa import TorchSDPABackend
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import to_device

class CPUKernelBackend(TorchSDPABackend):
    """Paged attention on CPU: the C decode kernel over the pool in place, the portable path for the rest."""

    name = "cpu_kernel"
    gives_kernel_rows = True

    def __init__(self, sliding_windows: list[int | None] | tuple[int | None, ...] = (),
                 kernel: DecodeAttentionKernel | None = None, *, prompt_rows: bool = False,
                 softcaps: list[float | None] | tuple[float | None, ...] = (),
                 sinks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] = ()):
        """``prompt_rows``: every token of a float32 step with prompts as a kernel row of its own, attending
        its sequence's keys up to itself (the kernel writes all rows' K/V before it attends), so that such a
        step is one group of kernel rows: what the fused layer (fused_decode.py) takes in one native call."""
        super().__init__(sliding_windows, prompt_rows=prompt_rows, softcaps=softcaps, sinks=sinks)
        kernel = kernel or decode_attention_kernel()
        if kernel is None:
            raise RuntimeError("the CPU decode attention kernel could not be built")
        self.kernel = kernel

    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device,
                       key_limits: list[int] | None = None) -> AttentionMetadata:
        if max(query_lens) == 1 and self._takes(kv_cache):
            return self._decodes_metadata(num_computed, block_tables, kv_cache, device)
        if (self.prompt_rows and max(query_lens) > 1 and kv_cache.compute_dtype == torch.float32
                and self._takes(kv_cache)):
            # Every prompt, however long: the kernel's scores scratch is one slot a thread (SCORE_SLOTS),
            # so a step's length never switches its rows to another algorithm (issue #35 part 4).
            max_context = max(c + n for c, n in zip(num_computed, query_lens))
            index = step_index(query_lens, num_computed, block_tables, kv_cache, device)
            rows = torch.repeat_interleave(torch.arange(len(query_lens), device=device), index.query_lens,
                                           output_size=sum(query_lens))
            # the kernel writes every row's K/V before any row attends: a row may see later rows of its step
            context_lens = (index.positions if key_limits is None
                            else to_device(key_limits, torch.long, device)) + 1
            group = KernelRows(
                token_index=None, block_index=index.tables[rows][:, :-(-max_context // kv_cache.block_size)],
                context_lens=context_lens, window_starts=self._window_starts(index.positions + 1),
                max_context=max_context)
            return AttentionMetadata(positions=index.positions, slot_mapping=index.slot_mapping, groups=[group],
                                     kernel_rows=group, sequence_starts=index.query_starts)
        return super().build_metadata(query_lens=query_lens, num_computed=num_computed, block_tables=block_tables,
                                      kv_cache=kv_cache, device=device, key_limits=key_limits)

    def _decodes_metadata(self, num_computed: list[int], block_tables: list[list[int]], kv_cache: PagedKVCache,
                          device: torch.device) -> AttentionMetadata:
        """A decode-only step's one kernel group, built from the host lists with a tensor per field: the
        general path's ~20 small tensor ops are a visible share of a batch-1 step (design notes,
        "Attention backends")."""
        block_size, spare = kv_cache.block_size, kv_cache.num_blocks
        max_context = max(num_computed) + 1
        width = -(-max_context // block_size)
        tables = [table[:width] if len(table) >= width else table + [spare] * (width - len(table))
                  for table in block_tables]
        slots = [table[c // block_size] * block_size + c % block_size for c, table in zip(num_computed, block_tables)]
        positions = torch.tensor(num_computed, dtype=torch.long, device=device)
        context_lens = positions + 1
        group = KernelRows(token_index=None, block_index=torch.tensor(tables, dtype=torch.long, device=device),
                           context_lens=context_lens, window_starts=self._window_starts(context_lens),
                           max_context=max_context)
        return AttentionMetadata(positions=positions, groups=[group], kernel_rows=group,
                                 slot_mapping=torch.tensor(slots, dtype=torch.long, device=device))

    def _window_starts(self, own_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each row's first visible key per window, from ``own_lens``: its position + 1 (not its limit's)."""
        return tuple(torch.zeros_like(own_lens) if window is None else (own_lens - window).clamp_(min=0)
                     for window in self.windows)

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return device.type == "cpu" and decode_attention_kernel() is not None

    def _takes(self, kv_cache: PagedKVCache) -> bool:
        """Whether the kernel attends (and lays out) this pool."""
        return self.kernel.supports(kv_cache.key.dtype, kv_cache.head_dim, kv_cache.block_size, kv_cache.compute_dtype)

    def _own_layout(self, kv_cache: PagedKVCache) -> bool:
        return self._takes(kv_cache) and self.kernel.uses_own_layout(kv_cache.key.dtype)

    def _decode_groups(self, decodes: list[int], query_lens: list[int], num_computed: list[int],
                       kv_cache: PagedKVCache) -> list[list[int]]:
        if decodes and self._takes(kv_cache):
            return [decodes]  # the kernel reads each context at its own length: nothing to bucket
        return super()._decode_groups(decodes, query_lens, num_computed, kv_cache)

    def _decode_group(self, index: StepIndex, members: list[int], query_lens: list[int], num_computed: list[int],
                      kv_cache: PagedKVCache, device: torch.device):
        if not self._takes(kv_cache):
            return super()._decode_group(index, members, query_lens, num_computed, kv_cache, device)
        members_t, token_index = group_token_index(index, members, query_lens, device)
        max_context = max(num_computed[i] for i in members) + 1
        context_lens = index.num_computed[members_t] + 1
        return KernelRows(
            token_index=token_index,
            block_index=index.tables[members_t][:, :-(-max_context // kv_cache.block_size)],
            context_lens=context_lens, window_starts=self._window_starts(context_lens), max_context=max_context)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        group = meta.kernel_rows
        if group is not None:
            # The whole step as kernel rows: the kernel writes each new token's K/V as it attends.
            key_blocks, value_blocks = kv_cache.layer_blocks(layer)
            return into(out, self.kernel(query, key_blocks, value_blocks, group.block_index, group.context_lens,
                                         group.window_starts[self.window_index(layer)], group.max_context, scale,
                                         new=(key, value, meta.slot_mapping), softcap=self.layer_softcap(layer),
                                         sinks=self.layer_sinks(layer)))
        return super().forward(layer, query, key, value, kv_cache, meta, scale, out)

    def _write(self, layer: int, kv_cache: PagedKVCache, slots: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> None:
        if not self._own_layout(kv_cache):
            return super()._write(layer, kv_cache, slots, key, value)
        self.kernel.write(key, value, *kv_cache.layer_blocks(layer), slots)

    def _context(self, layer: int, kv_cache: PagedKVCache,
                 block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super()._context(layer, kv_cache, block_index)
        if not self._own_layout(kv_cache):
            return keys, values
        num_kv_heads, batch, ctx, head_dim = keys.shape
        block_size = kv_cache.block_size
        blocks = (num_kv_heads, batch, ctx // block_size, block_size, head_dim)
        keys, values = self.kernel.from_layout(keys.view(blocks), values.view(blocks))
        return keys.view(num_kv_heads, batch, ctx, head_dim), values.view(num_kv_heads, batch, ctx, head_dim)

    def _attend(self, layer: int, group, queries: torch.Tensor, kv_cache: PagedKVCache, window: int,
                scale: float) -> torch.Tensor:
        if not isinstance(group, KernelRows):
            return super()._attend(layer, group, queries, kv_cache, window, scale)
        # Beside other groups: ``_write`` has put every new token in the pool already.
        key_blocks, value_blocks = kv_cache.layer_blocks(layer)
        return self.kernel(queries, key_blocks, value_blocks, group.block_index, group.context_lens,
                           group.window_starts[window], group.max_context, scale,
                           softcap=self.layer_softcap(layer), sinks=self.layer_sinks(layer))
