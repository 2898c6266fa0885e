"""One rank's inference engine: weights, KV block pool, one forward pass per step, sampling on rank 0.

No sockets and no processes here: the worker process feeds ``launch`` (``step`` is a launch and its result)
from the scheduler's StepCommands.
Block ids come from the scheduler; this class trusts them (it only checks that a sequence's table
covers its tokens, since a short table would silently write into the padding block).

The KV pool holds no notion of ownership: a step reads whatever its block tables name. So a sequence may
first appear with ``num_computed > 0`` and a table whose first blocks another request wrote (a prefix
cache hit; the pool keeps their contents after that request is dropped), and a request that was dropped
(preempted) may come back as a new sequence that recomputes its prompt and generated tokens. Nothing
else about a request survives ``drop``, and nothing needs to: sampling is stateless (see sampling.py)
and the token history of a penalised request restarts from the step's tokens and ``cached_ids``.
"""

from __future__ import annotations

import itertools

import torch

from llmbus.bus.messages import DRAFT_GUESS
from llmbus.bus.procfs import mem_available_bytes
from llmbus.workers.cuda_graphs import DecodeGraphs
from llmbus.workers.piecewise_graphs import PiecewiseGraphs
from llmbus.workers.draft import DraftProposer
from llmbus.workers.grammar import GrammarMasks, MaskJob
from llmbus.workers.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_bytes
from llmbus.workers.loader import load_model
from llmbus.workers.lora import StepAdapters, attach_adapters
from llmbus.workers.memory_budget import DEFAULT_KV_CACHE_BYTES, WarmupOutOfMemory, out_of_memory_reason
from llmbus.workers.sampling import Sampled, has_penalties, plain_greedy, sample
from llmbus.workers.launched_step import (DeviceFeed, LaunchedStep, ResultCopy, StepOutput, fed_ids, fed_ids_and,
                                          to_device)
from llmbus.workers.step_clock import DeviceTimeline, StepClock
from llmbus.workers.runner_warmup import RunnerWarmup
from llmbus.workers.seq_input import SeqInput
from llmbus.workers.mrope import mrope_positions
from llmbus.workers.vision import StepImages, image_key_limits
from llmbus.workers.step_rows import PromptLogprobRows, TokenHistory, keep_verified, one_token_rows


