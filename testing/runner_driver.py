"""Driving a ModelRunner by hand and checking it against transformers (shared by the model-runner tests).

A minimal scheduler (``Request``, ``drive``), the mixed continuous-batching workload, the transformers
reference with its top-1/top-2 margin check, and a two-rank tensor-parallel run. Random weights give
near-tied logits, so checkpoints are re-initialised with a wide normal (``widen_weights``) and every
compared reference position must have a top-1/top-2 logit margin above ``MIN_MARGIN``: a token match is
then meaningful, not a coin flip between two almost equal logits, and a mismatch is a real bug.
"""

from __future__ import annotations

import copy
import itertools
import json
import multiprocessing
import os
import random
from dataclasses import dataclass, field

import torch

from llmbus.bus.messages import DRAFT_GUESS, SAMPLED_LAST, Grammar, SamplingParams
from llmbus.scheduler.requests import images_chunk_end
from llmbus.workers.model_runner import ModelRunner, SeqInput

BLOCK_SIZE = 4  # small, so sequences span many non-contiguous blocks
NUM_BLOCKS = 160
MAX_NEW_TOKENS = 12
MIN_MARGIN = 1e-3
PROMPT_LENGTHS = (1, 3, 7, 19, 40)  # a 1-token prompt runs in the decode group; 40 is prefilled in chunks
WEIGHT_STD = 0.3
# A tensor-parallel rank's prefill budget (its warmup's tokens) where Triton's interpreter runs the kernels.
INTERPRETED_PREFILL_TOKENS = 64


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def widen_weights(model) -> None:
    """Matrices and biases drawn from N(0, WEIGHT_STD) (norm weights stay ones), for clear margins."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith(".bias"):
                param.normal_(0.0, WEIGHT_STD)


@dataclass
class Reference:
    tokens: list[list[int]]  # per prompt, greedy continuation
    logits: list[torch.Tensor]  # per prompt, [MAX_NEW_TOKENS, vocab] raw logits

    def greedy_logprobs(self, i: int) -> torch.Tensor:
        """transformers' log_softmax of prompt ``i``'s greedy tokens, ``[MAX_NEW_TOKENS]``."""
        logprobs = torch.log_softmax(self.logits[i], dim=-1)
        return logprobs.gather(1, torch.tensor(self.tokens[i])[:, None]).squeeze(1)


def reference(path: str, prompts: list[list[int]], *, check_margins: bool = True,
              generate_kwargs: list[dict | None] | None = None, **config_overrides) -> Reference:
    """transformers' float32 greedy ``generate`` of every prompt, one at a time; ``config_overrides``
    go to ``from_pretrained`` (to run the same weights under another attention pattern). ``generate_kwargs[i]``:
    more of ``generate``'s arguments for prompt i (a ``sequence_bias``, a ``logits_processor``); its ``logits``
    are then the processed scores (what the argmax and a served logprob read)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              **config_overrides).eval()
    tokens, logits = [], []
    for i, prompt in enumerate(prompts):
        extra = (generate_kwargs[i] if generate_kwargs else None) or {}
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             output_logits=True, output_scores=True, return_dict_in_generate=True, **extra)
        generated = out.sequences[0, len(prompt):].tolist()
        step_logits = torch.stack(out.scores if extra else out.logits)[:, 0].float()
        assert len(generated) == MAX_NEW_TOKENS
        if check_margins:
            top2 = step_logits.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "reference margins too thin to compare tokens"
        tokens.append(generated)
        logits.append(step_logits)
    return Reference(tokens, logits)


# -- a minimal scheduler -------------------------------------------------------------------------


@dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_step: int = 0
    prefill_chunk: int | None = None  # None: a prompt (or a recomputation) in one step
    max_new_tokens: int = MAX_NEW_TOKENS
    # A prefix-cache hit: start with ``computed`` = len(blocks) * block_size tokens already in ``blocks``
    # (written by another request). Blocks given up front are also how a request lends its first blocks
    # to one arriving later in the same drive. Either way ``drive`` hands them to no one else.
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    # Preemption: once this many tokens are generated, drop the request from the runner and release its
    # blocks, but for the first ``resume_cached_blocks`` (a prefix-cache hit on its own blocks); it comes
    # back ``preempt_steps`` steps later as a new sequence recomputing its prompt and generated tokens.
    preempt_after: int | None = None
    resume_cached_blocks: int = 0
    preempt_steps: int = 1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)  # what NewRequestData.cached_ids would carry
    adapter: str = ""  # the LoRA adapter its sequence runs with (NewRequestData.adapter); "": the base model
    resume_step: int = 0
    preemptions: int = 0
    grammar: Grammar | None = None
    eos_ids: tuple[int, ...] = ()  # ids that end the request (none: only max_new_tokens does)
    # Speculation: each decode also feeds up to ``speculate`` guesses, read from ``oracle`` (the expected
    # tokens) with every third one made wrong, so steps keep some guesses and reject others; without an
    # oracle they are left to the runner's draft model (DRAFT_GUESS).
    speculate: int = 0
    oracle: list[int] = field(default_factory=list)
    kept_guesses: int = 0
    images: list = field(default_factory=list)  # ImageInput of its prompt (NewRequestData.images)
    whole_images: bool = False  # chunks never end inside an image (ranks whose WorkerReady.images is "whole")

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or bool(self.tokens and self.tokens[-1] in self.eos_ids)


