"""The device check of issue #34: is llmbus on one CUDA GPU correct, memory-safe and how fast, in one command.

    python benchmarks/gpu_check.py --out report.json [--attention-backend NAME] [--parts 1,2,3,4,5,6]
    python benchmarks/gpu_check.py --dry-run --out report.json      # CPU, tiny shapes, seconds (CI)

Sized for a lent H100 (at most 8 minutes with its setup; benchmarks/README.md has the `run` command and
benchmarks/device_wheels.py the wheels it carries). Six parts, each a method of ``Check`` that records rows
(parts 3 and 6 in gpu_check_served.py and gpu_check_cpu.py beside this file, LoRA's rows of parts 1 and 4 in
gpu_check_lora.py, the step drivers in _runner_steps.py); a part that raises records its
error and the others still run; the JSON report is rewritten after every row, so a run stopped at its time limit
keeps what it measured. Every row names the attention backend it ran on.

1. float32, TF32 off: greedy tokens equal transformers' on the same device, for a mixed continuous batch
   (``llmbus.testing.runner_driver.drive``: arrivals mid-way, a chunked prompt beside decodes, a prefix-cache
   hit on a running request's blocks, a preemption resumed from one cached block) on a 4-layer GQA Llama with
   llama3 RoPE, a Mistral with a window shorter than the sequences, a Qwen2 (q/k/v biases), a Qwen3 (QK-norm),
   a Mixtral (routed experts), a Gemma 2 (soft-capped scores) and a gpt-oss (sinks). Each runs with the decode
   CUDA graphs and again eagerly ("... eager").
   Then the Llama with two LoRA adapters (every projection; queries and values), three of the batch's six
   sequences on them: every sequence's tokens equal PEFT's (CPU, float32) with its adapter or transformers'.
2. bfloat16 teacher-forced on part 1's float32 tokens (prompt rows, then one decode row per sequence per step):
   llmbus's logit error against transformers float32 is at most ``BF16_SLACK`` times transformers' own bf16 error.
3. served: ``llmbus up`` on a model of Llama-3.1-8B's width with 4 layers (random weights, a byte-level BPE
   tokenizer of its vocabulary built here): 16 concurrent streams, then one 32k-token prompt, then 64 concurrent
   2k-token prompts; all answered, no restart (/metrics), the device's peak memory while serving. Then issue
   #39's c=64 128+128 wave: its tokens/s, the device's idle share between steps while 64 clients keep it full,
   and the same wave through transformers' continuous batching.
4. speed baseline: decode step time at batch 1/16/64 x context 512/2048 on a Llama-3.1-8B-shaped model with
   random weights made on the device (``ModelRunner`` directly), beside the floor that the measured
   device-to-device copy bandwidth gives for its bytes (weights plus the KV read). Each shape one step at a
   time (the host's turnaround counted), then "pipelined": chained as the worker runs the steps the scheduler
   sends ahead, each launched behind the one before with its tokens fed on the device. Then a step of the
   largest batch at the shortest context with a 128-token prompt chunk among its rows (what an arrival makes
   at c=64), with the piecewise graphs (llmbus's default, or ``--piecewise-graphs``) and eagerly. Then at the
   shortest context, batch 1 and the largest, the step with a rank-16 LoRA adapter on every projection, on every row and
   on half of them (their graphs hold the adapters' Triton kernels: ``workers/cuda_graphs.py``), against the
   graph step of the base model.
5. step profile (issue #39's baseline): per decode step at batch 1 and 64 (greedy), and at 64 with every row
   drawing through a warper or penalised ("mixed sampling"), and at 64 with a 32-token prompt chunk among
   them (an eager step), the kernels launched, the host-device copies and synchronisations torch's profiler
   sees, and the CPU ops that take the most time.
6. cpu overlap (issue #39's CPU row), on the host's CPU, not the GPU: c=1 decode tokens/s of ``llmbus up
   --device cpu --dtype float32`` with the scheduler's overlap on against ``--disable-overlap``, two servers
   side by side measured in alternating rounds (benchmarks/overlap_ab.py's method) on a random-weight model of
   SmolLM2-135M's shapes; ok at a median ratio of at least 1.08 with every stream's 128 tokens decoded.

With ``--dry-run`` every part runs on CPU with tiny shapes and short prompts: it tests this script, not llmbus.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from _random_llama import meta_llama, random_model_loader, write_random_lora
from gpu_check_cpu import CpuOverlapPart
from gpu_check_lora import LORA_RANK, LoraPart
from gpu_check_served import ServedPart
from _runner_steps import count_replays, graph_modes, pipelined_steps, timed_steps

from llmbus.bus.messages import SamplingParams
from llmbus.testing.runner_driver import MAX_NEW_TOKENS, MIN_MARGIN, Request, drive, make_prompts, widen_weights
from llmbus.workers.graph_sizes import parse_cuda_graphs, parse_piecewise_graphs
from llmbus.workers.model_runner import ModelRunner, SeqInput

BLOCK_SIZE = 16  # what the scheduler uses on CUDA
NUM_BLOCKS = 96
# Two bf16 computations of one function round in different orders: llmbus may be off by this factor of
# transformers' own bf16 error and still count as "no larger" (a real bug is many times larger).
BF16_SLACK = 1.25

# Tiny families of part 1 (GQA 4:1, head_dim 32); windows shorter than the 52-token sequences. Each has the
# weight seed that gives every reference token a top-1/top-2 margin above MIN_MARGIN (a match then means
# something): seed 0 leaves the Mistral at 8e-4, seed 1 the Llama at 3e-4.
TINY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512, vocab_size=512,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "llama3_gqa": ("LlamaConfig", dict(num_hidden_layers=4, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)), 0),
    "mistral_window": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=24), 1),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2), 0),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32), 0),  # QK-norm
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2), 0),
    # the Triton kernel's SOFTCAP and SINKS variants (a cap low enough to bend these scores; untied, so that
    # random weights do not repeat the last token)
    "gemma2_softcap": ("Gemma2Config", dict(num_hidden_layers=2, head_dim=32, sliding_window=24,
                                            attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                            query_pre_attn_scalar=32, tie_word_embeddings=False), 0),
    "gpt_oss_sinks": ("GptOssConfig", dict(num_hidden_layers=2, head_dim=32, sliding_window=24, num_local_experts=4,
                                           num_experts_per_tok=2,
                                           layer_types=["sliding_attention", "full_attention"]), 0),
}
# A dry run tests this script, not the families: one dense family and the one whose steps are not captured.
DRY_FAMILIES = ("llama3_gqa", "mixtral")
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=128256, num_hidden_layers=32, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192))
LLAMA_DRY = dict(LLAMA_8B, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=2048, num_hidden_layers=2, max_position_embeddings=16384)


@dataclass
class Sizes:
    """What the served and speed parts run: the full sizes on a GPU, tiny ones in a dry run."""

    served_shape: dict
    served_layers: int
    streams: int
    stream_tokens: int
    long_prompt: int
    burst: int
    burst_prompt: int
    speed_shape: dict
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    timed_steps: int
    copy_bytes: int
    # Part 3's throughput wave, which transformers' continuous batching then runs too: concurrent requests,
    # prompt tokens, new tokens (issue #39: c=64, 128+128).
    throughput: tuple[int, int, int] = (64, 128, 128)


FULL = Sizes(LLAMA_8B, 4, 16, 64, 32768, 64, 2048, LLAMA_8B, (1, 16, 64), (512, 2048), 20, 2**30)
DRY = Sizes(LLAMA_DRY, 2, 4, 8, 300, 6, 64, LLAMA_DRY, (1, 4), (16, 48), 3, 2**22, (4, 16, 8))


class Report:
    """The rows, written to ``path`` after each one."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta, self.rows = path, meta, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.meta, "rows": self.rows}, indent=2, default=str) + "\n")
        tmp.replace(self.path)
        mark = "ok  " if row["ok"] else "FAIL"
        print(f"[{mark}] {row['part']} {row['name']}: {row.get('summary') or row.get('error', '')}", flush=True)


