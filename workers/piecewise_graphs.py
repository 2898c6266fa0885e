"""Piecewise CUDA graphs (``--piecewise-graphs``): a step that ``cuda_graphs.py`` cannot replay (a new request's
prompt chunk beside the running decodes) launches each layer's work between two attention calls as one graph,
and only the attention itself eagerly.

Why: such a step runs the layers eagerly, several hundred launches, and on an H100's host each GEMM alone costs
38-56 us of CPU before its launch (design notes, "What a served GPU step is made of"); at c=64 those steps were
29% of rank 0's host time against 9.5% for the replayed ones, and they are where the device waits for the host.
The attention is what a graph cannot hold: its launch grid and the pool's layout come from the step's contexts
(``AttentionMetadata``, built on the host). Everything else in a Llama layer is row by row, so it is captured
once per bucket of token counts and replayed on the step's rows padded to the bucket (vLLM's piecewise
compilation splits its graphs at the attention op the same way).

A bucket's plan, for a model of L layers: part 0 embeds the ids, computes RoPE's cos/sin and runs layer 0 up to
its attention (``LlamaDecoderLayer.before_attention``), its query and key heads rotated; part i (1..L-1) runs layer
i-1 from its attention's heads (``after_attention``) and layer i up to its own; part L finishes layer L-1. Between
parts, ``LlamaAttention.attend_rotated`` runs eagerly on the step's real rows of the part's query, key and value
heads: one launch a layer on the Triton backend, whose kernel writes the step's keys and values into the pool as it
attends (the pool does not exist when the parts are captured, so no part writes it; before, the eager side took a
second launch a layer for RoPE and that write, ~70 us of host time each on an H100's host), and its heads go into
one buffer every part reads. The last part writes the layers' output into one buffer (``final``) that the head
graphs read: the final norm, the LM head and each row's greedy choice over the rows that need logits
(``logits_of``), gathered through an index buffer, one graph per power of two of those rows up to 256
(``HEAD_ROWS``), as a decode graph ends; the step takes their greedy choices where every sampled row is plain
greedy, so it launches no sampling either (on an H200's host the eager head and sampling were ~0.4 ms of a
prompt-chunk step's 2.95 ms launch). The head graphs keep their logits: 511 rows of float32 logits in all
(262 MB for Llama 3's vocabulary). Padding rows (ids and positions left from earlier steps, always valid) never
reach the pool or the real rows: every captured op is row by row, and for LongRoPE each padding row is a sequence
of its own.

**Whole buckets** (``--full-graphs``, off by default until a GPU has measured it): once the pool exists, each
bucket is captured again as one graph, its attention calls included (``attend_in_graphs``), as vLLM's full
graphs of mixed batches. What the attention read from the host then lives at fixed addresses
(``attention.base.MixedGraphIndex``): the step's sequences, positions, slots and program map, rewritten by one
copy a step, and the block tables in rows of the model's context, into which the step's blocks are scattered.
A bucket's launch has as many programs as any step of its tokens may need; those past the step's own attend a
sequence of no tokens. A step then launches the index's copy and scatter, one graph and its head, where the
parts launched one Triton kernel a layer between them.

``capture=False`` runs the same parts, buffers and padding without graphs: how CPU tests check that the parts
compose to the eager forward, token for token.
"""

from __future__ import annotations

import bisect
import gc
import time

import torch

from llmbus.workers.attention.base import AttentionMetadata, MixedGraphIndex
from llmbus.workers.cuda_graphs import DecodeGraphs, greedy_outputs
from llmbus.workers.gpu_ops import apply_rotary
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.models.llama import RESIDUAL_DTYPE, LlamaDecoderLayer, LlamaForCausalLM