def out_of_memory_step(reason: str, rank: int) -> StepOutput | None:
    """What a rank returns for a step that ran out of memory: the memory the step's tensors held goes back to
    the device (the caller has left its except block, so the traceback no longer keeps them), and rank 0
    reports the step failed; the scheduler fails its requests and the ranks forget them on the next step."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return StepOutput([], [], [], 0.0, 0.0, failed=reason) if rank == 0 else None


class ModelRunner(RunnerWarmup):
    """Loads this rank's shard of a Hugging Face model folder and runs batched steps over a paged KV pool.

    With ``world_size > 1`` the caller has initialised ``torch.distributed``; every rank must call
    ``warmup`` and ``step`` with identical arguments, since the forward pass runs collectives.
    ``num_blocks`` is known after ``__init__``, except on CUDA with neither ``num_blocks`` nor
    ``kv_cache_bytes`` given: then ``warmup`` measures the activation peak and sizes the pool from the
    free memory (a draft model's runner built so is given its pool by the target's warmup, ``attach_draft``
    first).
    """

    def __init__(self, model_dir: str, *, rank: int = 0, world_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int = 16, kv_cache_bytes: int | None = None, num_blocks: int | None = None,
                 max_batch_prefill_tokens: int = 4096, cuda_memory_fraction: float = 1.0,
                 quantize: str | None = None, kv_cache_dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False, watermark_gamma: float | None = None,
                 watermark_delta: float | None = None, attention_backend: str = "auto",
                 cuda_graphs: tuple[int, ...] = (), lora_adapters: tuple[tuple[str, str], ...] = (),
                 piecewise_graphs: tuple[int, ...] = (), full_graphs: bool = False,
                 rope_scaling: tuple[str, float] | None = None):
        """``cuda_graphs``: decode batch sizes to capture as CUDA graphs at warmup (``cuda_graphs.py``; on
        CUDA, with an attention backend that can be captured; sizes above ``max_batch_prefill_tokens`` are
        left out). ``lora_adapters``: (name, local PEFT LoRA folder) each, loaded on every rank, this rank's
        slice of each (``lora.py``; ``lora.LoraError`` for one that cannot be served). ``piecewise_graphs``:
        token counts for which the layers between attention calls are captured (``piecewise_graphs.py``; on
        CUDA, where the decode steps are captured too); ``full_graphs``: their buckets captured whole, the
        attention too, once the pool exists (``PiecewiseGraphs.attend_in_graphs``). ``rope_scaling``: TGI's
        --rope-scaling/--rope-factor as (kind, factor), in place of the model's own (``load_model``)."""
        self.rank = rank
        self.world_size = world_size
        self.draft: DraftProposer | None = None  # attach_draft
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.graph_sizes = tuple(b for b in cuda_graphs if b <= max_batch_prefill_tokens)
        self.graphs: DecodeGraphs | None = None  # captured by warmup
        self.piecewise_sizes = tuple(t for t in piecewise_graphs if t <= max_batch_prefill_tokens)
        self.piecewise: PiecewiseGraphs | None = None  # captured by warmup
        self.full_graphs = full_graphs
        self._last_clock: StepClock | None = None
        self.timeline = DeviceTimeline() if self.device.type == "cuda" and rank == 0 else None
        # the greedy ids and logprobs a graph computed for the step's sampled rows (a decode graph's, or a
        # piecewise step's head graph), and their vector for the result copy (_forward); whether it replayed
        # a decode graph
        self._graph_greedy: tuple | None = None
        self._replayed = False
        self.cuda_memory_fraction = cuda_memory_fraction
        self.model = load_model(model_dir, rank=rank, world_size=world_size, dtype=dtype, device=self.device,
                                quantize=quantize, trust_remote_code=trust_remote_code,
                                attention_backend=attention_backend, rope_scaling=rope_scaling)
        self._adapter_index = attach_adapters(self.model, lora_adapters)  # name -> index
        # a vision-language model's image rows (vision.py); None for a text model
        vision = getattr(self.model, "vision", None)
        self.images = StepImages(vision, self.device) if vision is not None else None
        self._mrope = getattr(getattr(self.model, "rotary", None), "mrope_section", None) is not None
        self._images_both_ways = getattr(self.model, "images_attend_both_ways", False)
        # whether the adapters' deltas are Triton kernels, which read each row's slot and no grouping of rows
        self._lora_kernels = bool(self._adapter_index) and self.model.active_adapters.kernels
        # What the model computes in: the weights' ``dtype``, or float32 over bfloat16 weights
        # (quant.compute_plan).
        self.dtype = self.model.dtype
        # What the KV pool stores (attention computes in self.dtype): by default what the model computes in,
        # float32 for bfloat16 weights too, chosen by its measured error (benchmarks/bf16_quality.py: float16
        # cost SmolLM2 0.15% perplexity and 2 of 20 answers; design notes, "bfloat16 weights, float32
        # activations"); --kv-cache-dtype float16 halves it, as llama.cpp's default does.
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.watermark_gamma, self.watermark_delta = watermark_gamma, watermark_delta  # None: sampling's defaults
        self.model_dir = model_dir
        # Rank 0, constrained decoding: built on the first request with a grammar (its vocabulary index
        # takes time and memory that a server without such requests need not spend; design notes,
        # "Structured output").
        self._grammar: GrammarMasks | None = None
        self.max_position_embeddings = self.model.max_position_embeddings
        self.vocab_size = self.model.config.vocab_size
        # Rank 0 only, and only for requests with a repetition or frequency penalty.
        self.histories: dict[str, TokenHistory] = {}
        # Rank 0, prompt logprobs of a chunked prompt: the log-softmax of a chunk's last row, which
        # scores the first token of the next chunk.
        self.pending_prompt_rows: dict[str, torch.Tensor] = {}
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0
        if num_blocks is None and kv_cache_bytes is None and self.device.type == "cuda":
            return  # sized by warmup()
        if num_blocks is None:
            budget = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
            num_blocks = self._blocks_for_bytes(budget)
            if num_blocks < 1:
                given = "" if kv_cache_bytes is not None else " (its default)"
                raise WarmupOutOfMemory(f"`--kv-cache-memory` {budget} bytes{given} cannot hold one KV block of "
                                        f"{self.block_size} tokens: lower --block-size or raise --kv-cache-memory")
        if self.device.type == "cpu":
            self._check_host_memory(num_blocks)
        self.kv_cache = self._new_cache(num_blocks)
        self.num_blocks = num_blocks

    # -- KV pool ---------------------------------------------------------------------------------

    @property
    def _kv_layout(self) -> dict:
        """The pool's shape arguments, as kv_cache's sizing functions and PagedKVCache take them."""
        return dict(num_layers=self.model.num_layers, block_size=self.block_size,
                    num_kv_heads=self.model.num_local_kv_heads, head_dim=self.model.config.head_dim,
                    dtype=self.kv_cache_dtype)

    def _blocks_for_bytes(self, budget_bytes: int) -> int:
        return num_blocks_for_bytes(budget_bytes, **self._kv_layout)

    def _check_host_memory(self, num_blocks: int) -> None:
        """Refuse a CPU pool the machine cannot back: ``torch.empty`` would succeed (pages are committed
        lazily) and the kernel's OOM killer would end the process mid-generation instead."""
        available = mem_available_bytes()
        if available is None:
            return
        per_rank = bytes_per_block(**self._kv_layout) * (num_blocks + 1)
        # Every rank of a CPU group shares this machine's memory.
        if per_rank * self.world_size > available:
            raise WarmupOutOfMemory(
                f"Not enough memory for the KV cache: {num_blocks} blocks take {per_rank} bytes per rank "
                f"x {self.world_size} rank(s), but only {available} bytes are available. "
                f"Decrease `--kv-cache-memory` (or `--num-blocks`)")

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        return PagedKVCache(num_blocks=num_blocks, device=self.device, compute_dtype=self.dtype, **self._kv_layout)

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded, in the order given."""
        return list(self._adapter_index)

    @property
    def compute_paths(self) -> dict:
        """Which attention backend runs, and whether small decode steps take the fused C layer (for the log)."""
        backend = getattr(self.model, "attention_backend", None)
        return {"attention": getattr(backend, "name", "model's own"),
                "fused_decode": getattr(self.model, "fused_decode", None) is not None,
                "cuda_graphs": list(self.graphs.sizes) if self.graphs is not None else [],
                **({"piecewise_graphs": self.piecewise.sizes} if self.piecewise is not None else {})}

    # -- steps -----------------------------------------------------------------------------------

    def _forward(self, seqs: list[SeqInput], kv_cache: PagedKVCache, logits_index: torch.Tensor | None = None,
                 feed: DeviceFeed | None = None) -> torch.Tensor | None:
        """Float32 logits of the rows ``logits_index`` of the flat token batch (default: the last row of
        every sampled sequence) on rank 0, None elsewhere; ``feed`` (``launch``) writes into the batch's ids."""
        query_lens = [len(s.token_ids) for s in seqs]
        for seq, n in zip(seqs, query_lens):
            if n == 0:
                raise ValueError(f"{seq.rid}: no tokens to compute")
            if seq.num_computed + n > len(seq.block_table) * self.block_size:
                raise ValueError(f"{seq.rid}: {len(seq.block_table)} blocks of {self.block_size} cannot hold "
                                 f"{seq.num_computed + n} tokens")
        # A step with adapter rows replays too where the graphs hold the adapters' kernels (CUDA), else eagerly;
        # a graph stages its rows' adapters itself.
        self._graph_greedy = None
        # a step that computes image placeholders reads their embeddings from the vision encoder: eagerly
        embeddings = self.images.embeddings(seqs, query_lens) if self.images is not None else None
        self._replayed = (logits_index is None and kv_cache is self.kv_cache and self.graphs is not None
                          and embeddings is None and self.graphs.applies(seqs))
        if self._replayed:  # (decode rows of M-RoPE past their images too: the graph adds their shift)
            logits = self.graphs.forward(seqs, feed)
            self._graph_greedy = self.graphs.greedy
            return logits
        # M-RoPE rows after an image rotate by other positions than their places: eagerly (mrope.py)
        rope_positions = mrope_positions(seqs, query_lens, self.device) if self._mrope else None
        # Gemma 3's image rows attend their whole image: their own masks, eagerly
        key_limits = image_key_limits(seqs, query_lens) if self._images_both_ways else None
        eager = embeddings is not None or rope_positions is not None or key_limits is not None
        # the logits of the sampled rows alone: a head graph's greedy choices are then those rows' own
        sampled_rows_only = logits_index is None
        adapters = StepAdapters.of([s.adapter for s in seqs], query_lens, self._adapter_index, self.device,
                                   grouped=not self._lora_kernels)
        last_rows = [end - 1 for seq, end in zip(seqs, itertools.accumulate(query_lens)) if seq.sample
                     ] if sampled_rows_only else []
        input_ids, sent_rows = fed_ids_and((s.token_ids for s in seqs), feed, last_rows, self.device)
        if sampled_rows_only:
            logits_index = sent_rows
        horizons = self._prompt_horizons(seqs, query_lens)
        block_tables = [s.block_table for s in seqs]
        # (the piecewise parts rotate by their captured start mask alone: a step with horizons runs eagerly)
        piecewise = (self.piecewise is not None and horizons is None and not eager
                     and self.piecewise.applies(len(input_ids), adapters, kv_cache, block_tables))
        if piecewise and self.piecewise.index is not None:  # graphs that attend too read the index in place
            meta = self.piecewise.stage(query_lens, [s.num_computed for s in seqs], block_tables)
        else:
            meta = self.model.attention_backend.build_metadata(
                query_lens=query_lens, num_computed=[s.num_computed for s in seqs], block_tables=block_tables,
                kv_cache=kv_cache, device=self.device, key_limits=key_limits)
        if horizons is not None:
            meta.sequence_horizons = to_device(horizons, torch.long, self.device)
        if eager:
            return self.model.forward(input_ids, meta.positions, kv_cache, meta, logits_index, adapters=adapters,
                                      embeddings=embeddings, rope_positions=rope_positions)
        if adapters is None:
            if piecewise:
                logits = self.piecewise.forward(input_ids, meta.positions, kv_cache, meta, logits_index)
                if sampled_rows_only:
                    self._graph_greedy = self.piecewise.greedy
                return logits
            return self.model.forward(input_ids, meta.positions, kv_cache, meta, logits_index)
        return self.model.forward(input_ids, meta.positions, kv_cache, meta, logits_index, adapters=adapters)

    @property
    def image_layout(self) -> str:
        """The images this model reads (``WorkerReady.images``): "" none, "sequence", "grid" (M-RoPE), or "whole"
        (each image's placeholders in one step: they attend each other both ways)."""
        return ("" if self.images is None else "grid" if self._mrope else "whole" if self._images_both_ways
                else "sequence")

    @property
    def replayed_last(self) -> bool:
        """Whether the step launched last replayed a decode graph (the worker's timeline counts the rest apart)."""
        return self._replayed

    @property
    def rope_split_tokens(self) -> int:
        """The original length of a LongRoPE or dynamic NTK rotary (a prompt longer than this is rotated by other
        factors, or another base, from its first token: ``_prompt_horizons``); 0 where every prompt is rotated
        alike."""
        rotary = getattr(self.model, "rotary", None)
        return (rotary.original_max_positions if rotary is not None and rotary.rope_type in ("longrope", "dynamic")
                else 0)

    @property
    def rope_split_by_length(self) -> bool:
        """Whether a prompt past ``rope_split_tokens`` is rotated by its own length (dynamic NTK's base), not
        alike for every such prompt (LongRoPE's long factors): the prefix cache then keeps each length apart."""
        rotary = getattr(self.model, "rotary", None)
        return rotary is not None and rotary.rope_type == "dynamic"

    def _prompt_horizons(self, seqs: list[SeqInput], query_lens: list[int]) -> list[int] | None:
        """``AttentionMetadata.sequence_horizons``, as transformers' one prefill of a whole prompt rotates it:
        LongRoPE's where a sequence's rows are a chunk of a prompt that goes on past the step (its factors
        follow the whole prompt); where the rotary goes by prompt length (dynamic NTK, and the fallback's LongRoPE:
        fallback_rotary.py), each prompt's last position, where a prompt token past the original length is in
        the step (it is rotated by the whole prompt, generated tokens by their own positions). None for every
        other step and model."""
        split = self.rope_split_tokens
        if not split:
            return None
        if self.model.rotary.by_prompt_length:
            if not any(s.num_computed < s.prompt_len - 1 and s.prompt_len > split for s in seqs):
                return None
            return [s.prompt_len - 1 for s in seqs]
        ends = [s.num_computed + n for s, n in zip(seqs, query_lens)]
        if all(s.prompt_len <= end for s, end in zip(seqs, ends)):
            return None
        return [max(end, s.prompt_len) - 1 for s, end in zip(seqs, ends)]

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


    def step(self, seqs: list[SeqInput]) -> StepOutput | None:
        """One forward pass over every sequence's new tokens; rank 0 samples the ``sample=True`` ones
        (``launch``, then its result)."""
        return self.launch(seqs).result()

    def launch(self, seqs: list[SeqInput], feed: DeviceFeed | None = None) -> LaunchedStep:
        """Queue a step on the device: its forward pass, rank 0's sampling and the copy of its tokens to the
        host (launched_step.py). ``feed`` writes tokens of the step launched before, still on the device,
        into this one's input rows (where ``token_ids`` hold ``SAMPLED_LAST``).

        A step that runs out of memory gives a failed StepOutput (``out_of_memory_step``) instead of
        raising, so the rank lives on. With tensor parallelism only once the forward pass is over: a rank
        that failed inside it leaves the others waiting in a collective it will never join, and a
        collective to agree on the failure would be matched against theirs, so that stays a group failure.
        """
        self._collectives_done = self.world_size == 1
        self._ids_owed = 0
        try:
            return self._launch(seqs, feed)
        except torch.OutOfMemoryError as e:
            if not self._collectives_done:
                raise
            reason = out_of_memory_reason(e, seqs)
        if self._ids_owed:  # the other ranks wait in the broadcast of the ids: give them placeholders
            torch.distributed.broadcast(torch.zeros(self._ids_owed, dtype=torch.long, device=self.device), src=0)
        return LaunchedStep.finished(out_of_memory_step(reason, self.rank))

    def _launch(self, seqs: list[SeqInput], feed: DeviceFeed | None) -> LaunchedStep:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is sized by warmup() on CUDA: call it before step()")
        if not seqs:
            return LaunchedStep.finished(StepOutput([], [], [], 0.0, 0.0) if self.rank == 0 else None)
        speculating = [s for s in seqs if s.num_spec and s.sample]
        # decided before rank 0 fills them in: every rank must take part in the broadcast
        guesses_to_share = self.world_size > 1 and any(DRAFT_GUESS in s.token_ids for s in speculating)
        if self.draft is not None:
            self.draft.fill(seqs)  # rank 0: the draft follows every step, and fills the guesses left to it
        if guesses_to_share:
            self._share_guesses(speculating)
        if speculating:
            seqs = one_token_rows(seqs)
        with torch.inference_mode():
            # only rank 0 reads a step's times: the other ranks' clocks record no CUDA events
            clock = StepClock(self.device if self.rank == 0 else torch.device("cpu"), self._last_clock)
            self._last_clock = clock
            # Constrained requests' masks are computed on another thread while the forward pass runs.
            mask_job = self._start_masks(seqs) if self.rank == 0 else None
            prompt_rows = PromptLogprobRows.plan(seqs, self.device)
            sampled = [s for s in seqs if s.sample]
            rids = [s.rid for s in sampled]
            # With tensor parallelism rank 0 broadcasts the ids it samples, so every rank can feed them to a step
            # sent ahead on the device (SAMPLED_LAST) as rank 0 does; a speculating step's are not fed on.
            broadcast = len(sampled) if self.world_size > 1 and not speculating else 0
            received = (torch.empty(broadcast, dtype=torch.long, device=self.device)
                        if broadcast and self.rank != 0 else None)
            logits = self._forward(seqs, self.kv_cache, prompt_rows.logits_index if prompt_rows else None, feed)
            # requests whose image the ranks could not read: every rank computed them alike; rank 0 fails them
            image_errors = self.images.take_failures() if self.images is not None else []
            replayed = self._replayed
            clock.forward_done()
            self._collectives_done = True  # rank 0's sampling and grammar masks are its own
            if self.rank != 0:
                if received is None:
                    return LaunchedStep.finished(None)
                torch.distributed.broadcast(received, src=0)
                return LaunchedStep(lambda: None, None, received, rids)
            self._ids_owed = broadcast
            prompt_logprobs = []
            if prompt_rows is not None:
                prompt_logprobs = prompt_rows.gather(logits, self.pending_prompt_rows)
                logits = logits.index_select(0, prompt_rows.sample_rows)
            if not sampled:
                self._record_histories(seqs, sampled, feed)
                clock.sampling_done()
                forward_time, sample_time = clock.times(wait=True)
                if self.timeline is not None:
                    self.timeline.add(clock, forward_time + sample_time, len(seqs), replayed)
                return LaunchedStep.finished(StepOutput([], [], [], forward_time, sample_time, prompt_logprobs,
                                                        errors=image_errors))
            errors = self._grammar.apply(logits, mask_job) if mask_job is not None else {}
            histories = self._record_histories(seqs, sampled, feed)
            if (self._graph_greedy is not None and mask_job is None
                    and all(plain_greedy(s.sampling) for s in sampled)):
                ids, logprobs, packed = self._graph_greedy  # the graph's own choice: no sampling launched here
                out = Sampled(ids, logprobs)
            else:
                packed = None
                # The watermark seeds on the token before the sampled one: the last one fed this step.
                out = sample(logits, [s.sampling for s in sampled],
                             [s.num_computed + len(s.token_ids) for s in sampled], histories,
                             [s.token_ids[-1] for s in sampled], [s.prompt_len for s in sampled],
                             watermark_gamma=self.watermark_gamma, watermark_delta=self.watermark_delta)
            if self._ids_owed:
                torch.distributed.broadcast(out.token_ids, src=0)
                self._ids_owed = 0
            clock.sampling_done()
            copy = ResultCopy(out.token_ids, out.logprobs, out.top, packed)

        def finish() -> StepOutput:
            token_list, logprob_list, top_tokens = copy.lists()
            forward_time, sample_time = clock.times()
            if self.timeline is not None:
                self.timeline.add(clock, forward_time + sample_time, len(seqs), replayed)
            out_rids, num_tokens = rids, []
            if speculating:
                out_rids, token_list, logprob_list, top_tokens, num_tokens = keep_verified(
                    sampled, token_list, logprob_list, top_tokens)
            return StepOutput(rids=out_rids, token_ids=token_list, logprobs=logprob_list,
                              forward_time=forward_time, sample_time=sample_time, prompt_logprobs=prompt_logprobs,
                              top_tokens=top_tokens,
                              errors=[[rid, kind, why] for rid, (kind, why) in errors.items()] + image_errors,
                              num_tokens=num_tokens)
        # A speculating step's rows are positions, not requests: its tokens are not fed on.
        return LaunchedStep(finish, copy, None if speculating else out.token_ids, rids)

    def _start_masks(self, seqs: list[SeqInput]) -> MaskJob | None:
        """Hand this step's tokens of the constrained requests to their matchers and start computing the
        masks of those that sample; None when none does."""
        rows, rids, positions = [], [], []
        row = 0
        for seq in seqs:
            if seq.grammar is not None:
                if self._grammar is None:
                    self._grammar = GrammarMasks(self.model_dir, self.model.config.vocab_size)
                self._grammar.observe(seq.rid, seq.grammar, seq.prompt_len, seq.cached_ids, seq.num_computed,
                                      seq.token_ids)
                if seq.sample:
                    rows.append(row)
                    rids.append(seq.rid)
                    positions.append(seq.num_computed + len(seq.token_ids))
            row += seq.sample
        return self._grammar.start_masks(rows, rids, positions) if rids else None

    @property
    def grammar_requests(self) -> int:
        """Constrained requests whose matcher rank 0 holds (0 once every one was dropped)."""
        return self._grammar.active if self._grammar is not None else 0

    def _record_histories(self, seqs: list[SeqInput], sampled: list[SeqInput],
                          feed: DeviceFeed | None) -> list[TokenHistory | None] | None:
        """Append this step's tokens to the penalised requests' histories on the device (chunks land at their
        ``num_computed``; a new history starts with the sequence's ``cached_ids``; a token fed on the device
        is taken from there); the histories of the sampled sequences, None where not penalised."""
        penalised = [i for i, seq in enumerate(seqs) if has_penalties(seq.sampling)]
        if not penalised:
            return None
        starts = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
        flat = fed_ids((s.token_ids for s in seqs), feed, self.device)
        for i in penalised:
            seq = seqs[i]
            history = self.histories.get(seq.rid)
            if history is None:
                history = self.histories[seq.rid] = TokenHistory(self.vocab_size, seq.prompt_len, self.device)
                if seq.cached_ids:
                    history.write(0, seq.cached_ids)
            history.write(seq.num_computed, flat[starts[i]:starts[i + 1]])
        return [self.histories[s.rid] if has_penalties(s.sampling) else None for s in sampled]

    def attach_draft(self, draft_runner: "ModelRunner") -> None:
        """Rank 0: a draft model (--draft-model-id) guesses for requests the scheduler left guesses open."""
        self.draft = DraftProposer(draft_runner)

    def _share_guesses(self, speculating: list[SeqInput]) -> None:
        """Every rank must feed rank 0's draft guesses: broadcast them (one small tensor a step)."""
        count = sum(s.num_spec for s in speculating)
        if self.rank == 0:
            flat = [t for s in speculating for t in s.token_ids[len(s.token_ids) - s.num_spec:]]
            buffer = torch.tensor(flat, dtype=torch.long, device=self.device)
        else:
            buffer = torch.empty(count, dtype=torch.long, device=self.device)
        torch.distributed.broadcast(buffer, src=0)
        values, offset = buffer.tolist(), 0
        for s in speculating:
            s.token_ids = s.token_ids[:len(s.token_ids) - s.num_spec] + values[offset:offset + s.num_spec]
            offset += s.num_spec

    def drop(self, rids: list[str]) -> None:
        """Forget per-request state (token histories, pending prompt-logprob rows) of finished, aborted or
        preempted requests. Their KV blocks are left as they are: the scheduler may hand them to another
        request as a cached prefix."""
        for rid in rids:
            self.histories.pop(rid, None)
            self.pending_prompt_rows.pop(rid, None)
        if self.draft is not None:
            self.draft.drop(rids)
        if self._grammar is not None:
            self._grammar.drop(rids)
        if self.graphs is not None:
            self.graphs.forget(rids)  # their tables on the device: a request that comes back may have others
        if self.images is not None:
            self.images.drop(rids)
