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
**Persistent step state.** Each request's block table lives on the device between steps, in a slot of
``slot_tables``: a step stages its rows' token ids, positions and slots, and the blocks appended to their
tables since they were last uploaded (``added_blocks``' worth: one block a row every block_size tokens), into
one pinned buffer and one non-blocking copy. The graph itself begins with one kernel
(``gpu_ops.unpack_decode_rows``) that grows the tables, gathers the rows' ones into the graph's buffers, takes
the ids a step sent ahead feeds from the step before, and computes each row's KV slot: the host's work is per
row, not per block, and a replayed step launches two copies and the graph (on run 8's host, an H100 serving
c=64, the same work as nine torch operations after the copy took 0.37 ms of host time a step). Steps with prompt
rows, speculative rows or prompt logprobs, and decode steps larger than the largest size, run eagerly.

**M-RoPE** (Qwen2-VL, ``workers/mrope.py``): a decode row past its images rotates by its position plus its
request's shift, staged as one more field of the row; the graph adds the two.

**LoRA adapters** (``workers/lora.py``): with adapters loaded each size is captured twice, without them and
with their Triton kernels reading each row's adapter from the buffers (``StepAdapters.slots``: staged with the
ids). A step with an adapter row replays the second, any other the first, so base traffic pays nothing.

