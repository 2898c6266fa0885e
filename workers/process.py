"""One tensor-parallel rank: subscribe to steps, load the model, run every step, rank 0 answers.

Each rank keeps the state of the requests it has seen (sampling parameters, KV block table, cached prefix
tokens), updated from the diffs in each StepCommand and dropped when a step lists the request as finished
(or preempted: it may come back later as a new request with the same rid). Steps are
numbered: a rank that sees a gap stops with a WorkerFatal rather than compute with missing state.

A step the scheduler sent ahead (before it read the result of the step before) feeds ``SAMPLED_LAST`` where
a request's last token goes: rank 0 puts in the token it sampled for that request in the step before
(the scheduler's overlap; scheduler/process.py). When that step failed, the one sent ahead of it is
skipped: its diffs are applied, nothing is computed, and the scheduler drops its result.

On a GPU the step sent ahead usually arrives while the step before is still computing: the rank launches it
behind that step, its ``SAMPLED_LAST`` tokens written from the sampled ids still on the device
(workers/launched_step.py), and only then waits for the step before's tokens and answers it, so the device
never waits for the host's turnaround. With ``--launch-depth 2`` it keeps two such steps queued behind the one it
answers, each answered once done, so one long launch hides behind both. Rows whose token the host must read
first (a grammar, the watermark, a draft model) take the other way: answer every launched step first, then
feed the token from the host.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import time
from dataclasses import dataclass, field

import zmq

from llmbus.bus import messages as m
from llmbus.bus.gc_pauses import freeze_startup_heap, imports_frozen
from llmbus.bus.model_files import ROPE_SCALINGS, lora_entries, rope_override
from llmbus.bus.rundir import ENV_RUN_DIR, Endpoints
from llmbus.bus.service import (ServiceContext, ServiceError, Terminate, ignore_stop_signals, install_stop_signals,
                                run_service)
from llmbus.bus.settings import ServiceSettings, a_folder, finite, setting
from llmbus.bus.sockets import open_socket, recv, send
from llmbus.bus.shared_settings import (DEFAULT_MAX_BATCH_PREFILL_TOKENS, PREFILL_TOKENS_HELP, QUANTIZE_CHOICES,
                                        QUANTIZE_HELP)
from llmbus.workers.graph_sizes import (cuda_graphs_problem, parse_cuda_graphs, parse_piecewise_graphs,
                                        piecewise_graphs_problem)
from llmbus.workers.host_memory import (MIN_HUGE_HEAP_BYTES, bound_onednn_caches, heap_on_huge_pages,
                                        keep_freed_memory)
from llmbus.workers.placement import (cpu_budget, cpu_threads, cuda_float32_math, default_block_size,
                                      process_group_backend, resolve_device, resolve_dtype)


# How often a rank with a launched step looks at the step's device work; a command arriving meanwhile wakes it
# at once (it waits on the socket's descriptor, not in a sleep).
LAUNCHED_POLL_S = 50e-6
# --device-feed hold: how long a step's answer waits for the next command.
HOLD_S = 0.02

# --attention-backend's choices: auto, then workers.attention.BACKEND_CLASSES' names (a test keeps the two
# equal; that module imports torch, which the launcher reading these settings must not).
# TGI's ATTENTION values name its own kernels; every backend here reads a paged cache, so a TGI user's setting
# means "the paged default" (workers/attention/__init__.py TGI_ATTENTION_NAMES) rather than an error.
ATTENTION_BACKENDS = ("auto", "triton", "cpu_kernel", "torch_sdpa", "flashinfer", "flashdecoding", "paged")


@dataclass
class WorkerConfig(ServiceSettings):
    """A worker rank's settings (and the group's: `llmbus workers` passes its flags to every rank)."""

    run_dir: str = setting(help="the launch's run dir (its ipc sockets)", env=ENV_RUN_DIR, user=False)
    model_dir: str = setting(help="local model folder (config.json and weights, or a folder made from a GGUF)",
                             user=False, check=a_folder)
    rank: int | None = setting(None, help="run one rank in this process (internal)", user=False, hidden=True)
    world_size: int = setting(1, flag="--gpus", aliases=("--num-shard",), user=False,
                              help="tensor-parallel ranks of the group")
    dtype: str = setting("auto", env="DTYPE", choices=("auto", "float32", "bfloat16", "float16"),
                         help="auto: bfloat16 where the hardware runs it fast (CUDA with bf16; a CPU with "
                              "AVX2 + FMA, where bf16 weights compute in float32), float16 on a GPU without "
                              "bf16, else float32.")
    device: str = setting("auto", env="DEVICE", choices=("auto", "cpu", "cuda"),
                          help="auto: cuda where torch sees a GPU, else cpu.")
    attention_backend: str = setting(
        "auto", env="ATTENTION", choices=ATTENTION_BACKENDS,
        help="Attention over the paged KV cache. auto: triton on CUDA (torch_sdpa where Triton is missing), "
             "cpu_kernel on CPU (torch_sdpa without a C compiler). triton: paged Triton kernels (CUDA; on CPU "
             "only under TRITON_INTERPRET=1, slowly: for tests). cpu_kernel: llmbus's C kernels (CPU). "
             "torch_sdpa: the portable one (any device). TGI's names (flashinfer, flashdecoding, paged) mean auto. "
             "A backend named here that cannot run stops the start with the reason.")
    allow_tf32: bool = setting(False, env="ALLOW_TF32",
                               help="Let float32 matmuls and convolutions on CUDA use TF32 (faster, about 3 "
                                    "decimal digits): off, so float32 stays token-exact with transformers.")
    quantize: str | None = setting(None, env="QUANTIZE", choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    kv_cache_dtype: str = setting("auto", env="KV_CACHE_DTYPE", choices=("auto", "float32", "bfloat16", "float16"),
                                  help="What the KV cache stores. auto: the model's dtype, exact. float16 on a "
                                       "float32 model halves the cache's bytes (llama.cpp's default cache type) "
                                       "and what decode attention reads, at float16's rounding of K and V; the "
                                       "CPU kernels take it. TGI's fp8 kinds are not implemented.")
    block_size: int | None = setting(None, env="BLOCK_SIZE", ge=1,
                                     help="Tokens per KV cache block (default: 64 on CPU, 16 on CUDA).")
    kv_cache_bytes: int | None = setting(None, flag="--kv-cache-memory", env="KV_CACHE_MEMORY", ge=1,
                                         help="Bytes of KV cache per rank on CPU (default 512 MiB).")
    num_blocks: int | None = setting(None, env="NUM_BLOCKS", ge=1, help="Fix the KV block count.")
    cuda_memory_fraction: float = setting(1.0, env="CUDA_MEMORY_FRACTION", gt=0, le=1,
                                          help="Share of each GPU's memory llmbus may use (weights, activations, "
                                               "KV cache).")
    max_batch_prefill_tokens: int | None = setting(None, env="MAX_BATCH_PREFILL_TOKENS", ge=1,
                                                    help=PREFILL_TOKENS_HELP)
    cuda_graphs: str | None = setting(
        None, env="CUDA_GRAPHS", check=cuda_graphs_problem,
        help="Decode batch sizes captured as CUDA graphs at warmup, comma-separated (default "
             "1,2,4,8,16,32,64,128,256, those within --max-batch-prefill-tokens); a decode step replays the "
             "smallest size that holds it, padded. 0 disables them. CUDA with the triton attention backend.")
    piecewise_graphs: str | None = setting(
        None, env="LLMBUS_PIECEWISE_GRAPHS", check=piecewise_graphs_problem,
        help="Token counts for which the layers between attention calls are captured as CUDA graphs at warmup, "
             "comma-separated (default 16,32,64,128,256,512 within --max-batch-prefill-tokens, none with "
             "--cuda-graphs 0): a step the decode graphs cannot replay (a prompt chunk beside decodes) with at "
             "most the largest count replays them, padded, its attention run eagerly between them. 0 disables "
             "them. CUDA, Llama-shaped layers.")
    full_graphs: bool = setting(
        False, env="LLMBUS_FULL_GRAPHS", hidden=True,
        help="Capture each --piecewise-graphs bucket whole, its attention included (the triton backend), once "
             "the KV pool exists: a step with prompt rows then launches one graph, not one per layer and an "
             "attention kernel between each. An experiment until measured on a GPU.")
    onednn_cache_capacity: int = setting(
        64, env="LLMBUS_ONEDNN_CACHE_CAPACITY", ge=0,
        help="Entries in each of oneDNN's two caches of GEMMs built per input shape on CPU (about 300 KiB an "
             "entry; oneDNN's own default, 1024, let a worker grow by ~600 MiB as prompts and batches took new "
             "row counts). ONEDNN_PRIMITIVE_CACHE_CAPACITY or LRU_CACHE_CAPACITY, where set, win for their cache.")
    rope_scaling: str | None = setting(
        None, env="ROPE_SCALING", choices=ROPE_SCALINGS,
        help="RoPE scaling in place of the model's own, to serve longer prompts than it was trained on: linear "
             "(positions divided by --rope-factor) or dynamic (NTK: the base grows past the trained length). "
             "TGI's pairing: a kind alone scales by 1.0, --rope-factor alone is linear. The model then embeds "
             "its max_position_embeddings times the factor (the longest --max-total-tokens).")
    rope_factor: float | None = setting(None, env="ROPE_FACTOR", gt=0, le=10_000, help="The factor of --rope-scaling.")
    runner: str = setting("model", env="LLMBUS_RUNNER", choices=("model", "fake"), hidden=True,
                          help="fake: workers return tokens without computing (to measure the stack alone).")
    lora_adapters: str | None = setting(None, user=False,
                                        help="LoRA adapters to load, name=folder, comma-separated (--lora-adapters)")
    draft_model_dir: str | None = setting(None, user=False,
                                          help="a draft model's folder (--draft-model-id): rank 0 guesses with it")
    # `llmbus up` offers these among its own flags (supervisor/settings.py) and hands them over; hidden here,
    # as the ranks' plumbing, like --rank. TGI's variables still reach a group started by hand.
    trust_remote_code: bool = setting(False, env="TRUST_REMOTE_CODE", user=False, hidden=True,
                                      help="Let transformers run the model repository's own code (fallback models).")
    watermark_gamma: float | None = setting(None, env="WATERMARK_GAMMA", gt=0, lt=1, user=False, hidden=True,
                                            help="Share of the vocabulary in the watermark's green list (default 0.5).")
    watermark_delta: float | None = setting(None, env="WATERMARK_DELTA", user=False, hidden=True, check=finite,
                                            help="Bias added to green-list logits (default 2.0).")
    device_feed: str = setting(
        "auto", env="LLMBUS_DEVICE_FEED", choices=("auto", "off", "hold"), hidden=True,
        help="auto: a step sent ahead that arrives while the step before is still on the device is launched "
             "behind it, its SAMPLED_LAST tokens taken from that step's sampled ids on the device (CUDA). off: "
             "every step is answered before the next command is read. hold (tests): on the CPU too, each "
             "step's answer waits for the next command (up to HOLD_S), so that path runs without a GPU.")
    launch_depth: int = setting(
        1, env="LLMBUS_LAUNCH_DEPTH", ge=1, le=3, hidden=True,
        help="Steps a rank keeps launched and not yet answered once it has launched the next (auto and hold "
             "device feeds): 1 answers the step before as soon as the next is launched; 2 lets a step sent "
             "ahead queue behind two on the device, so a long launch (a prompt chunk's) hides behind both "
             "(the scheduler's --steps-ahead 2 sends that many). An experiment until measured on a GPU.")
    dist_init: str | None = None  # torch.distributed init_method; default: a file in the run dir


@dataclass(slots=True)
class _RequestState:
    sampling: m.SamplingParams
    block_table: list[int]
    prompt_len: int
    prompt_logprobs: bool
    cached_ids: list[int]  # NewRequestData.cached_ids: the prefix its first step found already computed
    grammar: m.Grammar | None = None
    adapter: str = ""
    images: list[m.ImageInput] = field(default_factory=list)
    last_sampled: int | None = None  # rank 0: the last token sampled for it, for a step's SAMPLED_LAST


class StepGap(RuntimeError):
    pass


def runner_request_state(runner) -> dict[str, int]:
    """How many per-request objects ``runner`` (a ModelRunner, its draft's included, or the fake runner)
    holds: token histories, pending prompt-logprob rows, grammar matchers, the draft's uncomputed guesses.
    Every one goes when its request is dropped, so once the requests a step listed as finished are dropped
    these are all 0: a count left above that is state a finished request left behind (issue #36's check)."""
    grammar = getattr(runner, "_grammar", None)
    draft = getattr(runner, "draft", None)
    counts = {"histories": len(getattr(runner, "histories", {})),
              "prompt_logprob_rows": len(getattr(runner, "pending_prompt_rows", {})),
              "grammar_matchers": len(grammar.requests) if grammar is not None else 0,
              "draft_guesses": len(draft.uncomputed) if draft is not None else 0,
              "encoded_images": len(getattr(runner, "images", None) or ())}
    if draft is not None:
        for name, n in runner_request_state(draft.runner).items():
            counts[name] += n
    return counts


def default_dist_init_file(run_dir: str) -> str:
    return os.path.join(run_dir, "dist-init")


class Worker:
    def __init__(self, cfg: WorkerConfig, ctx: ServiceContext):
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.states: dict[str, _RequestState] = {}
        self.last_step = 0
        self.last_failed = False  # the last step ran out of memory: a step sent ahead of it is skipped
        # The steps launched and not yet answered, oldest first: command, LaunchedStep, launch time (device_feed).
        self.in_flight: collections.deque[tuple] = collections.deque()
        self.last_launched = None  # the latest step launched, answered or not (what the next one may feed on)
        self.answered_at = 0.0  # perf_counter when the last result left (the turnaround's start)
        self.fed_on_device = False  # logged the first time a step is
        ep = Endpoints.in_dir(cfg.run_dir)
        z = ctx.zmq_ctx
        # Subscribe before saying hello: the scheduler counts subscriptions before its first step.
        self.steps = open_socket(z, zmq.SUB, ep.steps)
        self.control = open_socket(z, zmq.PUSH, ep.control, linger_ms=2000)
        self.results = open_socket(z, zmq.PUSH, ep.results, linger_ms=2000) if cfg.rank == 0 else None

    def start(self) -> None:
        # before any torch operation: the first oneDNN one reads the caches' capacities (CPU only; harmless on CUDA)
        onednn_caches = bound_onednn_caches(self.cfg.onednn_cache_capacity)
        with imports_frozen():  # they live as long as the process: no collection walks them (bus/gc_pauses.py)
            import torch

            from llmbus.workers.fake import FakeRunner
            from llmbus.workers.loader import MissingWeight
            from llmbus.workers.model_runner import ModelRunner, SeqInput

        send(self.control, m.WorkerHello(rank=self.cfg.rank, world_size=self.cfg.world_size, pid=os.getpid()))
        device = resolve_device(self.cfg.device, self.cfg.rank)
        dtype = resolve_dtype(self.cfg.dtype, device)
        kv_dtype = None if self.cfg.kv_cache_dtype == "auto" else resolve_dtype(self.cfg.kv_cache_dtype, device)
        # the smaller of the two bounds, for /metrics (llmbus_onednn_cache_capacity)
        self.onednn_cache_capacity = min(int(v) for v in onednn_caches.values()) if device.type == "cpu" else 0
        if device.type == "cpu" and self.cfg.rank == 0:
            self.log.info("oneDNN cache capacities", **onednn_caches)
        if self.cfg.dtype == "auto" and self.cfg.rank == 0:
            from llmbus.workers.quant import auto_cpu_dtype

            why = (auto_cpu_dtype()[1] if device.type == "cpu"
                   else {torch.bfloat16: "the GPU supports bf16", torch.float16: "the GPU lacks bf16"}.get(dtype, ""))
            self.log.info("dtype auto", dtype=str(dtype).removeprefix("torch."), device=str(device), reason=why)
        if self.cfg.runner == "model":
            from llmbus.workers.attention import attention_backend_class

            # before the weights load: a backend that cannot run here fails the start in a second, with why
            attention_backend_class(self.cfg.attention_backend, device)
        if device.type == "cuda":
            cuda_float32_math(self.cfg.allow_tf32)
        cpu_said = {}
        if device.type == "cpu":
            budget = cpu_budget()
            torch.set_num_threads(cpu_threads(self.cfg.world_size, budget))
            cpu_said = {"threads": torch.get_num_threads(), "cpu": budget.describe()}
            if not keep_freed_memory():
                self.log.info("freed memory is returned to the system (no glibc mallopt): steps page-fault")
        if self.cfg.world_size > 1:
            import torch.distributed as dist

            init = self.cfg.dist_init or f"file://{default_dist_init_file(self.cfg.run_dir)}"
            backend = process_group_backend(device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, init_method=init, rank=self.cfg.rank, world_size=self.cfg.world_size)
        self._seq_input = SeqInput  # torch-importing module: loaded here, not at import of this one

        t0 = time.monotonic()
        runner_cls = FakeRunner if self.cfg.runner == "fake" else ModelRunner
        try:
            self.runner = runner_cls(self.cfg.model_dir, rank=self.cfg.rank, world_size=self.cfg.world_size,
                                      dtype=dtype, device=device,
                                      block_size=self.cfg.block_size or default_block_size(device.type),
                                      kv_cache_bytes=self.cfg.kv_cache_bytes, num_blocks=self.cfg.num_blocks,
                                      max_batch_prefill_tokens=(self.cfg.max_batch_prefill_tokens
                                                                or DEFAULT_MAX_BATCH_PREFILL_TOKENS),
                                      cuda_memory_fraction=self.cfg.cuda_memory_fraction, quantize=self.cfg.quantize,
                                      kv_cache_dtype=kv_dtype, trust_remote_code=self.cfg.trust_remote_code,
                                      watermark_gamma=self.cfg.watermark_gamma,
                                      watermark_delta=self.cfg.watermark_delta, **self._model_arguments())
        except ServiceError:
            raise  # one line already, under its own name (LoraError)
        except (ValueError, MissingWeight) as e:
            # the model's refusals say why in one line (a RoPE type, an activation, heads the ranks do not
            # divide, a tensor the checkpoint lacks, a KV budget); a traceback would only bury it
            self.log.debug("model refused", exc_info=True)
            raise ServiceError(f"cannot serve {self.cfg.model_dir}: {e}") from None
        load_s = time.monotonic() - t0
        wants_draft = bool(self.cfg.draft_model_dir) and self.cfg.rank == 0 and runner_cls is ModelRunner
        draft = None
        if wants_draft and self.runner.kv_cache is None:
            # The target's warmup sizes its pool from free memory (CUDA): the draft's weights load first, and
            # the draft's pool gets its share of what is left before the target's takes the rest. The draft's
            # steps run before the target's, so the target's measured activation peak covers them.
            draft = self._draft_runner(dtype, device, num_blocks=None)
            self.runner.attach_draft(draft)
        warmup_started = time.monotonic()
        warmup_tokens = self.runner.warmup()
        warmup_step_s = time.monotonic() - warmup_started
        if wants_draft:
            if draft is None:
                draft = self._draft_runner(dtype, device, num_blocks=self.runner.num_blocks)
                self.runner.attach_draft(draft)
            draft.warmup()
            self.log.info("draft model loaded", model=self.cfg.draft_model_dir)
        if device.type == "cpu" and runner_cls is ModelRunner:  # the fake runner has no weights to move
            self._heap_on_huge_pages()
        paths = getattr(self.runner, "compute_paths", {})  # the attention backend's name, for the log and /info
        warmup_s = time.monotonic() - t0 - load_s
        # what start built lives as long as the process: out of the collector's sight (bus/gc_pauses.py)
        frozen = freeze_startup_heap()
        self.log.info("model loaded", model=self.cfg.model_dir, dtype=str(dtype).removeprefix("torch."),
                      device=str(device), load_s=round(load_s, 2), warmup_s=round(warmup_s, 2),
                      kv_blocks=self.runner.num_blocks,
                      kv_cache_dtype=str(getattr(self.runner, "kv_cache_dtype", dtype)).removeprefix("torch."),
                      frozen_objects=frozen, **cpu_said, **paths)
        send(self.control, m.WorkerReady(rank=self.cfg.rank, num_blocks=self.runner.num_blocks,
                                         block_size=self.runner.block_size,
                                         dtype=str(dtype).removeprefix("torch."), device=str(device),
                                         max_position_embeddings=self.runner.max_position_embeddings,
                                         warmup_step_s=warmup_step_s, warmup_step_tokens=warmup_tokens,
                                         vocab_size=self.runner.vocab_size,
                                         attention_backend=paths.get("attention", ""),
                                         onednn_cache_capacity=self.onednn_cache_capacity,
                                         lora_adapters=list(getattr(self.runner, "lora_names", [])),
                                         rope_split_tokens=getattr(self.runner, "rope_split_tokens", 0),
                                         rope_split_by_length=getattr(self.runner, "rope_split_by_length", False),
                                         images=getattr(self.runner, "image_layout", "")))

    def _heap_on_huge_pages(self) -> None:
        """The loaded weights onto 2 MB pages (host_memory.heap_on_huge_pages), logged with what it gave."""
        from llmbus.bus.procfs import anon_huge_pages_bytes

        before, started = anon_huge_pages_bytes(os.getpid()), time.monotonic()
        pool = getattr(self.runner, "kv_cache", None)
        span = heap_on_huge_pages(MIN_HUGE_HEAP_BYTES, besides=pool.nbytes if pool is not None else 0)
        if span is None:
            self.log.info("heap left on the pages it has: no transparent huge pages here, or under "
                          f"{MIN_HUGE_HEAP_BYTES >> 20} MB of it besides the KV pool")
            return
        after = anon_huge_pages_bytes(os.getpid())
        self.log.info("heap on 2 MB pages", span_mb=span >> 20, seconds=round(time.monotonic() - started, 2),
                      **({"huge_mb_before": before >> 20, "huge_mb_after": after >> 20}
                         if before is not None and after is not None else {}))

    def _draft_runner(self, dtype, device, num_blocks: int | None):
        """The draft model's runner (--draft-model-id), with its own pool of the target's block size and
        ``num_blocks`` (None: allocated by the target's warmup): the same block tables address both."""
        from llmbus.workers.model_runner import ModelRunner

        return ModelRunner(self.cfg.draft_model_dir, rank=0, world_size=1, dtype=dtype, device=device,
                           block_size=self.runner.block_size, num_blocks=num_blocks,
                           max_batch_prefill_tokens=(self.cfg.max_batch_prefill_tokens
                                                     or DEFAULT_MAX_BATCH_PREFILL_TOKENS),
                           trust_remote_code=self.cfg.trust_remote_code,
                           watermark_gamma=self.cfg.watermark_gamma, watermark_delta=self.cfg.watermark_delta,
                           attention_backend=self.cfg.attention_backend)

    def _model_arguments(self) -> dict:
        """The runner's attention, graph and LoRA arguments: the fake runner computes nothing."""
        if self.cfg.runner != "model":
            return {}
        graphs = parse_cuda_graphs(self.cfg.cuda_graphs)
        return {"attention_backend": self.cfg.attention_backend, "cuda_graphs": graphs,
                "piecewise_graphs": parse_piecewise_graphs(self.cfg.piecewise_graphs, graphs),
                "full_graphs": self.cfg.full_graphs, "lora_adapters": tuple(lora_entries(self.cfg.lora_adapters)),
                "rope_scaling": rope_override(self.cfg.rope_scaling, self.cfg.rope_factor)}

    def loop(self) -> None:
        while True:
            msg = self._next_message()
            if msg is None:  # the oldest step launched is done before the next command came: answer it now
                self._answer_oldest()
                continue
            if isinstance(msg, m.Shutdown):
                self._answer_all()
                self.log.info("shutdown", reason=msg.reason)
                return
            if isinstance(msg, m.HealthProbe):
                send(self.control, m.HealthAck(rank=self.cfg.rank, probe_id=msg.probe_id))
                continue
            if not isinstance(msg, m.StepCommand):
                continue
            received = time.perf_counter()
            turnaround_s = received - self.answered_at  # from the last result sent to this command
            # A rank started to replace a lost group joins at whatever step the scheduler is at.
            if self.last_step and msg.step_id != self.last_step + 1:
                raise StepGap(f"rank {self.cfg.rank} got step {msg.step_id} after step {self.last_step}")
            self.last_step = msg.step_id
            seqs = self.apply(msg)
            applied_s = time.perf_counter() - received
            fed = [i for i, seq in enumerate(seqs) if m.SAMPLED_LAST in seq.token_ids]
            feed = self._device_feed(seqs, fed) if fed else None
            if feed is None:
                self._answer_all()  # their tokens are what SAMPLED_LAST takes here
                for i in fed:
                    seqs[i].token_ids = self._fed_forward(msg, self.states[seqs[i].rid], seqs[i].token_ids)
            # (a step that failed was the newest launched, and it cannot feed: answered just above.) A group
            # computes it all the same on placeholder tokens, every rank alike, since only rank 0 knows the step
            # before failed; the scheduler drops its result.
            if msg.ahead and self.last_failed and self.cfg.world_size == 1:
                self._answer_all()  # (none is left: results go out in step order all the same)
                self._send_result(msg.step_id, self._skipped(msg))
                continue
            launched = self.runner.launch(seqs, feed)
            launch_s = time.perf_counter() - received
            self.in_flight.append((msg, launched, time.monotonic()))
            self.last_launched = launched
            waited_s = 0.0
            while len(self.in_flight) > self.cfg.launch_depth:
                waited_s += self._answer_oldest()
            timeline = getattr(self.runner, "timeline", None)
            if timeline is not None:
                timeline.add_host(launch_s, waited_s, turnaround_s, apply_s=applied_s,
                                  replayed=self.runner.replayed_last)
            while self.in_flight and (self.cfg.device_feed == "off" or self._oldest_ready()):
                self._answer_oldest()

    def _next_message(self):
        """The next message from the scheduler; None if the oldest step launched and not yet answered is done
        first (its answer must not wait for a command that may only come after it)."""
        if not self.in_flight:
            return recv(self.steps)
        # ZeroMQ's descriptor signals a change, not a message: EVENTS says whether one is queued. A sleep here
        # made a command that came during it wait out the rest (about 55 us a step on average, of a served
        # step's turnaround on the GPU's host).
        descriptor = self.steps.getsockopt(zmq.FD)
        while not self.steps.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if self._oldest_ready():
                return None
            select.select([descriptor], [], [], LAUNCHED_POLL_S)
        return recv(self.steps)

    def _oldest_ready(self) -> bool:
        _, launched, at = self.in_flight[0]
        if self.cfg.device_feed == "hold":
            return time.monotonic() - at >= HOLD_S
        return launched.ready()

    def _device_feed(self, seqs: list, fed: list[int]):
        """How the step's ``SAMPLED_LAST`` rows (``fed``: their indices) take their tokens from the launched
        step on the device; None where the host must know them first: nothing launched, or a row whose
        token the host reads in the step (its grammar, watermark, a draft model; penalties count on the
        device)."""
        if self.cfg.rank != 0:  # it samples nothing: it feeds what rank 0 broadcast in the step before
            launched = self.last_launched
        elif not self.in_flight or self.cfg.device_feed == "off" or getattr(self.runner, "draft", None):
            return None
        else:
            launched = self.in_flight[-1][1]
        starts = list(itertools.accumulate((len(seq.token_ids) for seq in seqs), initial=0))
        rows, rids = [], []
        for i in fed:
            seq = seqs[i]
            if self.cfg.rank == 0 and (seq.grammar is not None or seq.sampling.watermark or seq.num_spec):
                return None
            for j, token in enumerate(seq.token_ids):
                if token == m.SAMPLED_LAST:
                    rows.append(starts[i] + j)
                    rids.append(seq.rid)
        if launched is None or not launched.can_feed(rids):
            return None
        if not self.fed_on_device:
            self.fed_on_device = True
            self.log.info("a step sent ahead launched behind the one before, its tokens fed on the device",
                          step=self.last_step, rows=len(rows))
        return launched.feed(rows, rids)

    def _answer_oldest(self) -> float:
        """Rank 0 sends the oldest launched step's result (waiting for its tokens); every rank then forgets it.
        Returns the seconds it waited for them."""
        if not self.in_flight:
            return 0.0
        cmd, launched, _ = self.in_flight.popleft()
        started = time.perf_counter()
        out = launched.result()
        waited_s = time.perf_counter() - started
        self._note_sampled(cmd, out)
        self._send_result(cmd.step_id, out)
        self.answered_at = time.perf_counter()
        return waited_s

    def _answer_all(self) -> None:
        """Answer every launched step, oldest first: the host then knows each request's last token."""
        while self.in_flight:
            self._answer_oldest()

    def _send_result(self, step_id: int, out) -> None:
        if self.results is not None:
            send(self.results, m.StepResult(step_id=step_id, rids=out.rids, token_ids=out.token_ids,
                                            logprobs=out.logprobs, forward_time=out.forward_time,
                                            sample_time=out.sample_time, prompt_logprobs=out.prompt_logprobs,
                                            top_tokens=out.top_tokens, errors=out.errors,
                                            num_tokens=out.num_tokens, failed_error=out.failed,
                                            request_state=sum(self.request_state().values())))

    def _skipped(self, cmd: m.StepCommand):
        """What a step sent ahead of a failed one answers: it was built on tokens that step never sampled. So
        was a step sent ahead of this one (--steps-ahead 2): ``last_failed`` stays until a step runs."""
        from llmbus.workers.model_runner import StepOutput

        why = f"step {cmd.step_id} skipped: it was sent ahead of a step that failed"
        return StepOutput([], [], [], 0.0, 0.0, failed=why) if self.cfg.rank == 0 else None

    def _note_sampled(self, cmd: m.StepCommand, out) -> None:
        """Rank 0 keeps each request's last sampled token (for SAMPLED_LAST in the next step) and whether the
        step failed; the other ranks have no tokens on the host (they feed on rank 0's broadcast ids)."""
        if out is None:
            return
        self.last_failed = bool(out.failed)
        if out.failed:
            for rid in cmd.rids:
                if rid in self.states:
                    self.states[rid].last_sampled = None
            return
        counts = out.num_tokens or [1] * len(out.rids)
        end = 0
        for rid, n in zip(out.rids, counts):
            end += n
            state = self.states.get(rid)
            if state is not None:
                state.last_sampled = out.token_ids[end - 1]

    def request_state(self) -> dict[str, int]:
        """This rank's per-request objects by kind (``runner_request_state``, and the requests' own states)."""
        return {"requests": len(self.states), **runner_request_state(self.runner)}

    def apply(self, cmd: m.StepCommand) -> list:
        SeqInput = self._seq_input
        if cmd.finished_rids:
            for rid in cmd.finished_rids:
                self.states.pop(rid, None)
            self.runner.drop(cmd.finished_rids)
        # A preempted request comes back as a new one under the same rid, normally after a step listed it
        # as finished; should it come back without that, its old state goes all the same.
        restarted = [new.rid for new in cmd.new_requests if new.rid in self.states]
        if restarted:
            self.runner.drop(restarted)
        for new in cmd.new_requests:
            self.states[new.rid] = _RequestState(new.sampling, list(new.block_table), new.prompt_len,
                                                   new.prompt_logprobs, new.cached_ids, new.grammar, new.adapter,
                                                   new.images)
        for rid, blocks in cmd.added_blocks:
            self.states[rid].block_table.extend(blocks)
        seqs, offset = [], 0
        num_spec = cmd.num_spec or [0] * len(cmd.rids)
        for rid, num_computed, num_new, sample, spec in zip(cmd.rids, cmd.num_computed, cmd.num_new, cmd.sample,
                                                             num_spec):
            state = self.states[rid]
            token_ids = cmd.token_ids[offset:offset + num_new]  # SAMPLED_LAST is resolved by the loop
            seqs.append(SeqInput(rid=rid, token_ids=token_ids,
                                 num_computed=num_computed, block_table=state.block_table, sample=sample,
                                 sampling=state.sampling, prompt_len=state.prompt_len,
                                 prompt_logprobs=state.prompt_logprobs, cached_ids=state.cached_ids,
                                 grammar=state.grammar, num_spec=spec, adapter=state.adapter,
                                 images=state.images))
            offset += num_new
        return seqs

    def _fed_forward(self, cmd: m.StepCommand, state: _RequestState, token_ids: list[int]) -> list[int]:
        """A request's tokens with SAMPLED_LAST replaced by the token this rank sampled for it last."""
        if self.cfg.rank != 0 or not cmd.ahead:
            raise ValueError(f"step {cmd.step_id}: SAMPLED_LAST reached rank {self.cfg.rank} in a step "
                             f"{'sent ahead' if cmd.ahead else 'not sent ahead'}")
        if state.last_sampled is None:
            if self.last_failed:
                return [0 if t == m.SAMPLED_LAST else t for t in token_ids]  # the step is skipped
            raise ValueError(f"step {cmd.step_id}: SAMPLED_LAST for a request that sampled nothing yet")
        return [state.last_sampled if t == m.SAMPLED_LAST else t for t in token_ids]

    def report_fatal(self, error: str) -> None:
        try:
            send(self.control, m.WorkerFatal(rank=self.cfg.rank, error=error), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def run_worker(cfg: WorkerConfig) -> int:
    def body(ctx: ServiceContext) -> None:
        def on_signal(signum: int) -> None:
            raise Terminate()

        install_stop_signals(on_signal)
        worker = Worker(cfg, ctx)
        try:
            worker.start()
            worker.loop()
        except Terminate:
            raise
        except Exception as e:
            worker.report_fatal(f"{type(e).__name__}: {e}")
            raise
        finally:
            ignore_stop_signals()  # before this frame ends and garbage-collects the worker's sockets

    return run_service("worker", body, rank=cfg.rank)