def drive(runner: ModelRunner, requests: list[Request], share_tokens=None,
          feed_on_device: bool = False) -> dict[str, Request]:
    """Continuous batching by hand: arrivals mid-way, chunked prefills next to decodes, block tables
    grown on demand from a shuffled free list (so tables are never contiguous), blocks freed once no
    unfinished request holds them, prefix-cache hits and preemptions as the requests ask.

    Each step a request computes its tokens (prompt, then generated) from ``computed`` on, in chunks of
    ``prefill_chunk``, and samples after the last one: the first prompt chunk, a decode token, or after
    a preemption its prompt and every token it generated, as the scheduler re-sends it.

    ``share_tokens`` lets TP ranks other than 0 learn rank 0's sampled tokens (the scheduler's job).

    ``feed_on_device``: as the worker does for a step sent ahead, a decode row whose token the step before
    sampled is given ``SAMPLED_LAST`` and takes the token from that step's sampled ids on the device
    (``ModelRunner.launch``'s ``feed``)."""
    held = {b for r in requests for b in r.blocks}
    free_blocks = [b for b in range(runner.num_blocks) if b not in held]
    random.Random(0).shuffle(free_blocks)
    for req in requests:
        assert req.computed in (0, len(req.blocks) * runner.block_size), f"{req.rid}: a cached prefix is whole blocks"
        req.cached_ids = req.prompt[:req.computed]

    def release(blocks: list[int]) -> None:
        in_use = {b for r in requests if not r.done for b in r.blocks}
        free_blocks.extend(b for b in blocks if b not in in_use)

    step = 0
    last_launched = None
    while not all(r.done for r in requests):
        scheduled, seqs = [], []
        fed_rows, fed_rids, flat = [], [], 0
        for req in requests:
            if req.done or max(req.arrival_step, req.resume_step) > step:
                continue
            sequence = req.prompt + req.tokens
            remaining = len(sequence) - req.computed
            take = remaining if req.prefill_chunk is None else min(req.prefill_chunk, remaining)
            if req.whole_images:  # as the scheduler cuts chunks for such ranks
                take = images_chunk_end(req.images, req.computed, req.computed + take) - req.computed
            new_tokens = sequence[req.computed:req.computed + take]
            guesses = []
            if req.speculate and remaining == 1 and req.tokens:
                n = len(req.tokens)
                room = min(req.speculate, req.max_new_tokens - n - 1)
                guesses = ([t if (n + i) % 3 else t + 1 for i, t in enumerate(req.oracle[n:n + room])]
                           if req.oracle else [DRAFT_GUESS] * max(room, 0))
                new_tokens, take = new_tokens + guesses, 1 + len(guesses)
            blocks_needed = -(-(req.computed + take) // runner.block_size)
            while len(req.blocks) < blocks_needed:
                req.blocks.append(free_blocks.pop())
            sample = take - len(guesses) == remaining
            # (the worker feeds the host's token to rows whose token the host reads: see _device_feed)
            if (feed_on_device and last_launched is not None and remaining == 1 and not guesses
                    and req.grammar is None and not req.sampling.watermark and last_launched.can_feed([req.rid])):
                new_tokens = [SAMPLED_LAST]
                fed_rows.append(flat)
                fed_rids.append(req.rid)
            flat += len(new_tokens)
            scheduled.append((req, take, sample, len(guesses)))
            seqs.append(SeqInput(rid=req.rid, token_ids=new_tokens, num_computed=req.computed,
                                 block_table=list(req.blocks), sample=sample, sampling=req.sampling,
                                 prompt_len=len(req.prompt), cached_ids=req.cached_ids, grammar=req.grammar,
                                 num_spec=len(guesses), adapter=req.adapter,
                                 images=req.images))
        feed = last_launched.feed(fed_rows, fed_rids) if fed_rows else None
        last_launched = runner.launch(seqs, feed)
        out = last_launched.result()
        sampled = None
        if out is not None:  # rid -> [(token, logprob)]: one each, or what a speculating one kept
            counts = out.num_tokens or [1] * len(out.rids)
            pairs = list(zip(out.token_ids, out.logprobs))
            starts = itertools.accumulate([0, *counts])
            sampled = {rid: pairs[start:start + n] for rid, start, n in zip(out.rids, starts, counts)}
        if share_tokens is not None:
            sampled = share_tokens(sampled)
        for req, num_new, sample, num_guesses in scheduled:
            req.computed += num_new
            if sample:
                kept = sampled[req.rid]
                if num_guesses:  # the last token and the guesses kept count as computed, not the rest
                    req.computed -= num_new - len(kept)
                    req.kept_guesses += len(kept) - 1
                for token, logprob in kept:
                    req.tokens.append(token)
                    req.logprobs.append(logprob)
            if req.done:
                release(req.blocks)  # the list stays, for tests that reuse the blocks' contents
                runner.drop([req.rid])
            elif sample and len(req.tokens) == req.preempt_after:
                runner.drop([req.rid])  # what a StepCommand's finished_rids does on every rank
                kept, dropped = req.blocks[:req.resume_cached_blocks], req.blocks[req.resume_cached_blocks:]
                assert len(kept) * runner.block_size <= req.computed, "only full blocks are cached"
                req.blocks = kept
                release(dropped)
                req.computed = len(kept) * runner.block_size
                req.cached_ids = (req.prompt + req.tokens)[:req.computed]
                req.resume_step = step + 1 + req.preempt_steps
                req.preemptions += 1
        step += 1
    return {r.rid: r for r in requests}


def mixed_requests(prompts: list[list[int]]) -> list[Request]:
    """Request ``r{i}`` per prompt of ``PROMPT_LENGTHS``, in a continuous batch.

    Step 0: a 1-token prompt (decode group) beside two prompts of different lengths (padded prefill
    group). Step 4: the 40-token prompt's second chunk (offset 16) beside a fresh 19-token prompt, with
    the first three decoding; its chunks take 3 steps, sampling only after the last one."""
    arrivals = (0, 0, 0, 4, 3)
    chunks = (None, None, None, None, 16)
    return [Request(rid=f"r{i}", prompt=p, arrival_step=a, prefill_chunk=c)
            for i, (p, a, c) in enumerate(zip(prompts, arrivals, chunks))]


def uncaptured_piecewise(runner: ModelRunner, sizes: tuple[int, ...], *, whole: bool = False) -> list[int]:
    """Give ``runner`` piecewise graphs of ``sizes`` whose parts run uncaptured (as a GPU rank would replay
    them: ``piecewise_graphs.py``), with ``whole`` each bucket's attention between them over the fixed index
    as a whole graph holds it (``--full-graphs``); the list that then gets each piecewise step's token count."""
    from llmbus.workers.piecewise_graphs import PiecewiseGraphs

    runner.piecewise = PiecewiseGraphs(runner.model, sizes, capture=False)
    if whole:
        runner.piecewise.attend_in_graphs(runner.kv_cache, runner.context_blocks)
    counts: list[int] = []
    forward = runner.piecewise.forward
    runner.piecewise.forward = lambda ids, *a: counts.append(len(ids)) or forward(ids, *a)
    return counts


# -- tensor parallelism --------------------------------------------------------------------------


def _tp_worker(rank: int, environ: dict[str, str], world_size: int, model_dir: str, init_file: str, out_file: str,
               batches: dict[str, list[Request]], lora_adapters: tuple[tuple[str, str], ...] = (),
               attention_backend: str = "auto", piecewise: tuple[int, ...] = (), whole: bool = False) -> None:
    # The caller's environment, not the fork server's (started by an earlier test): TRITON_INTERPRET above all,
    # read when the kernels are first imported, here
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and attention_backend == "triton"
    if interpreted:  # each rank imports triton itself (the fork server has not)
        from llmbus.testing.triton_interpret import lighten_the_interpreter

        lighten_the_interpreter()
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world_size)
    try:
        # The warmup prefills this many tokens: interpreted, 256 would cost each rank more than its batch (a
        # Triton program in Python per token and layer), and no step of the batches here has more than 64.
        tp_runner = ModelRunner(model_dir, rank=rank, world_size=world_size, block_size=BLOCK_SIZE,
                                num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=INTERPRETED_PREFILL_TOKENS
                                if interpreted else 256, lora_adapters=lora_adapters,
                                attention_backend=attention_backend)
        tp_runner.warmup()
        piecewise_counts = uncaptured_piecewise(tp_runner, piecewise, whole=whole) if piecewise else []

        def share_tokens(sampled):
            box = [sampled]
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]

        results = {name: {rid: [r.tokens, r.logprobs]
                          for rid, r in drive(tp_runner, copy.deepcopy(batch), share_tokens=share_tokens).items()}
                   for name, batch in batches.items()}
        if piecewise and not set(piecewise_counts) - set(piecewise):  # raised in the caller by start_processes
            raise AssertionError(f"rank {rank}: no step ran piecewise padded to a bucket: {piecewise_counts}")
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        torch.distributed.destroy_process_group()