``capture=False`` runs the same padded, buffer-fed forward without a graph: how CPU tests check that the
padding and the buffers give every row exactly its eager logits.
"""

from __future__ import annotations

import bisect
import collections
import time
from typing import TYPE_CHECKING

import torch

from llmbus.workers import gpu_ops
from llmbus.workers.attention.base import AttentionMetadata, DecodeGraphInputs
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import DeviceFeed, pack
from llmbus.workers.lora import StepAdapters
from llmbus.workers.mrope import text_shift
from llmbus.workers.sampling import greedy

if TYPE_CHECKING:
    from llmbus.workers.model_runner import SeqInput

# Pinned staging buffers a runner's decode graphs keep at most: one for each step --launch-depth (3 at most) may
# queue on the device, and the one being staged (each up to a full step's rows and tables: ~8 MB for 256 rows
# of 128k tokens' tables in blocks of 16).
STAGING_BUFFERS = 4


def greedy_outputs(logits: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    """What a graph ends with: its logits, every row's greedy choice with its logprob, and those two as the
    result copy takes them (``launched_step.pack``); None off rank 0 (no logits). A step whose rows all sample
    greedily takes these and launches no sampling or packing of its own (``DecodeGraphs``, and the head graphs
    of ``piecewise_graphs.py``)."""
    if logits is None:
        return None
    ids, logprobs = greedy(logits)
    return logits, ids, logprobs, pack(ids, logprobs, None)


class DecodeGraphs:
    """Captured decode forwards of one model over one KV pool, by batch size."""

    def __init__(self, model, kv_cache: PagedKVCache, sizes: tuple[int, ...], max_blocks: int, *,
                 capture: bool = True, adapter_index: dict[str, int] | None = None):
        """``model``: its ``forward`` and ``attention_backend`` (which must give graph metadata, see
        ``supported``); ``sizes``: the batch sizes to capture; ``max_blocks``: the longest block table a
        replayed step may have (the model's context in blocks); ``adapter_index``: the LoRA adapters the model
        holds, by name (their steps replay too where the model adds their deltas with kernels)."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks
        self.captured = capture
        max_batch = self.sizes[-1]
        device = kv_cache.key.device
        self.spare_block = kv_cache.num_blocks
        self.block_size = kv_cache.block_size
        active = getattr(model, "active_adapters", None)
        self.adapter_index = adapter_index if adapter_index and active is not None and active.kernels else {}
        # What a replay reads: token ids, positions and KV slots (rows of one buffer), each row's adapter slot
        # where adapters replay, its rotation's shift from its position where the model's M-RoPE shifts the
        # text after an image (mrope.py: a decode row past its images rotates by its place plus that), and the
        # block tables.
        self.row_fields = 4 if self.adapter_index else 3
        self.shift_field = None
        if getattr(getattr(model, "rotary", None), "mrope_section", None) is not None:
            self.shift_field, self.row_fields = self.row_fields, self.row_fields + 1
        self.small = torch.zeros(self.row_fields, max_batch, dtype=torch.long, device=device)
        self.adapter_rows = StepAdapters(None, self.small[3]) if self.adapter_index else None
        self.small[2].fill_(self.spare_block * self.block_size)
        self.inputs = DecodeGraphInputs(
            positions=self.small[1], slot_mapping=self.small[2],
            tables=torch.full((max_batch, max_blocks), self.spare_block, dtype=torch.long, device=device))
        self.logits_index = torch.arange(max_batch, dtype=torch.long, device=device)
        # Each request's block table stays on the device between steps, in a slot of its own; the last slot
        # is the padding rows' (all spare block). The scheduler only appends to a running request's table,
        # and a request that restarts is dropped first (``forget``), so a step sends its rows' slots and the
        # blocks appended since the step before, not the tables.
        num_slots = 2 * max_batch
        self.padding_slot = num_slots
        self.slot_tables = torch.full((num_slots + 1, max_blocks), self.spare_block, dtype=torch.long, device=device)
        self.slot_of: dict[str, int] = {}  # rid -> slot, least recently stepped first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.uploaded = [0] * num_slots  # blocks of the slot's table on the device
        self.last_block = [-1] * num_slots  # its last one, to notice a table that changed all the same
        # One staging buffer (int32: ids, positions, slots and block ids all fit), copied to the device in
        # one non-blocking copy: for a graph of b rows, b of each of the fields (ids, positions, table slots,
        # adapter slots where adapters replay; then of the row's table: the blocks its slot holds already, its
        # length, where its appended blocks start, and the 1-based pick of a fed id, 0 for none), then the
        # blocks appended to the rows' tables, row after row; a step can at most upload every row's whole table.
        self.pinned = device.type == "cuda"
        self.capacity = (self.row_fields + 4) * max_batch + max_batch * max_blocks
        # Staging buffers, least recently used first, each with the event recorded after the copy out of it: a
        # step stages into one no copy still reads. One while the device keeps up; more while steps queue on
        # it (--launch-depth), up to STAGING_BUFFERS, past which a step waits for the oldest copy.
        self.stages: collections.deque[tuple[torch.Tensor, object, torch.cuda.Event | None]] = collections.deque()
        self.stages.append(self._new_stage())
        self.staged_on_device = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        # The ids a step sent ahead takes from the step before (``DeviceFeed.gather_into``): a fixed address
        # the graphs read; a source of more rows than this is gathered down first.
        self.fed = torch.zeros(max(4 * max_batch, 1024), dtype=torch.long, device=device)
        self.metadata: dict[int, AttentionMetadata] = {
            b: model.attention_backend.decode_graph_metadata(self.inputs, b) for b in self.sizes}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, with adapters)
        self.outputs: dict[tuple[int, bool], tuple | None] = {}  # _run's, of each graph
        # The last replay's rows' greedy ids and logprobs, and the graph's vector of them as ResultCopy takes
        # it (rank 0), valid until the next replay of its size.
        self.greedy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
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

    @property
    def lora(self) -> bool:
        """Whether steps with LoRA adapter rows replay too."""
        return self.adapter_rows is not None

    def _run(self, batch: int, adapters: bool) -> tuple[torch.Tensor, ...] | None:
        """``greedy_outputs`` of the step's logits (``greedy`` takes its choices)."""
        self._unpack(batch)
        meta = self.metadata[batch]
        kwargs = {"adapters": self.adapter_rows} if adapters else {}
        if self.shift_field is not None:
            kwargs["rope_positions"] = meta.positions + self.small[self.shift_field, :batch]
        return greedy_outputs(self.model.forward(
            self.small[0, :batch], meta.positions, self.kv_cache, meta, self.logits_index[:batch], **kwargs))

    def _capture(self) -> None:
        """Largest first, sharing one memory pool: a smaller graph's activations fit in the larger's."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            for adapters in (False, True) if self.lora else (False,):
                self._stage([], batch)  # all padding: the capture writes the spare block only
                self._run(batch, adapters)  # compiles the kernels and settles the allocator outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch, adapters] = self._run(batch, adapters)
                self.graphs[batch, adapters] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started

    def applies(self, seqs: list[SeqInput]) -> bool:
        """Whether a step of ``seqs`` replays a graph: every row one sampled token (on the base model, or on
        an adapter where those replay), no more rows than the largest size, no table longer than the
        buffers'."""
        return (len(seqs) <= self.sizes[-1]
                and all(len(s.token_ids) == 1 and s.sample and not s.num_spec
                        and (not s.adapter or s.adapter in self.adapter_index) for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.max_blocks)

    def forward(self, seqs: list[SeqInput], feed: DeviceFeed | None = None) -> torch.Tensor | None:
        """The float32 logits ``[len(seqs), vocab]`` of a step that ``applies`` (None off rank 0). They stay
        valid until the next replay of the same size. ``feed`` writes ids of the step before (still on the
        device) over their rows of the staged ones."""
        count = len(seqs)
        batch = self.sizes[bisect.bisect_left(self.sizes, count)]
        adapters = self.lora and any(s.adapter for s in seqs)
        self._stage(seqs, batch, feed)
        if self.captured:
            self.graphs[batch, adapters].replay()
            out = self.outputs[batch, adapters]
        else:
            out = self._run(batch, adapters)
        if out is None:
            self.greedy = None
            return None
        logits, ids, logprobs, packed = out
        self.greedy = ids[:count], logprobs[:count], packed
        return logits[:count]

    def forget(self, rids: list[str]) -> None:
        """Free the slots of requests that finished, were preempted or restart (their tables may change)."""
        for rid in rids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)

    def _slot(self, rid: str) -> int:
        """``rid``'s slot, moved to the most recently stepped end; a new one (nothing uploaded) if it has
        none, taken from the least recently stepped request when none is free (never one staged already in
        this step: those are at the other end, and a step has at most half as many rows as there are slots)."""
        slot = self.slot_of.pop(rid, None)
        if slot is None:
            if not self.free_slots:
                self.free_slots.append(self.slot_of.pop(next(iter(self.slot_of))))
            slot = self.free_slots.pop()
            self.uploaded[slot] = 0
        self.slot_of[rid] = slot
        return slot

    def _stage(self, seqs: list[SeqInput], batch: int, feed: DeviceFeed | None = None) -> None:
        """Stage the step's rows (each field of each row, padding rows after them) and the blocks appended
        to their tables, and copy them over in one go for ``_unpack``. ``feed``: ids of the step before (still
        on the device) for some rows, gathered where the graphs read them."""
        stage, stage_values, staged = self._free_stage()
        count = len(seqs)
        slots, known_blocks, lengths, offsets, blocks = [], [], [], [], []
        for s in seqs:
            slot = self._slot(s.rid)
            table, known = s.block_table, self.uploaded[slot]
            if known and (len(table) < known or table[known - 1] != self.last_block[slot]):
                known = 0  # not the table uploaded: upload it whole
            offsets.append(len(blocks))
            if len(table) > known:
                blocks += table[known:]
                self.uploaded[slot], self.last_block[slot] = len(table), table[-1]
            slots.append(slot)
            known_blocks.append(known)
            lengths.append(len(table))
        picks = [0] * count
        if feed is not None:
            for row, pick in zip(feed.rows, feed.gather_into(self.fed)):
                picks[row] = pick + 1
        padding = [0] * (batch - count)
        ones = [1] * (batch - count)  # a padding row's table: the padding slot's first block, the spare one
        rows = ([s.token_ids[0] for s in seqs] + padding + [s.num_computed for s in seqs] + padding
                + slots + [self.padding_slot] * (batch - count))
        if self.lora:
            rows += [self.adapter_index[s.adapter] + 1 if s.adapter else 0 for s in seqs] + padding
        if self.shift_field is not None:  # a sampled row is past its images (an image row is never replayed)
            rows += [text_shift(s.images) for s in seqs] + padding
        rows += known_blocks + ones + lengths + ones + offsets + padding + picks + padding
        used = len(rows) + len(blocks)
        stage_values[:used] = rows + blocks
        self.staged_on_device[:used].copy_(stage[:used], non_blocking=True)
        if staged is not None:
            staged.record()
        self.stages.append((stage, stage_values, staged))

    def _new_stage(self) -> tuple:
        stage = torch.zeros(self.capacity, dtype=torch.int32, pin_memory=self.pinned)
        # the numpy view shares the memory: a list goes in without a tensor made of it
        return stage, stage.numpy(), torch.cuda.Event() if self.pinned else None

    def _free_stage(self) -> tuple:
        """A staging buffer no copy still reads (taken off ``stages``; ``_stage`` puts it back last)."""
        stage, values, staged = self.stages[0]
        if staged is not None and not staged.query():  # its copy is queued behind steps still on the device
            if len(self.stages) < STAGING_BUFFERS:
                return self._new_stage()
            staged.synchronize()
        return self.stages.popleft()

    def _unpack(self, batch: int) -> None:
        """What the graph of ``batch`` rows reads, from the rows ``_stage`` copied over (the graph's first
        kernel)."""
        gpu_ops.unpack_decode_rows(self.staged_on_device, self.fed, self.small, self.inputs.tables,
                                   self.slot_tables, batch, self.block_size)
