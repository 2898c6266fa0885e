"""A ``ModelRunner``'s warmup (``RunnerWarmup``, which it inherits): the worst-case prefill run once, so that a
shortfall of memory shows at start; on CUDA the KV pool sized from the memory that leaves free, and the decode
and piecewise CUDA graphs captured."""

from __future__ import annotations

import structlog
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.workers.attention.base import MixedGraphIndex
from llmbus.workers.cuda_graphs import DecodeGraphs
from llmbus.workers.kv_cache import PagedKVCache, bytes_per_block
from llmbus.workers.memory_budget import WarmupOutOfMemory, cuda_kv_blocks
from llmbus.workers.piecewise_graphs import PiecewiseGraphs
from llmbus.workers.sampling import sample
from llmbus.workers.seq_input import SeqInput

# The top alternatives each sampled row of warmup's sampling measurement asks for (TGI's default
# --max-top-n-tokens).
WARMUP_TOP_N_TOKENS = 5
WARMUP_RID_PREFIX = "__warmup__"
# On CPU the warmup prefills this many tokens at most, not the whole prefill budget: it runs every code path
# once (kernels, oneDNN primitives, the sampling warpers), but it cannot find a memory shortfall the way it
# does on CUDA (the host overcommits, then the OOM killer ends the process; the pool's size is checked
# against available memory instead), and a full-budget float32 prefill was most of a start's time on a
# small CPU (design notes, "Every service starts at once").
CPU_WARMUP_TOKENS = 256
# The query lengths whose steps tile their queries as no prefill or decode does (triton_kernels.query_tile):
# warmup runs one step of each on CUDA.
SHORT_QUERY_LENGTHS = (2, 4, 8)
# A piecewise step's attention writes the step's keys as it attends (TritonAttentionBackend.forward), another
# compilation of the kernel for each tiling: warmup runs one step of each query tile through the parts.
PIECEWISE_QUERY_LENGTHS = (1, *SHORT_QUERY_LENGTHS, 16)
# ... and one of this many one-token rows: a step of decodes alone takes the parts only past the largest decode
# graph (256 rows by default), where its keys are not split (triton_kernels.key_splits), another compilation.
PIECEWISE_DECODE_ROWS = 256


