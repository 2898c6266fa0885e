"""CUDA graphs of decode steps (``--cuda-graphs``): one graph per captured batch size, replayed with one copy
of the step's inputs.

A decode step of a large model launches hundreds of small kernels (norms, RoPE, the KV write, attention,
activations, one or two GEMMs per projection) and at small batches the host's launching is the step's
length, not the GPU's work: the H100 device check measured 857 launches and 14.6 ms for a batch-1 step whose
bytes take 5.1 ms to read. A graph launches them all at once.

What a graph needs, and how a step provides it:
- **Fixed addresses.** Every tensor the captured forward reads lives in ``DecodeGraphInputs`` and
  ``input_ids``: device buffers of the largest captured size, rewritten before each replay; the graph of
  ``b`` rows reads their first ``b`` rows. The KV pool is allocated before capture and never moves.
- **Fixed shapes.** A step of ``n`` decodes replays the smallest captured size ``b >= n``; rows ``n..b``
  are padding: token 0 at position 0, written to the pool's spare block (``PagedKVCache``'s padding block,
  which no request owns) and attending only to it. Their logits are dropped.
- **Nothing on the host.** The attention backend gives metadata over the buffers whose shapes depend on
  the batch size alone (``AttentionBackend.decode_graph_metadata``); a backend that cannot (its kernels
  take host-side shapes from the contexts) gets no graphs, and its steps run eagerly.
The step's inputs are written into pinned staging memory and copied in two non-blocking copies (ids,
positions and slots in one; the block tables' used columns in the other). Steps with prompt rows,
speculative rows or prompt logprobs, and decode steps larger than the largest size, run eagerly.

``capture=False`` runs the same padded, buffer-fed forward without a graph: how CPU tests check that the
padding and the buffers give every row exactly its eager logits.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import torch

from llmbus.workers.attention.base import AttentionMetadata, DecodeGraphInputs
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import DeviceFeed

if TYPE_CHECKING:
    from llmbus.workers.model_runner import SeqInput


class DecodeGraphs:
    """Captured decode forwards of one model over one KV pool, by batch size."""

    def __init__(self, model, kv_cache: PagedKVCache, sizes: tuple[int, ...], max_blocks: int, *,
                 capture: bool = True):
        """``model``: its ``forward`` and ``attention_backend`` (which must give graph metadata, see
        ``supported``); ``sizes``: the batch sizes to capture; ``max_blocks``: the longest block table a
        replayed step may have (the model's context in blocks)."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks
        self.captured = capture
        max_batch = self.sizes[-1]
        device = kv_cache.key.device
        self.spare_block = kv_cache.num_blocks
        self.block_size = kv_cache.block_size
        # Rows of one buffer: token ids, positions, slots; copied whole in one go.
        self.small = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self.small[2].fill_(self.spare_block * self.block_size)
        self.inputs = DecodeGraphInputs(
            positions=self.small[1], slot_mapping=self.small[2],
            tables=torch.full((max_batch, max_blocks), self.spare_block, dtype=torch.long, device=device))
        self.logits_index = torch.arange(max_batch, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.stage_small = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=pinned)
        self.stage_tables = torch.empty(max_batch * max_blocks, dtype=torch.long, pin_memory=pinned)
        # Recorded after the copies out of staging: the next step waits on it before rewriting staging, which
        # the last step's copies may still be reading if the host ran ahead of the device.
        self.staged = torch.cuda.Event() if pinned else None
        self.metadata: dict[int, AttentionMetadata] = {
            b: model.attention_backend.decode_graph_metadata(self.inputs, b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | None] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture()

    @staticmethod
    def supported(model) -> bool:
        """Whether ``model``'s steps can be captured: its backend gives graph metadata, no native layer of its
        own (the fused CPU layer) replaces the layers' forward, and no block of a layer says it cannot be
        (``capturable = False``)."""
        backend = getattr(model, "attention_backend", None)
        if backend is None or getattr(model, "fused_decode", None) is not None:
            return False
        # A block that reads device values on the host (a mixture of experts' routing) says so.
        if not all(getattr(block, "capturable", True) for layer in getattr(model, "layers", ())
                   for block in vars(layer).values()):
            return False
        probe = DecodeGraphInputs(positions=torch.zeros(1, dtype=torch.long),
                                  slot_mapping=torch.zeros(1, dtype=torch.long),
                                  tables=torch.zeros(1, 1, dtype=torch.long))
        return backend.decode_graph_metadata(probe, 1) is not None

    def _args(self, batch: int) -> tuple:
        meta = self.metadata[batch]
        return (self.small[0, :batch], meta.positions, self.kv_cache, meta, self.logits_index[:batch])

    def _capture(self) -> None:
        """Largest first, sharing one memory pool: a smaller graph's activations fit in the larger's."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            args = self._args(batch)
            self.model.forward(*args)  # compiles the kernels and settles the allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model.forward(*args)
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started

    def applies(self, seqs: list[SeqInput]) -> bool:
        """Whether a step of ``seqs`` replays a graph: every row one sampled token, no more rows than the
        largest size, no table longer than the buffers'."""
        return (len(seqs) <= self.sizes[-1]
                and all(len(s.token_ids) == 1 and s.sample and not s.num_spec for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.max_blocks)

    def forward(self, seqs: list[SeqInput], feed: DeviceFeed | None = None) -> torch.Tensor | None:
        """The float32 logits ``[len(seqs), vocab]`` of a step that ``applies`` (None off rank 0). They stay
        valid until the next replay of the same size. ``feed`` writes ids of the step before (still on the
        device) over their rows of the staged ones."""
        count = len(seqs)
        batch = self.sizes[bisect.bisect_left(self.sizes, count)]
        self._stage(seqs, batch)
        if feed is not None:
            feed.write(self.small[0])
        if self.captured:
            self.graphs[batch].replay()
            logits = self.outputs[batch]
        else:
            logits = self.model.forward(*self._args(batch))
        return None if logits is None else logits[:count]

    def _stage(self, seqs: list[SeqInput], batch: int) -> None:
        """Write the step's rows and padding into staging, then into the buffers (two non-blocking copies)."""
        if self.staged is not None and not self.staged.query():  # done, unless the host ran a step ahead
            self.staged.synchronize()
        block_size, spare = self.block_size, self.spare_block
        width = max(len(s.block_table) for s in seqs)
        padding = batch - len(seqs)
        ids = [s.token_ids[0] for s in seqs] + [0] * padding
        positions = [s.num_computed for s in seqs] + [0] * padding
        slots = [s.block_table[s.num_computed // block_size] * block_size + s.num_computed % block_size
                 for s in seqs] + [spare * block_size] * padding
        flat = []
        for s in seqs:
            flat += s.block_table
            flat += [spare] * (width - len(s.block_table))
        flat += [spare] * (width * padding)
        self.stage_small[:, :batch] = torch.tensor((ids, positions, slots), dtype=torch.long)
        self.stage_tables[:batch * width] = torch.tensor(flat, dtype=torch.long)
        self.small.copy_(self.stage_small, non_blocking=True)
        self.inputs.tables[:batch, :width].copy_(self.stage_tables[:batch * width].view(batch, width),
                                                 non_blocking=True)
        if self.staged is not None:
            self.staged.record()