def drive_tensor_parallel(model_dir: str, batches: dict[str, list[Request]], work_dir: str,
                          world_size: int = 2, lora_adapters: tuple[tuple[str, str], ...] = (),
                          attention_backend: str = "auto", piecewise: tuple[int, ...] = (), whole: bool = False
                          ) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """``drive`` each batch in turn on ``world_size`` gloo ranks (one start for all of them), each rank loading
    ``lora_adapters`` and computing attention on ``attention_backend`` (ModelRunner's), its eager steps within
    ``piecewise`` token counts through uncaptured piecewise graphs (a rank where no step did, padded, fails), with
    ``whole`` their attention over the fixed index too (``--full-graphs``); per batch name, rank 0's
    ``{rid: (tokens, logprobs)}``."""
    out_file = os.path.join(work_dir, "tp_out.json")
    init_file = os.path.join(work_dir, "tp_init")
    # The ranks fork from a server process that imported torch and the runner once, for every call of this
    # process: a spawned rank imported them afresh, 2 s of CPU each, most of a small test's time (4.1 s -> 0.45 s
    # a call after the first). The server imports no Triton: each rank imports it under the caller's environment.
    multiprocessing.set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(_tp_worker, args=(dict(os.environ), world_size, model_dir, init_file,
                                                            out_file, batches, lora_adapters, attention_backend,
                                                            piecewise, whole),
                                          nprocs=world_size, start_method="forkserver")
    with open(out_file) as f:
        return {name: {rid: (tokens, logprobs) for rid, (tokens, logprobs) in results.items()}
                for name, results in json.load(f).items()}


# save_tiny_llama's shape (with its vocabulary size and tying): benchmarks that need only a checkpoint the runner
# loads write the same one without transformers (benchmarks/_random_llama.write_random_llama)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256)


def save_tiny_llama(path: str, *, tied: bool, vocab_size: int) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_LLAMA, vocab_size=vocab_size, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: generate runs all its tokens
    model = transformers.LlamaForCausalLM(config)
    widen_weights(model)
    # The untied checkpoint is split into several files, so model.safetensors.index.json is read too.
    model.save_pretrained(path, max_shard_size="200KB" if not tied else "1GB")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert (len(files) > 1) == (not tied), files
