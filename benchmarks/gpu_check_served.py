"""Part 3 of benchmarks/gpu_check.py, served (``ServedPart``, a base of its ``Check``), and the random Llama
folder it serves, which part 6 serves too (``random_llama_dir``).

Not a benchmark itself: gpu_check.py runs it (its docstring says what each part checks).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from _random_llama import random_weights
from _server import client_session, exact_token_prompt, load_tokenizer, metrics, stream_tokens
from stack_overhead import roles, summarize_profile, summarize_under
from vs_llama_server import kv_bytes_for

from llmbus.testing import Server
from llmbus.frontend.token_pieces import byte_to_unicode
from llmbus.workers.step_clock import TIMELINE_WINDOW_S

SERVED_RESTART_METRIC = "llmbus_worker_restarts_total"
# A served wave or start that takes longer is a failure, not a wait: the whole check must fit 8 minutes.
WAVE_TIMEOUT_S = 120
READY_TIMEOUT_S = 180
# How long part 3 keeps the throughput wave's concurrency up to read the device's idle time: two of rank 0's
# timeline windows and the one it starts in.
SUSTAINED_S = 3 * TIMELINE_WINDOW_S
DRY_KV_TOKENS = 4096  # a dry run's pool: its longest prompt, or its burst, many times over


def random_llama_dir(out: Path, shape: dict, device: torch.device, dtype: torch.dtype) -> Path:
    """A Llama folder at ``out`` of ``shape`` (config.json's fields; untied embeddings unless it says so):
    N(0, 0.02) weights made on ``device`` and saved in ``dtype``, and a byte-level BPE of exactly its vocabulary
    (every byte pair, then pair + byte merges)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llmbus.supervisor.demo_model import SPECIAL_TOKENS, _special_tokens_map, _tokenizer_config

    out.mkdir()
    chars = list(byte_to_unicode().values())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)
    merges = []
    # Pairs that start with the space mark first: " a" is one token in any vocabulary, which
    # exact_token_prompt relies on to add one token at a time.
    space = byte_to_unicode()[ord(" ")]
    pairs = sorted(((a, b) for a in chars for b in chars), key=lambda pair: pair[0] != space)
    triples = ((a + b, c) for a, b in pairs for c in chars)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= shape["vocab_size"]:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(shape["max_position_embeddings"])))
    (out / "special_tokens_map.json").write_text(json.dumps(_special_tokens_map()))
    config = {"tie_word_embeddings": False, **shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "dtype": str(dtype).removeprefix("torch."), "bos_token_id": 0, "eos_token_id": 1,
              "pad_token_id": 2}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tied = config["tie_word_embeddings"]  # one matrix, saved as the embedding (as a tied checkpoint is)
    state = {name: t.cpu() for name, t in random_weights(config, device, dtype, 0.02).items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class ServedPart:
    """Part 3, ``served``: a base class of gpu_check's ``Check``, whose ``sizes``, ``device``, ``dry``, ``args``,
    ``work``, ``row`` and ``free`` it uses."""

    def served(self) -> None:
        t0 = time.perf_counter()
        sizes = self.sizes
        model_dir = random_llama_dir(self.work / "served",
                                     dict(sizes.served_shape, num_hidden_layers=sizes.served_layers),
                                     self.device, torch.bfloat16)
        self.free()  # the weights were made on the device: their memory goes back before the server starts
        built_s = time.perf_counter() - t0
        longest = sizes.long_prompt + 16
        args = ["--model-id", str(model_dir), "--max-input-tokens", str(sizes.long_prompt + 1),
                "--max-total-tokens", str(longest), "--max-restarts", "0"]
        args += ["--device", self.device.type]
        if self.args.attention_backend:
            args += ["--attention-backend", self.args.attention_backend]
        if getattr(self.args, "steps_ahead", None):
            args += ["--steps-ahead", str(self.args.steps_ahead)]
        if getattr(self.args, "launch_depth", None):
            args += ["--launch-depth", str(self.args.launch_depth)]
        if getattr(self.args, "piecewise_graphs", None):
            args += ["--piecewise-graphs", self.args.piecewise_graphs]
        if getattr(self.args, "full_graphs", False):
            args += ["--full-graphs"]
        if self.dry:
            # and a KV pool of what the tiny waves need: the CPU default, 512 MiB, is zeroed at the start
            args += ["--dtype", "float32", "--kv-cache-memory", str(kv_bytes_for(model_dir, DRY_KV_TOKENS, "float32"))]
        peak = _DevicePeak(self.device)
        with peak, Server(args, ready_timeout=READY_TIMEOUT_S) as server:
            started_s = time.perf_counter() - t0
            info = get_json(f"{server.url}/info")
            tokenizer = load_tokenizer(str(model_dir))
            stages = {}

            async def wave(n: int, prompt_tokens: int, new: int, tag: str) -> dict:
                prompts = [exact_token_prompt(tokenizer, prompt_tokens, f"{tag}{i}") if prompt_tokens else
                           f"stream {i} says" for i in range(n)]
                params = {"max_new_tokens": new, "ignore_eos_token": True, "do_sample": False, "details": True}
                w0 = time.perf_counter()
                async with client_session() as session:
                    try:
                        streams = await asyncio.wait_for(asyncio.gather(
                            *(stream_tokens(session, server.url, p, params) for p in prompts)), WAVE_TIMEOUT_S)
                    except asyncio.TimeoutError:
                        streams = []
                answered = sum(1 for s in streams if s.error is None and len(s.times) == new)
                errors = sorted({s.error for s in streams if s.error})[:3]
                if not streams:
                    errors = [f"not all answered within {WAVE_TIMEOUT_S} s"]
                return dict(requests=n, answered=answered, prompt_tokens=prompt_tokens, new_tokens=new,
                            seconds=round(time.perf_counter() - w0, 2), errors=errors)

            stages["streams"] = asyncio.run(wave(sizes.streams, 0, sizes.stream_tokens, "s"))
            stages["long_prompt"] = asyncio.run(wave(1, sizes.long_prompt, 8, "long"))
            stages["burst"] = asyncio.run(wave(sizes.burst, sizes.burst_prompt, 8, "b"))
            concurrent, prompt_tokens, new_tokens = sizes.throughput
            asyncio.run(wave(concurrent, prompt_tokens, new_tokens, "w"))  # warms what the timed wave runs
            stages["throughput"] = asyncio.run(wave(concurrent, prompt_tokens, new_tokens, "t"))

            async def sustained(seconds: float) -> dict:
                """``concurrent`` clients, each sending its next request as soon as its last one ends."""
                params = {"max_new_tokens": new_tokens, "ignore_eos_token": True, "do_sample": False}
                deadline = time.perf_counter() + seconds
                done = []

                async def client(session, i: int) -> None:
                    k = 0
                    while time.perf_counter() < deadline:
                        prompt = exact_token_prompt(tokenizer, prompt_tokens, f"c{i}.{k}")
                        done.append(await stream_tokens(session, server.url, prompt, params))
                        k += 1
                async with client_session() as session:
                    await asyncio.gather(*(client(session, i) for i in range(concurrent)))
                return dict(requests=len(done), answered=sum(1 for s in done if s.error is None),
                            seconds=round(seconds, 1))
            timeline_before = len(server.log_lines("device timeline"))
            spies = self._start_host_profiles(server, SUSTAINED_S)
            stages["sustained"] = asyncio.run(sustained(SUSTAINED_S if not self.dry else 0.5))
            timeline = server.log_lines("device timeline")[timeline_before:]
            host_profiles = self._host_profiles(spies)
            restarts = metrics(server.url).get(SERVED_RESTART_METRIC)
            restarts = None if restarts is None else int(restarts)
            memory_lines = server.log_lines("memory", "activation", "kv cache", "blocks")[-6:]
        ok = all(s["answered"] == s["requests"] for s in stages.values()) and restarts == 0
        backend = {k: v for k, v in info.items() if any(w in k for w in ("attention", "device", "dtype"))}
        answered = ", ".join(f"{k} {s['answered']}/{s['requests']}" for k, s in stages.items())
        self.row("3 served", "llmbus up", ok,
                 f"answered {answered}; "
                 f"restarts {restarts}; device peak {_gib(peak.peak_bytes)} GiB over "
                 f"{_gib(peak.baseline_bytes)} GiB in use before",
                 backend=backend.get("attention_backend", backend), info=backend, command=server.command_line,
                 stages=stages, restarts=restarts, device_peak_bytes=peak.peak_bytes,
                 device_baseline_bytes=peak.baseline_bytes, memory_log=memory_lines,
                 model_build_seconds=round(built_s, 1), ready_seconds=round(started_s - built_s, 1),
                 seconds=round(time.perf_counter() - t0, 1))
        self._device_idle(timeline, stages["sustained"], host_profiles)
        self._against_transformers(model_dir, tokenizer, stages["throughput"])

    def _start_host_profiles(self, server: Server, seconds: float) -> list:
        """Where py-spy is installed (device_wheels.py carries it) and the device is a GPU: py-spy samples the
        scheduler and rank 0 through the sustained wave, without stopping them, so the row can say where a
        step's host time goes."""
        found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if found is None or self.device.type != "cuda":
            return []
        pids = roles(server)
        spies = []
        for role in ("scheduler", "workers"):
            if role in pids:
                out = self.args.out.parent / f"pyspy_{role}.txt"
                spies.append((role, out, subprocess.Popen(
                    [found, "record", "--pid", str(pids[role]), "--format", "raw", "--rate", "250", "--duration",
                     str(int(seconds) - 1), "--nonblocking", "--output", str(out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        return spies

    @staticmethod
    def _host_profiles(spies: list) -> dict[str, str]:
        profiles = {}
        for role, out, spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
            if not out.exists():
                profiles[role] = f"py-spy wrote nothing: {spy.stderr.read().decode()[-300:]}"
                continue
            profiles[role] = summarize_profile(out, top=16)
            if role == "workers":  # what a step that is not a replayed decode graph spends its launch on
                profiles["workers eager forward"] = (
                    summarize_under(out, "ModelRunner._forward", "DecodeGraphs.forward") + "\n"
                    + summarize_under(out, "PiecewiseGraphs.forward", depth=2))
        return profiles

    def _device_idle(self, lines: list[str], sustained: dict, host_profiles: dict[str, str]) -> None:
        """Issue #39's GPU idle between decode steps at c=64: rank 0's "device timeline" windows logged
        while ``concurrent`` clients kept the server full, those whose steps averaged at least half that many
        rows (a window that began before the load is left out)."""
        concurrent = self.sizes.throughput[0]
        windows = [{k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line)} for line in lines]
        loaded = [w for w in windows if w.get("mean_rows", 0) >= concurrent / 2]
        busy = sum(w["busy_ms"] for w in loaded)
        idle = sum(w["idle_ms"] for w in loaded)
        share = idle / (busy + idle) if busy + idle else None
        said = f"{share:.1%} of the device's time idle between steps" if share is not None else "no window logged"
        steps = sum(w["steps"] for w in loaded)
        if loaded and "turnaround_ms" in loaded[0]:  # what the gap is made of: the host's side of a step
            mean = {k: sum(w[k] * w["steps"] for w in loaded) / steps
                    for k in ("step_busy_ms", "host_launch_ms", "host_wait_ms", "turnaround_ms")}
            said += (f"; per step: device {mean['step_busy_ms']:.2f} ms, host launch {mean['host_launch_ms']:.2f} "
                     f"ms, result wait {mean['host_wait_ms']:.2f} ms, turnaround (bus + scheduler) "
                     f"{mean['turnaround_ms']:.2f} ms")
            if "host_apply_ms" in loaded[0]:
                eager_steps = sum(w["eager_steps"] for w in loaded)
                eager_launch = sum(w["eager_launch_ms"] * w["eager_steps"] for w in loaded) / max(eager_steps, 1)
                apply_ms = sum(w["host_apply_ms"] * w["steps"] for w in loaded) / steps
                said += (f" (of the launch, the command's apply {apply_ms:.2f} ms; an eager step's launch "
                         f"{eager_launch:.2f} ms)")
        if loaded and "eager_steps" in loaded[0] and idle:  # which steps the device waited for
            eager = sum(w["eager_steps"] for w in loaded) / steps
            said += (f"; {sum(w['eager_idle_ms'] for w in loaded) / idle:.0%} of the idle before the {eager:.0%} "
                     f"of steps launched eagerly")
        if loaded and "gc_ms" in loaded[0]:  # rank 0's garbage collections, a pause the device may wait through
            said += (f"; rank 0's garbage collection {sum(w['gc_ms'] for w in loaded):.1f} ms "
                     f"({int(sum(w['gc_full'] for w in loaded))} full, the longest "
                     f"{max(w['gc_longest_ms'] for w in loaded):.1f} ms)")
        self.row("3 served", f"c={concurrent} device idle", self.device.type != "cuda" or share is not None,
                 f"{said} ({len(loaded)} windows of {len(windows)}, {sustained['answered']} requests)",
                 device=str(self.device), idle_share=share, windows=windows, sustained=sustained,
                 host_profiles=host_profiles,
                 served_with={k: getattr(self.args, k, None) for k in ("steps_ahead", "launch_depth", "full_graphs",
                                                                          "piecewise_graphs")})

    def _against_transformers(self, model_dir: Path, tokenizer, served: dict) -> None:
        """The throughput wave's prompts through transformers' own continuous batching (``generate_batch``,
        paged attention, its CUDA graphs where it takes them), on the same card after the server stopped:
        generated tokens per second, both sides timed from the first request to the last token."""
        import transformers
        from transformers.generation import ContinuousBatchingConfig, GenerationConfig

        concurrent, prompt_tokens, new_tokens = self.sizes.throughput
        inputs = [tokenizer.encode(exact_token_prompt(tokenizer, prompt_tokens, f"t{i}")).ids
                  for i in range(concurrent)]
        dtype = torch.float32 if self.dry else torch.bfloat16
        for attention in ("paged|sdpa", "sdpa_paged"):  # the name of transformers >= 5.2x, then the older one
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(model_dir), attn_implementation=attention, dtype=dtype, device_map=str(self.device)).eval()
                break
            except ValueError:
                if attention == "sdpa_paged":
                    raise
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
        # A dry run sizes transformers' KV pool to its tiny wave: by default the pool takes a share of the
        # memory, gigabytes zeroed on a CPU host (11 s of CI's time against half a second).
        pool = {"num_blocks": 64, "max_batch_tokens": 256} if self.dry else {}
        batching = ContinuousBatchingConfig(use_cuda_graph=self.device.type == "cuda", **pool)

        def run(model) -> tuple[int, float]:
            t0 = time.perf_counter()
            outputs = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching,
                                           progress_bar=False)
            return sum(len(o.generated_tokens) for o in outputs.values()), time.perf_counter() - t0
        if not self.dry:
            run(model)  # its warmup and graph capture, then the timed run
        generated, seconds = run(model)
        del model
        self.free()
        ours = served["answered"] * new_tokens / served["seconds"] if served["seconds"] else 0.0
        theirs = generated / seconds
        ratio = ours / theirs if theirs else 0.0
        self.row("3 served", f"c={concurrent} vs transformers", served["answered"] == concurrent,
                 f"llmbus {ours:.0f} tokens/s, transformers generate_batch {theirs:.0f} tokens/s: {ratio:.2f}x "
                 f"({prompt_tokens}+{new_tokens} tokens, {concurrent} at once)",
                 backend=f"{attention} (transformers)", device=str(self.device), llmbus_tokens_per_s=ours,
                 transformers_tokens_per_s=theirs, ratio=ratio, transformers_generated=generated,
                 transformers_seconds=seconds, transformers=transformers.__version__)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


class _DevicePeak:
    """The device's used memory (all processes: the server's ranks) sampled every 50 ms while the block
    runs, and what was in use when it started; None on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.baseline_bytes, self.peak_bytes = device, None, None
        self._stop = threading.Event()

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_bytes = max(self.peak_bytes, self._used())

    def __enter__(self):
        if self.device.type == "cuda":
            self.baseline_bytes = self.peak_bytes = self._used()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.device.type == "cuda":
            self._thread.join()