class RunnerWarmup:
    """``ModelRunner``'s warmup methods (the runner's own state: its model, pool, graphs and sizes)."""

    def _warmup_batch(self) -> list[SeqInput]:
        """``max_batch_prefill_tokens`` prompt tokens (on CPU at most ``CPU_WARMUP_TOKENS``), split into
        sequences the model can position.

        On CUDA the first sequence is the last chunk of a prompt as long as the model's context: its
        attention over everything before it is the largest a step of this budget can need (a prompt chunk
        attends to its whole context), which the pool's sizing must leave room for. The context's K/V are
        only read, so every block before the chunk is one shared block of the scratch pool."""
        total = self.max_batch_prefill_tokens
        if self.device.type == "cpu":
            total = min(total, CPU_WARMUP_TOKENS)
        longest = max(1, min(total, self.max_position_embeddings))
        lengths = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        seqs, next_block = [], 0
        for i, length in enumerate(lengths):
            num_computed, shared = 0, []
            if i == 0 and self.device.type == "cuda" and self.max_position_embeddings > length:
                num_computed = self.max_position_embeddings - length
                shared = [next_block] * (num_computed // self.block_size)
                next_block += 1
            num_blocks = -(-(num_computed + length) // self.block_size) - len(shared)
            # The last sequence also exercises the sampling warpers, a logit bias, the watermark and top tokens;
            # the rest sample greedily.
            sampling = (SamplingParams(do_sample=True, top_k=50, top_p=0.9, typical_p=0.95, top_n_tokens=5,
                                       watermark=True, logit_bias_ids=[0], logit_bias_values=[1.0])
                        if i == len(lengths) - 1 else SamplingParams())
            seqs.append(SeqInput(rid=f"{WARMUP_RID_PREFIX}{i}", token_ids=[0] * length, num_computed=num_computed,
                                 block_table=shared + list(range(next_block, next_block + num_blocks)),
                                 sample=True, sampling=sampling))
            next_block += num_blocks
        return seqs

    def _compile_decode_rows(self, cache: PagedKVCache, rows: int) -> None:
        """One step of ``rows`` one-token sequences, all in the scratch pool's first block (their writes land on
        one slot: scratch), to compile the attention that such a step's number of programs chooses."""
        self._forward([SeqInput(rid=f"{WARMUP_RID_PREFIX}d{i}", token_ids=[0], num_computed=0, block_table=[0],
                                sample=True, sampling=SamplingParams()) for i in range(rows)], cache)

    def _compile_short_queries(self, cache: PagedKVCache, lengths: tuple[int, ...] = SHORT_QUERY_LENGTHS) -> None:
        """A step whose longest query is 2 to 8 tokens (short prompts alone, speculation) tiles its queries
        smaller than a prefill's, which compiles the attention kernel again: one small step per tile here
        (of each of ``lengths``), so that happens at start, not in the middle of serving."""
        for length in lengths:
            self._forward([SeqInput(rid=f"{WARMUP_RID_PREFIX}q{length}", token_ids=[0] * length, num_computed=0,
                                    block_table=list(range(-(-length // self.block_size))), sample=True,
                                    sampling=SamplingParams())], cache)

    def _compile_image_rows(self, cache: PagedKVCache) -> bool:
        """A prompt step holding one blank image whose rows attend it whole (Gemma 3), so that the attention's
        key-limits kernel compiles at start, not in the first image request's step; its rows are then dropped.
        Returns whether it ran: not where the scratch pool cannot hold it (a prefill budget under an image)."""
        import io

        from llmbus.bus.messages import ImageInput
        from llmbus.workers.vision import blank_image

        count = self.images.vision.tokens_per_image
        length, rid = count + 2, f"{WARMUP_RID_PREFIX}image"
        blocks = -(-length // self.block_size)
        if blocks > cache.num_blocks:
            return False
        picture = io.BytesIO()
        blank_image().save(picture, "PNG")
        image = ImageInput(offset=1, num_tokens=count, data=picture.getvalue(), digest=bytes(16))
        self._forward([SeqInput(rid=rid, token_ids=[0] * length, num_computed=0, block_table=list(range(blocks)),
                                sample=True, sampling=SamplingParams(), images=[image])], cache)
        self.images.drop([rid])
        return True

    def warmup(self) -> int:
        """A real worst-case prefill (all ``max_batch_prefill_tokens`` at once; a short one on CPU, see
        ``CPU_WARMUP_TOKENS``), results discarded; returns the tokens it computed.

        On CUDA it fails here rather than on the first real batch if memory is short, and without an
        explicit budget it sizes the KV pool (and an attached draft model's) from what is free once the
        activation peak of that step, at full context, and sampling's peak over the largest batch are known.
        """
        seqs = self._warmup_batch()
        blocks_needed = max(max(s.block_table) for s in seqs) + 1
        size_from_free_memory = self.kv_cache is None
        if size_from_free_memory:
            self._synchronize()
            torch.cuda.empty_cache()
            sampling_bytes = self._measure_sampling() if self.rank == 0 else 0
            torch.cuda.reset_peak_memory_stats(self.device)
            allocated_before = torch.cuda.memory_allocated(self.device)
        # The warmup's blocks are overwritten before any real request reads them, so the real pool can
        # serve as scratch; a separate one only when the pool is too small or not there yet.
        if self.kv_cache is not None and self.kv_cache.num_blocks >= blocks_needed:
            cache = self.kv_cache
        else:
            cache = self._new_cache(blocks_needed)
        try:
            with torch.inference_mode():
                logits = self._forward(seqs, cache)
                if self.rank == 0:
                    sample(logits, [s.sampling for s in seqs], [len(s.token_ids) for s in seqs],
                           last_tokens=[s.token_ids[-1] for s in seqs],
                           watermark_gamma=self.watermark_gamma, watermark_delta=self.watermark_delta)
                if self.device.type == "cuda":
                    self._compile_short_queries(cache)
                # (a step of an image runs the vision side too: its first run, its memory peak)
                if self.images is not None and not (self.device.type == "cuda" and self._images_both_ways
                                                    and self._compile_image_rows(cache)):
                    self.images.vision.warm()
        except torch.OutOfMemoryError as e:
            raise WarmupOutOfMemory(
                f"Not enough memory to handle {self.max_batch_prefill_tokens} prefill tokens. "
                f"You need to decrease `--max-batch-prefill-tokens`") from e
        self._synchronize()
        warmup_tokens = sum(len(s.token_ids) for s in seqs)
        if not size_from_free_memory:
            self._capture_piecewise(cache)
            self._capture_graphs()
            return warmup_tokens
        scratch_bytes = cache.nbytes
        peak_allocated = torch.cuda.max_memory_allocated(self.device)  # before the graphs' measurement resets it
        graph_bytes = self._measure_graph_bytes(cache) + self._whole_index_bytes()
        self._capture_piecewise(cache)  # before the pool is sized from what is free: what its graphs hold is taken
        del cache, logits
        num_blocks = self._blocks_for_free_gpu_memory(allocated_before, scratch_bytes, sampling_bytes, graph_bytes,
                                                      peak_allocated)
        self.allocate_pool(num_blocks)
        if self.draft is not None:
            self.draft.runner.allocate_pool(num_blocks)  # its share was set aside: the same block tables
        self._capture_graphs()
        return warmup_tokens

    @property
    def context_blocks(self) -> int:
        """The blocks of the model's context: the longest block table the graphs' buffers hold."""
        return -(-self.max_position_embeddings // self.block_size)

    def _graphs_wanted(self) -> bool:
        return bool(self.graph_sizes) and self.device.type == "cuda" and DecodeGraphs.supported(self.model)

    def _whole_index_bytes(self) -> int:
        """What ``--full-graphs``' step index takes once the pool exists (its tables: a row of the model's context
        per token of the largest bucket), left free by the pool's sizing."""
        if not (self.full_graphs and self._piecewise_wanted()):
            return 0
        return MixedGraphIndex.nbytes_at_most(max(self.piecewise_sizes), self.context_blocks)

    def _measure_graph_bytes(self, cache: PagedKVCache) -> int:
        """What the captured graphs will hold, measured before the pool is sized: the allocation peak of an
        eager decode step of the largest size (the graphs share one pool, and a smaller one's activations fit
        in the largest's), its rows on a LoRA adapter where adapters replay too, and then twice that: every
        size is captured again with the adapters' kernels, and each graph keeps its logits."""
        if not self._graphs_wanted():
            return 0
        active = getattr(self.model, "active_adapters", None)
        adapter = next(iter(self._adapter_index), "") if active is not None and active.kernels else ""
        rows = [SeqInput(rid=f"{WARMUP_RID_PREFIX}graph{i}", token_ids=[0], num_computed=0, block_table=[0],
                         sample=True, sampling=SamplingParams(), adapter=adapter)
                for i in range(max(self.graph_sizes))]
        self._synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated_before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            self._forward(rows, cache)
        self._synchronize()
        return (torch.cuda.max_memory_allocated(self.device) - allocated_before) * (2 if adapter else 1)

    def _capture_graphs(self) -> None:
        """Capture the decode graphs over the pool, once it exists (``--cuda-graphs``), and where asked
        (``--full-graphs``) the piecewise buckets again, whole."""
        self._capture_whole_piecewise()
        if not self._graphs_wanted():
            return
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.graph_sizes, self.context_blocks,
                                       adapter_index=self._adapter_index)

    def _piecewise_wanted(self) -> bool:
        return bool(self.piecewise_sizes) and self.device.type == "cuda" and PiecewiseGraphs.supported(self.model)

    def _capture_piecewise(self, cache: PagedKVCache) -> None:
        """Capture the layers between attention calls (``--piecewise-graphs``); they read no KV pool. A capture
        that fails leaves those steps eager, logged: they are on by default, and a model whose layers capture
        badly still serves (decode graphs, captured later, fail the start as they always did). Ranks of a group
        agree: where one failed, every one runs those steps eagerly, since the parts hold collectives that
        every rank must join. Then a step of each query tile through the parts over ``cache`` (scratch), to
        compile their attention's kernels; one that fails there (on every rank alike: the same kernels on
        the same devices) leaves the steps eager too."""
        if not self._piecewise_wanted():
            return
        try:
            self.piecewise = PiecewiseGraphs(self.model, self.piecewise_sizes)
        except Exception as exc:  # noqa: BLE001  (any capture failure: the eager path computes the same)
            self._piecewise_failed("piecewise graphs not captured; steps with prompt rows run eagerly", exc)
        self._agree_on_piecewise()
        if self.piecewise is None:
            return
        try:
            with torch.inference_mode():
                self._compile_short_queries(cache, PIECEWISE_QUERY_LENGTHS)
                self._compile_decode_rows(cache, min(PIECEWISE_DECODE_ROWS, max(self.piecewise_sizes)))
        except Exception as exc:  # noqa: BLE001  (as a capture's: the eager path computes the same)
            self._piecewise_failed("piecewise steps' attention did not compile; steps with prompt rows run "
                                   "eagerly", exc)

    def _on_every_rank(self, holds: bool) -> bool:
        """Whether ``holds`` on every rank of the group (a MIN all-reduce, which every rank must join)."""
        if self.world_size == 1:
            return holds
        flag = torch.tensor([int(holds)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _agree_on_piecewise(self) -> None:
        """Where another rank of the group has no piecewise graphs, none here either: their graphs hold
        collectives that every rank must join."""
        if not self._on_every_rank(self.piecewise is not None) and self.piecewise is not None:
            self._piecewise_failed("piecewise graphs not captured on another rank; steps with prompt rows run "
                                   "eagerly")

    def _capture_whole_piecewise(self) -> None:
        """``--full-graphs``: each piecewise bucket captured again as one graph, its attention included
        (``PiecewiseGraphs.attend_in_graphs``), over the pool. A failure before any bucket was redone (the
        index's buffers) leaves the parts serving; one after, steps with prompt rows eager; logged. Every rank
        of the group ends alike."""
        if not self.full_graphs or self.piecewise is None:
            return
        try:
            with torch.inference_mode():
                self.piecewise.attend_in_graphs(self.kv_cache, self.context_blocks)
        except Exception as exc:  # noqa: BLE001  (as a capture's: the eager path computes the same)
            if self.piecewise.index is None:  # failed before any bucket was redone: the parts serve as before
                structlog.get_logger("llmbus.workers").warning(
                    "piecewise graphs not captured whole (--full-graphs); their parts serve steps with prompt rows",
                    error=f"{type(exc).__name__}: {exc}"[:500])
            else:
                self._piecewise_failed("piecewise graphs not captured whole (--full-graphs); steps with prompt "
                                       "rows run eagerly", exc)
        whole = self.piecewise is not None and self.piecewise.index is not None
        if not self._on_every_rank(whole) and whole:
            self._piecewise_failed("piecewise graphs not captured whole on another rank; steps with prompt rows "
                                   "run eagerly")
        self._agree_on_piecewise()

    def _piecewise_failed(self, message: str, exc: Exception | None = None) -> None:
        self.piecewise = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        structlog.get_logger("llmbus.workers").warning(
            message, sizes=list(self.piecewise_sizes),
            **({"error": f"{type(exc).__name__}: {exc}"[:500]} if exc is not None else {}))

    def allocate_pool(self, num_blocks: int) -> None:
        """The KV pool of a runner whose pool was left to be sized (on CUDA, by its own warmup, or by the
        warmup of the target model it drafts for)."""
        self.kv_cache = self._new_cache(num_blocks)
        self.num_blocks = num_blocks

    def _measure_sampling(self) -> int:
        """Rank 0's peak memory above what is allocated while sampling the largest batch a step can hold
        (``max_batch_prefill_tokens`` rows, each a decode) with every warper and top tokens: the float32
        logits and the warpers' copies and sorts of them, which the KV pool must leave room for."""
        rows = self.max_batch_prefill_tokens
        params = [SamplingParams(do_sample=True, top_k=50, top_p=0.9, typical_p=0.95,
                                 top_n_tokens=WARMUP_TOP_N_TOKENS)] * rows
        self._synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated_before = torch.cuda.memory_allocated(self.device)
        try:
            with torch.inference_mode():
                logits = torch.randn(rows, self.vocab_size, dtype=torch.float32, device=self.device)
                sample(logits, params, [1] * rows, last_tokens=[0] * rows)
                del logits
        except torch.OutOfMemoryError as e:
            raise WarmupOutOfMemory(
                f"Not enough memory to sample {rows} sequences at once ({self.vocab_size} logits each). "
                f"You need to decrease `--max-batch-prefill-tokens`") from e
        self._synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - allocated_before
        torch.cuda.empty_cache()
        return peak

    def _blocks_for_free_gpu_memory(self, allocated_before: int, scratch_bytes: int, sampling_bytes: int = 0,
                                    graph_bytes: int = 0, peak_allocated: int | None = None) -> int:
        """The KV blocks a GPU pool gets after warmup (``cuda_kv_blocks``): the warmup's activation peak is its
        allocation high-water mark above what was allocated before it, less its ``scratch_bytes`` KV scratch,
        which later steps of that size need again; a draft model attached to this runner gets a pool of as
        many blocks (its weights were loaded before, so they are not in the free memory)."""
        if peak_allocated is None:
            peak_allocated = torch.cuda.max_memory_allocated(self.device)
        activation_peak = peak_allocated - allocated_before - scratch_bytes
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        draft_block_bytes = bytes_per_block(**self.draft.runner._kv_layout) if self.draft is not None else 0
        num_blocks = cuda_kv_blocks(free_bytes=free_bytes, total_bytes=total_bytes,
                                    memory_fraction=self.cuda_memory_fraction, activation_peak=activation_peak,
                                    sampling_bytes=sampling_bytes + graph_bytes,
                                    block_bytes=bytes_per_block(**self._kv_layout),
                                    draft_block_bytes=draft_block_bytes)
        if num_blocks < 1:
            raise WarmupOutOfMemory(
                f"no GPU memory left for the KV cache after warmup: {free_bytes} bytes free of {total_bytes}, "
                f"`--cuda-memory-fraction` {self.cuda_memory_fraction}, activation peak {activation_peak} "
                f"bytes, sampling {sampling_bytes} bytes"
                + (f", CUDA graphs {graph_bytes} bytes" if graph_bytes else "")
                + (f", a draft model's pool {draft_block_bytes} bytes a block" if draft_block_bytes else "")
                + ". Decrease `--max-batch-prefill-tokens` or raise `--cuda-memory-fraction`")
        return num_blocks