# The logits rows a head graph is captured for (the final norm, the LM head and each row's greedy choice): a
# step with more rows that need logits than the largest, or than the largest bucket of tokens, takes its head
# eagerly.
HEAD_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class PiecewiseGraphs:
    """A model's layers between attention calls, captured per bucket of token counts."""

    def __init__(self, model, sizes: tuple[int, ...], *, capture: bool = True):
        self.model = model
        self.sizes = sorted(set(sizes))
        largest, attention = self.sizes[-1], model.layers[0].attention
        self.ids = torch.zeros(largest, dtype=torch.long, device=model.device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=model.device)
        # Where each sequence's rows start, for a rotary whose factors are chosen per sequence (LongRoPE): the
        # padding rows are each a sequence of their own, so no real sequence's run reaches them.
        self.starts = (torch.ones(largest, dtype=torch.bool, device=model.device) if model.rotary.per_sequence
                       else None)
        # The attention's heads, which every part after one reads (``_attend``); their dtype is the projections'.
        with torch.inference_mode(), model.active_adapters.serving(None):
            probe = attention.project(model.layers[0].input_norm(
                torch.zeros(1, model.config.hidden_size, dtype=RESIDUAL_DTYPE, device=model.device)))[0]
        self.heads = torch.zeros(largest, attention.num_heads * attention.head_dim, dtype=probe.dtype,
                                 device=model.device)
        # The layers' output, which every bucket's last part writes and the head graphs read, at the rows of
        # ``logits_rows`` (the step's rows that need logits, then whatever rows earlier steps left: padding).
        self.final = torch.zeros(largest, model.config.hidden_size, dtype=RESIDUAL_DTYPE, device=model.device)
        # Where the graphs hold the attention too (``attend_in_graphs``): the step's index at fixed addresses,
        # and each bucket's metadata over it.
        self.index: MixedGraphIndex | None = None
        self.kv_cache: PagedKVCache | None = None  # the pool the graphs attend over
        self.index_metadata: dict[int, AttentionMetadata] = {}
        self.head_sizes = tuple(r for r in HEAD_ROWS if r <= largest)
        self.logits_rows = torch.zeros(self.head_sizes[-1], dtype=torch.long, device=model.device)
        # The last head replayed: its rows' greedy ids, logprobs and their vector as ResultCopy takes it (rank 0,
        # valid until the next replay of that head), as DecodeGraphs.greedy.
        self.greedy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        started = time.perf_counter()
        pool = stream = None
        if capture:
            # What a runner freed before (another model's, in a check that builds several) goes back first: the
            # pool's captures then take fresh memory only for what they keep.
            gc.collect()
            torch.cuda.empty_cache()
            # One pool and one side stream for every bucket, largest first: the caching allocator reuses a freed
            # block only on the stream that allocated it (and cuBLAS keeps a workspace per stream), so a smaller
            # bucket's activations fit in the largest's only when they are captured on the same stream.
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.plans = {size: _Plan(self, size, pool, stream) for size in reversed(self.sizes)}
        self.logits_plans = {rows: _LogitsPlan(self, rows, pool, stream) for rows in reversed(self.head_sizes)}
        if capture:
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started

    @staticmethod
    def supported(model) -> bool:
        """Whether ``model``'s layers split at their attention: Llama's layers as they are (a family that runs
        them otherwise, Gemma 3's, does not), and what a decode graph needs too (no fused C layer, no block a
        graph cannot hold, an attention backend with graph metadata)."""
        layers = getattr(model, "layers", None)
        return (bool(layers) and isinstance(model, LlamaForCausalLM)
                and type(model).run_layers is LlamaForCausalLM.run_layers
                and all(type(layer).__call__ is LlamaDecoderLayer.__call__ for layer in layers)
                and DecodeGraphs.supported(model))

    def attend_in_graphs(self, kv_cache: PagedKVCache, max_blocks: int) -> None:
        """Hold each bucket's attention in its graphs too, over ``kv_cache`` (the pool, which must exist by
        now): one graph a bucket, its parts and attention calls captured together, in place of its parts'
        graphs (whose memory it takes over), over the index ``stage`` rewrites. Not for a rotary that chooses
        factors per sequence (its parts read a start mask the index does not give). Raises where the
        backend gives no such index, or its buffers cannot be had (the parts as they were, ``index`` None), or a
        capture fails (buckets redone and not: the caller should not use such a set)."""
        backend = self.model.attention_backend
        if self.starts is not None:
            raise ValueError("a rotary with per-sequence factors takes its start mask from the step")
        index = backend.mixed_graph_index(self.sizes[-1], max_blocks, kv_cache)
        if index is None:
            raise ValueError(f"the {backend.name} attention backend cannot be held in a graph of prompt steps")
        metadata = {size: backend.mixed_graph_metadata(index, size) for size in self.sizes}
        # (nothing changed until here: a failure before leaves the parts as they were, ``index`` None)
        self.index, self.kv_cache, self.index_metadata = index, kv_cache, metadata
        self.positions = index.positions  # the parts read the positions where the index has them
        for size in reversed(self.sizes):
            self.plans[size].capture_whole(kv_cache, self.index_metadata[size])

    def stage(self, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]]
              ) -> AttentionMetadata:
        """A step's index written where the graphs read it (``attend_in_graphs``), and its metadata: the bucket's
        (its positions and slots the step's, then padding)."""
        self.index.stage(query_lens, num_computed, block_tables)
        count = sum(query_lens)
        return self.index_metadata[self.sizes[bisect.bisect_left(self.sizes, count)]]

    def applies(self, num_tokens: int, adapters, kv_cache: PagedKVCache | None = None,
                block_tables: list[list[int]] = ()) -> bool:
        """Whether a step of ``num_tokens`` flat tokens runs piecewise: no more than the largest bucket, and no
        row on a LoRA adapter (the parts were captured serving none); where the graphs attend too
        (``attend_in_graphs``), over their pool, and no table longer than the index's."""
        if adapters is not None or not 0 < num_tokens <= self.sizes[-1]:
            return False
        return self.index is None or (kv_cache is self.kv_cache
                                      and max(map(len, block_tables)) <= self.index.tables.shape[1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_index: torch.Tensor) -> torch.Tensor | None:
        """The model's ``forward``, for a step that ``applies``; ``greedy`` holds the rows' greedy choices where
        a head graph computed the logits (else None)."""
        count = input_ids.shape[0]
        self.greedy = None
        size = self.sizes[bisect.bisect_left(self.sizes, count)]
        self.ids[:count].copy_(input_ids)
        if positions.data_ptr() != self.positions.data_ptr():  # (staged into place where the graphs attend)
            self.positions[:count].copy_(positions)
        if self.starts is not None:
            self.starts.fill_(True)  # the padding rows
            mask = meta.start_mask(count)
            if mask is not None:
                self.starts[:count].copy_(mask)
        hidden = self.plans[size].run(count, kv_cache, meta)
        rows = logits_index.shape[0]
        if not 0 < rows <= self.head_sizes[-1]:
            return self.model.logits_of(hidden[:count], logits_index)
        self.logits_rows[:rows].copy_(logits_index)
        out = self.logits_plans[self.head_sizes[bisect.bisect_left(self.head_sizes, rows)]].run()
        if out is None:  # off rank 0
            return None
        logits, ids, logprobs, packed = out
        self.greedy = ids[:rows], logprobs[:rows], packed
        return logits[:rows]

    def _attend(self, layer: int, qk, value, count: int, kv_cache: PagedKVCache, meta: AttentionMetadata) -> None:
        """Layer ``layer``'s attention over the step's ``count`` real rows (their heads rotated by the part
        before), its heads into ``heads`` (written there by the attention kernel where the backend's can, not
        copied)."""
        attention = self.model.layers[layer].attention
        attention.attend_rotated(qk[:count], value[:count], self.model.attention_backend, kv_cache, meta,
                                 out=self.heads[:count].view(count, attention.num_heads, attention.head_dim))


class _Captures:
    """What a plan of graphs shares: one pool and side stream for all (``PiecewiseGraphs``), its graphs in the
    order captured."""

    def __init__(self, owner: PiecewiseGraphs, pool, stream: torch.cuda.Stream | None):
        self.owner, self.pool, self.stream = owner, pool, stream
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def _capture(self, part):
        """``part()``'s outputs, its work captured as the next graph (run once uncaptured first: Triton compiles
        and cuBLAS settles outside the capture). ``torch.cuda.graph`` would also synchronise, collect garbage
        and empty the cache before each of a bucket's L + 1 parts; the side stream that every plan shares does
        what the capture needs."""
        part()
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                out = part()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graphs.append(graph)
        return out


class _LogitsPlan(_Captures):
    """A head of ``rows`` logits rows: the final norm, the LM head and each row's greedy choice, over the rows
    of the layers' output that ``logits_rows`` names (``DecodeGraphs._run``'s tail), captured or (uncaptured)
    called each step."""

    def __init__(self, owner: PiecewiseGraphs, rows: int, pool, stream: torch.cuda.Stream | None):
        super().__init__(owner, pool, stream)
        self.rows = rows
        if pool is not None:
            with torch.inference_mode(), owner.model.active_adapters.serving(None):
                self.out = self._capture(self.head)

    def head(self) -> tuple[torch.Tensor, ...] | None:
        """``greedy_outputs`` of the logits rows, as a decode graph ends."""
        return greedy_outputs(self.owner.model.logits_of(self.owner.final, self.owner.logits_rows[:self.rows]))

    def run(self) -> tuple[torch.Tensor, ...] | None:
        if self.pool is None:
            return self.head()
        self.graphs[0].replay()
        return self.out


class _Plan(_Captures):
    """One bucket's parts: graphs captured from ``first``, ``middle`` and ``last``, or (uncaptured) those
    functions called each step, and the tensors the attention between parts reads."""

    def __init__(self, owner: PiecewiseGraphs, size: int, pool, stream: torch.cuda.Stream | None):
        super().__init__(owner, pool, stream)
        self.size = size
        self.layers = owner.model.layers
        self.whole_meta: AttentionMetadata | None = None  # capture_whole's
        if pool is None:
            return
        with torch.inference_mode(), owner.model.active_adapters.serving(None):
            # Each part reads what the one before made, where the graphs keep it: the capture runs no attention
            # (the heads buffer's rows are whatever they are; the heads computed are not attended).
            residual, cos, sin, qk, value = self._capture(self.first)
            self.inputs = [(qk, value)]
            for layer in range(1, len(self.layers)):
                residual, qk, value = self._capture(
                    lambda layer=layer, residual=residual: self.middle(layer, residual, cos, sin))
                self.inputs.append((qk, value))
            self.out = self._capture(lambda residual=residual: self.last(residual))

    def first(self):
        """(residual stream, cos, sin, query-key heads rotated, value heads): the ids embedded, layer 0 up to
        its attention."""
        model, owner = self.owner.model, self.owner
        hidden = model.embed(owner.ids[:self.size]).to(RESIDUAL_DTYPE)
        cos, sin = model.rotary.cos_sin(owner.positions[:self.size], model.dtype,
                                        None if owner.starts is None else owner.starts[:self.size])
        residual, qk, value = self.layers[0].before_attention(hidden, None)
        return residual, cos, sin, apply_rotary(qk, cos, sin), value

    def middle(self, layer: int, residual, cos, sin):
        """Layer ``layer - 1`` from its attention's heads, layer ``layer`` up to its attention (its query-key
        heads rotated)."""
        residual, qk, value = self.layers[layer].before_attention(
            *self.layers[layer - 1].after_attention(residual, self.owner.heads[:self.size]))
        return residual, apply_rotary(qk, cos, sin), value

    def last(self, residual):
        """The last layer from its attention's heads: the layers' output, in ``final``."""
        residual, pending = self.layers[-1].after_attention(residual, self.owner.heads[:self.size])
        return torch.add(residual, pending, out=self.owner.final[:self.size])

    def capture_whole(self, kv_cache: PagedKVCache, meta: AttentionMetadata) -> None:
        """From now on the bucket is one graph (uncaptured: one call), its attention over ``kv_cache`` through
        ``meta`` (``PiecewiseGraphs.attend_in_graphs``); the parts' graphs and what they kept go first, so the
        pool's memory they held is what this capture takes."""
        self.whole_meta = meta
        self.graphs, self.inputs, self.out = [], [], None
        if self.pool is not None:
            with torch.inference_mode(), self.owner.model.active_adapters.serving(None):
                self.out = self._capture(lambda: self.whole(kv_cache))

    def whole(self, kv_cache: PagedKVCache) -> torch.Tensor:
        """Every part and every attention call between them, over all of the bucket's rows: the index's
        programs attend the step's own, the rest of them nothing."""
        residual, cos, sin, qk, value = self.first()
        for layer in range(1, len(self.layers)):
            self.owner._attend(layer - 1, qk, value, self.size, kv_cache, self.whole_meta)
            residual, qk, value = self.middle(layer, residual, cos, sin)
        self.owner._attend(len(self.layers) - 1, qk, value, self.size, kv_cache, self.whole_meta)
        return self.last(residual)

    def run(self, count: int, kv_cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The layers' output for the step's ``count`` rows (and the bucket's padding rows after them)."""
        owner = self.owner
        if self.whole_meta is not None:
            if self.pool is None:
                return self.whole(kv_cache)
            self.graphs[0].replay()
            return self.out
        if self.pool is None:
            residual, cos, sin, qk, value = self.first()
            for layer in range(1, len(self.layers)):
                owner._attend(layer - 1, qk, value, count, kv_cache, meta)
                residual, qk, value = self.middle(layer, residual, cos, sin)
            owner._attend(len(self.layers) - 1, qk, value, count, kv_cache, meta)
            return self.last(residual)
        for layer, (graph, (qk, value)) in enumerate(zip(self.graphs, self.inputs)):
            graph.replay()
            owner._attend(layer, qk, value, count, kv_cache, meta)
        self.graphs[-1].replay()
        return self.out