class Check(ServedPart, CpuOverlapPart, LoraPart):
    """The parts (3 and 6 in their own modules, as base classes, and LoRA's rows of 1 and 4) and what they
    share."""

    tiny_blocks = NUM_BLOCKS  # part 1's pool, which its requests' blocks address

    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.sizes = DRY if self.dry else FULL
        self.families = DRY_FAMILIES if self.dry else tuple(FAMILIES)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.float32_tokens: dict[str, dict] = {}  # family -> {"path", "prompts", "tokens", "margin"}

    def row(self, part: str, name: str, ok: bool, summary: str, **details) -> None:
        self.report.add(dict(part=part, name=name, ok=bool(ok), summary=summary, **details))

    def run_part(self, part: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (a failed part is a row; the other parts still run)
            self.row(part, "error", False, f"{type(exc).__name__}: {exc}"[:300], error=traceback.format_exc(),
                     seconds=round(time.perf_counter() - t0, 1))
        finally:
            self.free()

    def free(self) -> None:
        # What a part left goes back to the device before the next part. A dry run's tiny CPU runners are
        # not worth a collection, which takes a loaded host a quarter second each over torch's and
        # transformers' heap.
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def runner(self, path: str, dtype: torch.dtype, **kwargs) -> ModelRunner:
        """A ModelRunner on the check's device and ``--attention-backend``, warmed up. Where one with
        ``--piecewise-graphs`` fails to warm up, a "piecewise" row says why and the check goes on without them
        (this runner and every later one, the served part's included): a capture that fails on the device must
        not cost the run its other rows."""
        piecewise = parse_piecewise_graphs(getattr(self.args, "piecewise_graphs", None),
                                           parse_cuda_graphs(self.args.cuda_graphs))
        try:
            return self._warm_runner(path, dtype, piecewise, **kwargs)
        except Exception as exc:
            if not piecewise:
                raise
            self.row("piecewise", "warm-up", False, f"a runner with piecewise graphs {piecewise} failed to warm up; "
                     f"off from here: {type(exc).__name__}: {exc}"[:300], error=traceback.format_exc())
            self.args.piecewise_graphs = "0"
            self.free()
            return self._warm_runner(path, dtype, (), **kwargs)

    def _warm_runner(self, path: str, dtype: torch.dtype, piecewise: tuple[int, ...], **kwargs) -> ModelRunner:
        runner = ModelRunner(path, dtype=dtype, device=self.device, block_size=BLOCK_SIZE,
                             attention_backend=self.args.attention_backend,
                             cuda_graphs=parse_cuda_graphs(self.args.cuda_graphs), piecewise_graphs=piecewise,
                             full_graphs=getattr(self.args, "full_graphs", False), **kwargs)
        runner.warmup()
        return runner

    # -- part 1 ----------------------------------------------------------------------------------

    def _family(self, name: str) -> str:
        import transformers

        config_class, arguments, seed = FAMILIES[name]
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**TINY, **arguments))
        widen_weights(model)
        path = str(self.work / name)
        model.save_pretrained(path)
        return path

    def _hf_greedy(self, path: str, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
        """transformers float32 greedy tokens on the device, one prompt at a time, and the thinnest top-1/top-2
        logit margin among them (a token match only means something above a margin)."""
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        tokens, margin = [], float("inf")
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=self.device), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
        return tokens, margin

    def _mixed_batch(self, prompts: list[list[int]], vocab: int) -> list[Request]:
        """r0..r4 (1, 3, 7, 19 and 40 tokens: a decode-sized prompt, a padded prompt group, a 40-token prompt
        in chunks of 16 arriving while others decode); r3 is preempted after 5 tokens and resumes from its first
        block; ``hit`` shares r4's first 34 tokens and starts from its first 2 blocks while r4 still runs."""
        donor_blocks = [NUM_BLOCKS - 1, NUM_BLOCKS - 7, NUM_BLOCKS - 3]
        hit_prompt = prompts[4][:34] + [random.Random(5).randrange(vocab) for _ in range(9)]
        prompts.append(hit_prompt)
        return [Request("r0", prompts[0]), Request("r1", prompts[1]), Request("r2", prompts[2], arrival_step=1),
                Request("r3", prompts[3], arrival_step=2, preempt_after=5, resume_cached_blocks=1),
                Request("r4", prompts[4], arrival_step=3, prefill_chunk=16, blocks=list(donor_blocks)),
                Request("hit", hit_prompt, arrival_step=7, computed=2 * BLOCK_SIZE, blocks=donor_blocks[:2])]

    def _reference(self, name: str) -> tuple[dict, list[Request]]:
        """Family ``name``'s checkpoint, prompts and transformers float32 tokens (made once: part 2 reuses
        part 1's), and the mixed batch of requests over those prompts."""
        vocab = TINY["vocab_size"]
        prompts = make_prompts(vocab)
        requests = self._mixed_batch(prompts, vocab)
        if name not in self.float32_tokens:
            path = self._family(name)
            expected, margin = self._hf_greedy(path, prompts)
            self.float32_tokens[name] = dict(path=path, prompts=prompts, tokens=expected, margin=margin)
        return self.float32_tokens[name], requests

    def float32_greedy(self) -> None:
        for name in self.families:
            t0 = time.perf_counter()
            ref, template = self._reference(name)
            path, expected, margin = ref["path"], ref["tokens"], ref["margin"]
            runner = self.runner(path, torch.float32, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=256)
            for suffix, graph_sizes in graph_modes(runner):
                requests = copy.deepcopy(template)
                piecewise = runner.piecewise is not None
                replays = count_replays(runner)
                results = drive(runner, requests)
                got = [results[r.rid].tokens for r in requests]
                mismatched = [r.rid for r, g, e in zip(requests, got, expected) if g != e]
                preempted = results["r3"].preemptions
                thin = " (under MIN_MARGIN: a mismatch may be a tie)" if margin < MIN_MARGIN else ""
                graphs_said = f", {replays[0]} steps replayed CUDA graphs" if graph_sizes else ""
                whole = piecewise and runner.piecewise.index is not None
                graphs_said += f", {replays[1]} piecewise{' (whole buckets)' if whole else ''}" if piecewise else ""
                # --full-graphs asked: every family whose parts take no start mask (LongRoPE's) holds them whole
                whole_missing = (getattr(self.args, "full_graphs", False) and piecewise and not whole
                                 and runner.piecewise.starts is None)
                graphs_said += " (--full-graphs asked: not captured whole, see the log)" if whole_missing else ""
                self.row("1 float32 greedy", name + suffix, not mismatched and preempted == 1 and not whole_missing
                         and (replays[0] > 0 or not graph_sizes) and (replays[1] > 0 or not piecewise),
                         f"{len(requests) - len(mismatched)}/{len(requests)} sequences token-exact (min margin "
                         f"{margin:.3g}{thin}, {preempted} preemption, prefix hit of 2 blocks{graphs_said})",
                         backend=runner.compute_paths["attention"], device=str(self.device), dtype="float32",
                         tf32=torch.backends.cuda.matmul.allow_tf32, mismatched=mismatched,
                         tokens={r.rid: g for r, g in zip(requests, got)}, expected=expected, min_margin=margin,
                         cuda_graphs=graph_sizes, graph_replays=replays[0],
                         seconds=round(time.perf_counter() - t0, 1))
            del runner
        self.lora_greedy()

    # -- part 2 ----------------------------------------------------------------------------------

    def _hf_logits(self, path: str, seqs: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        with torch.inference_mode():
            return [model(torch.tensor([s], device=self.device)).logits[0].float().cpu() for s in seqs]

    def _llmbus_teacher_forced(self, runner: ModelRunner, seqs: list[list[int]],
                               prompt_lens: list[int]) -> list[torch.Tensor]:
        """Logits of every generated position: all prompts in one step, then one decode row per sequence per
        step feeding the given tokens, on scattered block tables."""
        blocks = list(range(runner.num_blocks))
        random.Random(3).shuffle(blocks)
        per = -(-max(len(s) for s in seqs) // BLOCK_SIZE)
        tables = [blocks[i * per:(i + 1) * per] for i in range(len(seqs))]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        greedy = SamplingParams()
        with torch.inference_mode():
            logits = runner._forward([SeqInput(f"s{i}", s[:n], 0, tables[i], True, greedy, n)
                                      for i, (s, n) in enumerate(zip(seqs, prompt_lens))], runner.kv_cache)
            for i in range(len(seqs)):
                rows[i].append(logits[i].float().cpu())
            for step in range(MAX_NEW_TOKENS - 1):
                logits = runner._forward([SeqInput(f"s{i}", [s[n + step]], n + step, tables[i], True, greedy, n)
                                          for i, (s, n) in enumerate(zip(seqs, prompt_lens))], runner.kv_cache)
                for i in range(len(seqs)):
                    rows[i].append(logits[i].float().cpu())
        return [torch.stack(r) for r in rows]

    def bfloat16_logits(self) -> None:
        for name in self.families:
            t0 = time.perf_counter()
            ref, _ = self._reference(name)
            prompts, lens = ref["prompts"], [len(p) for p in ref["prompts"]]
            seqs = [p + t for p, t in zip(prompts, ref["tokens"])]
            truth = _generated_rows(self._hf_logits(ref["path"], seqs, torch.float32), lens)
            hf_bf16 = _generated_rows(self._hf_logits(ref["path"], seqs, torch.bfloat16), lens)
            runner = self.runner(ref["path"], torch.bfloat16, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=512)
            ours = torch.cat(self._llmbus_teacher_forced(runner, seqs, lens))
            hf_err, our_err = _relative_error(hf_bf16, truth), _relative_error(ours, truth)
            agree = float((ours.argmax(-1) == truth.argmax(-1)).float().mean())
            self.row("2 bfloat16 logits", name, our_err <= BF16_SLACK * hf_err,
                     f"relative logit error llmbus {our_err:.3g} vs transformers bf16 {hf_err:.3g} "
                     f"(ratio {our_err / hf_err:.2f}, limit {BF16_SLACK}); argmax agrees on {agree:.0%}",
                     backend=runner.compute_paths["attention"], device=str(self.device), dtype="bfloat16",
                     llmbus_error=our_err, transformers_bf16_error=hf_err,
                     llmbus_max_abs=float((ours - truth).abs().max()),
                     transformers_bf16_max_abs=float((hf_bf16 - truth).abs().max()),
                     seconds=round(time.perf_counter() - t0, 1))
            del runner

    # -- part 3: gpu_check_served.ServedPart; part 6: gpu_check_cpu.CpuOverlapPart -----------------

    # -- part 4 ----------------------------------------------------------------------------------

    def _speed_runner(self, name: str, lora_rank: int = 0) -> tuple[ModelRunner, dict, int]:
        """(a runner of random bf16 weights of the speed shape made on the device, with a LoRA adapter of
        ``lora_rank`` on every projection named "lora" if not 0; its config, blocks per sequence of the longest
        context)."""
        sizes = self.sizes
        config = dict(sizes.speed_shape, model_type="llama", hidden_act="silu", tie_word_embeddings=False)
        path = self.work / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        per_seq = -(-(max(sizes.contexts) + 1) // BLOCK_SIZE)
        lora = (("lora", write_random_lora(self.work / f"{name}-lora", config, lora_rank)),) if lora_rank else ()
        with random_model_loader(self.device):
            runner = self.runner(str(path), torch.bfloat16, num_blocks=max(sizes.batches) * per_seq + 1,
                                 max_batch_prefill_tokens=2048, lora_adapters=lora)
        return runner, config, per_seq

    def speed(self) -> None:
        sizes = self.sizes
        bandwidth = _copy_bandwidth(self.device, sizes.copy_bytes)
        self.row("4 speed", "copy bandwidth", True, f"{bandwidth / 1e12:.3f} TB/s device-to-device "
                 "(bytes read + written)", bytes_per_s=bandwidth, device=str(self.device))
        dtype = torch.bfloat16
        runner, config, per_seq = self._speed_runner("speed", lora_rank=LORA_RANK)
        graph_step: dict[tuple[int, int], float] = {}
        # What a decode step reads: every weight but the embedding, of which it reads one row per sequence
        weights = sum(t.numel() for name, t in meta_llama(config).state_dict().items()
                      if name != "model.embed_tokens.weight") * dtype.itemsize
        kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
        blocks = list(range(runner.num_blocks))
        random.Random(7).shuffle(blocks)
        rng = random.Random(0)
        for context in sizes.contexts:
            for batch in sizes.batches:
                seqs = [SeqInput(f"d{i}", [rng.randrange(3, config["vocab_size"])], context,
                                 blocks[i * per_seq:(i + 1) * per_seq], True, SamplingParams(), context)
                        for i in range(batch)]
                for suffix, graph_sizes in graph_modes(runner):
                    times = timed_steps(runner, seqs, 3, sizes.timed_steps)
                    # Each weight and KV byte read once, at the copy's rate (which counts a byte read or written)
                    floor = (weights + batch * context * kv_per_token) / bandwidth
                    # One at a time (the host's turnaround between steps counted), then as the worker runs
                    # the steps the scheduler sends ahead: each launched behind the one before, fed its
                    # tokens on the device, before that one's tokens are read.
                    pipelined = pipelined_steps(runner, seqs, sizes.timed_steps)
                    if not suffix:
                        graph_step[batch, context] = statistics.median(times)
                    for mode, measured in (("", times), (" pipelined", pipelined)):
                        step = statistics.median(measured)
                        self.row("4 speed", f"decode b{batch} ctx{context}{suffix}{mode}", True,
                                 f"{step * 1e3:.2f} ms/step, {batch / step:.0f} tokens/s; floor "
                                 f"{floor * 1e3:.2f} ms ({floor / step:.0%} of it)",
                                 backend=runner.compute_paths["attention"], device=str(self.device),
                                 dtype="bfloat16", batch=batch, context=context, cuda_graphs=graph_sizes,
                                 pipelined=bool(mode), step_ms=step * 1e3, step_ms_all=[t * 1e3 for t in measured],
                                 floor_ms=floor * 1e3, weight_bytes=weights,
                                 kv_bytes=batch * context * kv_per_token)
        self._chunk_steps(runner, config, per_seq, blocks, rng)
        self.lora_steps(runner, config, per_seq, blocks, graph_step, rng)
        del runner

    def _chunk_steps(self, runner: ModelRunner, config: dict, per_seq: int, blocks: list[int], rng) -> None:
        """A step the decode graphs cannot replay: a prompt chunk of up to 128 tokens beside the largest batch's
        decodes (what an arrival makes at c=64), with the runner's piecewise graphs where it captured them
        (--piecewise-graphs), then eagerly."""
        sizes = self.sizes
        batch, context = max(sizes.batches), min(sizes.contexts)
        chunk = min(128, max(sizes.contexts) - context)
        seqs = [SeqInput(f"c{i}", [rng.randrange(3, config["vocab_size"])], context,
                         blocks[i * per_seq:(i + 1) * per_seq], True, SamplingParams(), context)
                for i in range(batch)]
        seqs[0].token_ids = [rng.randrange(3, config["vocab_size"]) for _ in range(chunk)]
        for suffix, _ in graph_modes(runner):
            piecewise = runner.piecewise is not None
            how = ("eager" if not piecewise else "piecewise graphs" if runner.piecewise.index is None
                   else "whole graphs (--full-graphs)")
            step = statistics.median(timed_steps(runner, seqs, 3, sizes.timed_steps))
            self.row("4 speed", f"b{batch} ctx{context} + {chunk}-token chunk{suffix}", True,
                     f"{step * 1e3:.2f} ms/step ({how})",
                     backend=runner.compute_paths["attention"], device=str(self.device), dtype="bfloat16",
                     batch=batch, context=context, chunk=chunk, piecewise=piecewise, step_ms=step * 1e3)

    def step_profile(self) -> None:
        """What a decode step is made of on the device (issue #39's baseline): per step, the kernels
        launched, the host-device copies and the synchronisations, from torch's profiler."""
        from torch.profiler import ProfilerActivity, profile

        runner, config, per_seq = self._speed_runner("profile")
        rng = random.Random(0)
        context, steps = min(self.sizes.contexts), 2 if self.dry else 5
        # Greedy at batch 1 and the largest batch; then the largest batch with every row drawing (seeded,
        # each warper) or penalised (MIXED_SAMPLING): sampling on the device must not wait for it either; and
        # a step that runs eagerly, a 32-token prompt chunk beside the decodes (as arrivals make at c=64).
        largest = max(self.sizes.batches)
        mixes = [(1, "", [SamplingParams()], 0), (largest, "", [SamplingParams()] * largest, 0),
                 (largest, " mixed sampling", [MIXED_SAMPLING[i % len(MIXED_SAMPLING)] for i in range(largest)], 0),
                 (largest, " with a prompt chunk", [SamplingParams()] * largest, 32)]
        for batch, mix, params, chunk in mixes:
            # (a penalised request's history starts from what its first step found computed: cached_ids)
            seqs = [SeqInput(f"p{i}", [rng.randrange(3, config["vocab_size"])], context,
                             list(range(i * per_seq, (i + 1) * per_seq)), True, params[i], context,
                             cached_ids=[rng.randrange(3, config["vocab_size"]) for _ in range(context)])
                    for i in range(batch)]
            if chunk:
                seqs[0].token_ids = [rng.randrange(3, config["vocab_size"]) for _ in range(chunk)]
            for suffix, graph_sizes in graph_modes(runner):
                for _ in range(3):
                    runner.step(seqs)
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        runner.step(seqs)
                counts: dict[str, int] = {}
                syncs_by_name: dict[str, int] = {}
                for event in prof.events():
                    name = event.name
                    kind = ("launches" if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx")
                            else "graph launches" if name == "cudaGraphLaunch"
                            else "syncs" if "Synchronize" in name
                            else "copies" if name.startswith("cudaMemcpy") else None)
                    if kind is not None:
                        counts[kind] = counts.get(kind, 0) + 1
                    if kind == "syncs" or kind == "copies":
                        syncs_by_name[name] = syncs_by_name.get(name, 0) + 1
                per_step = {k: v / steps for k, v in counts.items()}
                self.row("5 profile", f"decode b{batch} ctx{context}{mix}{suffix}", True,
                         ", ".join(f"{v:.0f} {k}" for k, v in sorted(per_step.items())) + " per step",
                         device=str(self.device), batch=batch, context=context, per_step=per_step,
                         cuda_graphs=graph_sizes, sync_and_copy_calls={k: v / steps for k, v in syncs_by_name.items()},
                         top_cpu=prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
                         top_cuda=(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
                                   if self.device.type == "cuda" else ""))
        del runner


# -- helpers --------------------------------------------------------------------------------------


# Part 5's mixed batch: seeded draws through each warper, TGI's and OpenAI's penalties, both together.
MIXED_SAMPLING = [SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=1),
                  SamplingParams(do_sample=True, top_k=50, seed=2),
                  SamplingParams(do_sample=True, typical_p=0.9, min_p=0.05, seed=3),
                  SamplingParams(repetition_penalty=1.1),
                  SamplingParams(do_sample=True, temperature=0.8, top_p=0.95, seed=4, frequency_penalty=0.3,
                                 presence_penalty=0.2, frequency_per_count=True)]


def _generated_rows(logits: list[torch.Tensor], prompt_lens: list[int]) -> torch.Tensor:
    """Of each sequence's logits over all its positions, the rows that predict its generated tokens."""
    return torch.cat([f[n - 1:n - 1 + MAX_NEW_TOKENS] for f, n in zip(logits, prompt_lens)])


def _relative_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    return float((x - truth).norm() / truth.norm())



def _copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read plus written per second by a device-to-device copy, best of 10 after a warm-up."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _table(rows: list[dict]) -> str:
    lines = [f"{'part':<18} {'name':<20} {'ok':<4} {'backend':<14} summary"]
    for r in rows:
        backend = r.get("backend", "")
        backend = backend if isinstance(backend, str) else json.dumps(backend)
        lines.append(f"{r['part']:<18} {r['name']:<20} {'yes' if r['ok'] else 'NO':<4} {backend[:14]:<14} "
                     f"{r.get('summary', '')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report's path")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: tests this script (CI)")
    parser.add_argument("--attention-backend", default="auto",
                        help="the backend every part runs on, as llmbus up takes it (auto: the device's default)")
    parser.add_argument("--parts", default="1,2,3,4,5,6", help="which parts to run, comma-separated")
    parser.add_argument("--cuda-graphs", default=None,
                        help="the runners' --cuda-graphs (default: llmbus's; 0: none); the served part takes "
                             "llmbus up's default")
    parser.add_argument("--piecewise-graphs", default=None,
                        help="the runners' and the served part's --piecewise-graphs (token counts, e.g. "
                             "16,32,64,128,256,512; default: llmbus's; 0: none)")
    parser.add_argument("--full-graphs", action="store_true",
                        help="the runners' and the served part's --full-graphs: each piecewise bucket captured "
                             "whole, its attention included")
    parser.add_argument("--steps-ahead", type=int, default=None,
                        help="the served part's llmbus up --steps-ahead (default: llmbus's): 2 sends the ranks "
                             "their next command before the last result reaches the scheduler")
    parser.add_argument("--launch-depth", type=int, default=None,
                        help="the served part's llmbus up --launch-depth (default: llmbus's, 1): 2 keeps two steps "
                             "launched behind the one a rank answers")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    # float32 means float32 on both sides: TF32 would put transformers' reference near 3e-4 off.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    meta = dict(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), dry_run=args.dry_run,
                attention_backend_asked=args.attention_backend, torch=torch.__version__,
                device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    try:
        import transformers
        import triton

        meta.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    report = Report(args.out, meta)
    check = Check(args, report)
    t0 = time.perf_counter()
    parts = {"1": ("1 float32 greedy", check.float32_greedy), "2": ("2 bfloat16 logits", check.bfloat16_logits),
             "3": ("3 served", check.served), "4": ("4 speed", check.speed),
             "5": ("5 profile", check.step_profile), "6": ("6 cpu overlap", check.cpu_overlap)}
    for key in args.parts.split(","):
        name, fn = parts[key.strip()]
        p0 = time.perf_counter()
        check.run_part(name, fn)
        print(f"-- {name}: {time.perf_counter() - p0:.1f} s", flush=True)
    shutil.rmtree(check.work, ignore_errors=True)  # the models it built (the served one is 4 GB on a GPU)
    report.meta["seconds"] = round(time.perf_counter() - t0, 1)
    report.path.write_text(json.dumps({**report.meta, "rows": report.rows}, indent=2, default=str) + "\n")
    print(_table(report.rows))
    print(f"report: {args.out} ({report.meta['seconds']} s)")
    return 0 if all(r["ok"] for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
