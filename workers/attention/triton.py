"""The Triton backend: paged attention that reads and writes the pool in place, one kernel launch per layer.

Every row kind a step can hold (decodes, prompt chunks over cached blocks, speculative rows) goes through
one varlen kernel (``triton_kernels.paged_attention``): each query token attends its own sequence's keys up
to itself, through the block table, with an online softmax over tiles of keys. Nothing is gathered, padded
or masked densely, so a step's attention needs no memory beyond its output, whatever its shape: the
portable backend's gathers and SDPA's math fallback (float32 ``[heads, query, context]`` scores for a
boolean mask with GQA) are what ran a GPU out of memory on long prompts.

The pool keeps torch's layout (``PagedKVCache``: ``[layers, Hkv, blocks + 1, block_size, D]``, each block's
keys contiguous rows of D), so it holds exactly what the portable backend's pool holds. The step's new K/V
are written through the slot mapping before the kernel reads them, since a chunk's later tokens attend its
earlier ones and the kernel's programs run in no order: by ``index_copy_`` in ``forward``, and in
``forward_rotary`` (the native decoder's call) by the kernel that rotates the queries and keys, one launch
for what took the rotary kernel and the write's copies.

Runs on CUDA (triton ships inside torch's CUDA wheels), or on any device under ``TRITON_INTERPRET=1``,
where Triton's interpreter runs the same kernels on the CPU, slowly: how CI tests their numerics. triton is
imported only when the backend is made, so ``llmbus.workers.attention`` imports without it.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from llmbus.workers.attention.base import (AttentionBackend, AttentionMetadata, DecodeGraphInputs, MixedGraphIndex,
                                           step_index)
from llmbus.workers.gpu_ops import interpreting
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import to_device


@dataclass(slots=True)
class TritonStep:
    """One step's index tensors, shared by every layer's launch."""

    tables: torch.Tensor  # [N, max_blocks] int64 each sequence's blocks, padded with the pool's spare block
    programs: torch.Tensor  # [2, P] int32 each program's sequence and first row (base.step_index's)
    block_q: int  # query tokens per program
    query_starts: torch.Tensor  # [N] int64 each sequence's first row of the flat token batch
    query_lens: torch.Tensor  # [N] int64
    num_computed: torch.Tensor  # [N] int64 tokens already in the cache before this step's
    # [T] int64 each row's last visible position (build_metadata's key_limits); None: its own. Graphs' steps
    # have none: a step with an image's rows runs eagerly.
    key_limits: torch.Tensor | None = None


@functools.cache
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def load_kernels() -> ModuleType:
    """``triton_kernels``, whose kernels (and triton's own library functions) were decorated for the
    interpreter or for the GPU when triton was first imported in this process: ``triton.jit`` reads
    ``TRITON_INTERPRET`` then, once. A process that changed the variable since cannot run them."""
    from llmbus.workers.attention import triton_kernels

    if triton_kernels.interpreted() != interpreting():
        raise RuntimeError(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} now, but triton was "
                           f"imported in this process under the other setting: set it before the process starts")
    return triton_kernels


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: every row of a step in one launch per layer, over the pool in place."""

    name = "triton"

    def __init__(self, sliding_windows: list[int | None] | tuple[int | None, ...] = (), *,
                 prompt_rows: bool = False, softcaps: list[float | None] | tuple[float | None, ...] = (),
                 sinks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] = ()):
        """``prompt_rows`` is accepted for the interface and has no effect: this backend gives no kernel rows
        (``gives_kernel_rows`` is False), every step is one launch already."""
        super().__init__(sliding_windows, prompt_rows=prompt_rows, softcaps=softcaps, sinks=sinks)
        if not triton_importable():
            raise RuntimeError("the triton attention backend needs triton (pip install triton; torch's CUDA "
                               "wheels ship it)")
        self.kernels = load_kernels()

    @classmethod
    def available(cls, device: torch.device) -> bool:
        """CUDA with triton installed; any device under ``TRITON_INTERPRET=1`` (the interpreter, for tests)."""
        if not triton_importable():
            return False
        return interpreting() or (device.type == "cuda" and torch.cuda.is_available())

    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device,
                       key_limits: list[int] | None = None) -> AttentionMetadata:
        """``key_limits`` go over in a copy of their own (``step_index`` sends a fixed set of fields) and reach
        the kernel, which then compiles with them (``LIMITS``); None keeps the causal kernel."""
        block_q = self.kernels.query_tile(max(query_lens))
        index = step_index(query_lens, num_computed, block_tables, kv_cache, device, query_tile=block_q)
        limits = None
        if key_limits is not None:
            if len(key_limits) != index.positions.shape[0]:  # the kernel would read past them
                raise ValueError(f"key_limits has {len(key_limits)} values for a step of "
                                 f"{index.positions.shape[0]} tokens")
            limits = to_device(key_limits, torch.long, device)
        step = TritonStep(tables=index.tables, programs=index.programs,
                          block_q=block_q, query_starts=index.query_starts, query_lens=index.query_lens,
                          num_computed=index.num_computed, key_limits=limits)
        return AttentionMetadata(positions=index.positions, slot_mapping=index.slot_mapping, groups=[step],
                                 sequence_starts=index.query_starts)

    def decode_graph_metadata(self, inputs: DecodeGraphInputs, batch: int) -> AttentionMetadata:
        """One program per row, as ``build_metadata`` plans a decode-only step; each row is its own sequence,
        so its first row, its length (1) and its program map are constants of the batch size."""
        device = inputs.positions.device
        rows = torch.arange(batch, dtype=torch.long, device=device)
        step = TritonStep(tables=inputs.tables[:batch], programs=torch.stack((rows, rows)).to(torch.int32),
                          block_q=self.kernels.query_tile(1), query_starts=rows,
                          query_lens=torch.ones(batch, dtype=torch.long, device=device),
                          num_computed=inputs.positions[:batch])
        return AttentionMetadata(positions=inputs.positions[:batch], slot_mapping=inputs.slot_mapping[:batch],
                                 groups=[step])

    def mixed_graph_index(self, max_tokens: int, max_blocks: int, kv_cache: PagedKVCache) -> MixedGraphIndex:
        """Query tiles of the prompt steps' size (16 tokens) whatever the step: a decode row takes a tile of
        its own, as it does in an eager step beside a prompt chunk."""
        return MixedGraphIndex(max_tokens, max_blocks, kv_cache.block_size, self.kernels.query_tile(max_tokens),
                               kv_cache.key.device, kv_cache.num_blocks)

    def mixed_graph_metadata(self, index: MixedGraphIndex, size: int) -> AttentionMetadata:
        """``build_metadata``'s step over ``index``'s buffers: all of its program map that a bucket of ``size``
        tokens may need (those past the step's own attend nothing), every sequence row, the fixed-width
        tables."""
        step = TritonStep(tables=index.tables, programs=index.programs[:, :index.programs_for(size)],
                          block_q=index.query_tile, query_starts=index.query_starts, query_lens=index.query_lens,
                          num_computed=index.num_computed)
        return AttentionMetadata(positions=index.positions[:size], slot_mapping=index.slot_mapping[:size],
                                 groups=[step])

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """One launch where the keys and values have the pool's dtype: the kernel writes them into their slots
        as it attends (reading them from ``key``/``value``, not from the pool, where another of its programs
        may be writing them). A pool of another dtype (``--kv-cache-dtype float16`` under float32) has them
        written first, as the pool would round them."""
        if key.dtype != kv_cache.key.dtype or value.dtype != kv_cache.value.dtype:
            kv_cache.write(layer, meta.slot_mapping, key, value)
            return self._attend(layer, query, kv_cache, meta, scale, out)
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            key, value = key.contiguous(), value.contiguous()
        return self._attend(layer, query, kv_cache, meta, scale, out, new_kv=(key, value, meta.slot_mapping))

    def forward_rotary(self, layer: int, qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                       signed_sin: torch.Tensor, num_heads: int, kv_cache: PagedKVCache, meta: AttentionMetadata,
                       scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE and the K/V write in one kernel (``triton_kernels.rotary_kv_write``) where the whole head is
        rotated and the heads are contiguous rows; partial rotation takes the base class's path."""
        if cos.shape[-1] != qk.shape[-1] or qk.stride(-1) != 1 or value.stride(-1) != 1:
            return super().forward_rotary(layer, qk, value, cos, signed_sin, num_heads, kv_cache, meta, scale, out)
        key_slots, value_slots = kv_cache.layer_slots(layer)
        query = self.kernels.rotary_kv_write(qk, value, cos, signed_sin, num_heads, meta.slot_mapping, key_slots,
                                             value_slots)
        return self._attend(layer, query, kv_cache, meta, scale, out)

    def _attend(self, layer: int, query: torch.Tensor, kv_cache: PagedKVCache, meta: AttentionMetadata,
                scale: float, out: torch.Tensor | None = None,
                new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's queries over ``layer``'s pool (into ``out`` where given), its new K/V written already or
        (``new_kv``) by this launch."""
        step: TritonStep = meta.groups[0]
        key_blocks, value_blocks = kv_cache.layer_blocks(layer)
        return self.kernels.paged_attention(
            query, key_blocks, value_blocks, step.tables, step.programs, step.block_q, step.query_starts,
            step.query_lens, step.num_computed, scale, self.windows[self.window_index(layer)], out=out,
            new_kv=new_kv, key_limits=step.key_limits, softcap=self.layer_softcap(layer),
            sinks=self.layer_sinks(layer))
