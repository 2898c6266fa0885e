"""SmolLM2-135M-Instruct served by llmbus in bf16, int8, int4 and the package's own Q4_1, beside
llama.cpp's llama-server on the same weights (bf16, q8_0, q4_1 GGUFs), measured in one run.

    python benchmarks/gguf_peers.py [--systems ...] [--c64-requests 64] [--c1-requests 4]

Every system gets the same prompts (128 tokens by SmolLM2's tokenizer, distinct from the first token on),
128 new tokens with EOS ignored, over the OpenAI completions route, streamed: c=1 is requests one at a
time, c=64 is 64 at once; tokens/s = completion tokens / wall time (prefill included). llama-server (from
$LLAMA_CPP_DIR, benchmarks/README.md) runs with `-t 2 -np 64 -c 32768 -no-kvu -cb`.
For llmbus, the worker rank's resident memory (VmRSS, after the run) is printed too.

Forms: "bf16" is the package's Q4_1 dequantized by transformers and written as a bf16 folder, "int8" /
"int4" that folder with --quantize, "q4_1" the package's GGUF served as it is; llama-server's bf16 and
q8_0 GGUFs are converted from the same dense weights with llama.cpp's own converter.
Targets (issue #15): llmbus int8 c=1 >= llama-server q8_0 c=1; int8 worker memory <= 0.6x bf16's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _server import READY_TIMEOUT_S, exact_token_prompt, exit_on_sigterm, load_tokenizer
from _smollm2 import dense_folder, llama_cpp_dir, package_gguf, peer_gguf

from llmbus.bench import BenchConfig, run_bench
from llmbus.bus.procfs import command_words, load_average, rss_bytes
from llmbus.testing import Server, free_port

LLMBUS_FORMS = {"llmbus-bf16": [], "llmbus-int8": ["--quantize", "int8"], "llmbus-int4": ["--quantize", "int4"],
                "llmbus-q4_1": None}
PEER_FORMS = {"llama-server-bf16": "bf16", "llama-server-q8_0": "q8_0", "llama-server-q4_1": "q4_1"}


class LlamaServer:
    def __init__(self, gguf: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        binary = llama_cpp_dir() / "build" / "bin" / "llama-server"
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", "2",
                    "-np", "64", "-c", "32768", "-no-kvu", "-cb"]

    def __enter__(self) -> "LlamaServer":
        print("server: " + " ".join(self.cmd), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
        raise RuntimeError("llama-server did not become healthy in 300 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def worker_rss_mib(server: Server) -> float | None:
    """Resident memory of the (single) worker rank: the launcher descendant started with --rank, or where the
    group is one rank, the workers service itself (`llmbus workers` runs rank 0 in its own process)."""
    commands = {pid: command_words(pid) for pid in server.pids}
    ranks = [pid for pid, words in commands.items() if "--rank" in words]
    services = [pid for pid, words in commands.items() if "llmbus.workers" in words]
    for pid in ranks or services:
        rss = rss_bytes(pid)
        return None if rss is None else rss / 2**20
    return None


def measure(url: str, single: list[str], many: list[str], warm: list[str], new_tokens: int) -> dict:
    common = dict(url=url, api="openai", max_new_tokens=(new_tokens, new_tokens), timeout=600.0,
                  max_duration=2400.0)
    one = run_bench(BenchConfig(concurrency=[1], requests=len(single) - 1, warmup=1, prompts=single, **common))
    lots = run_bench(BenchConfig(concurrency=[len(many)], requests=len(many), warmup=len(warm),
                                 prompts=warm + many, **common))
    for level in (one.levels[0], lots.levels[0]):
        if level.stats["errors"]:
            print(f"warning: {level.label}: {level.stats['error_kinds']}", file=sys.stderr)
    return {"c1": one.levels[0].stats["output_throughput"], "c64": lots.levels[0].stats["output_throughput"]}


def add_served_options(p: argparse.ArgumentParser, beside: str) -> None:
    """``--llama-server`` and the options of ``served_beside_llama_server`` (``beside``: what llama-server
    serves, for the help)."""
    p.add_argument("--llama-server", action="store_true", help=f"also serve it, beside llama-server{beside}")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--c1-requests", type=int, default=3)
    p.add_argument("--served-concurrency", type=int, default=8)


def served_beside_llama_server(gguf: str | Path, model_id: str, tokenizer_dir: str, a, tag: str = "") -> None:
    """llama-server on ``gguf``, then ``llmbus up --model-id model_id --dtype bfloat16``, one after the other:
    ``a.prompt_tokens``-token prompts (``tokenizer_dir``'s tokenizer), ``a.new_tokens`` new tokens with EOS
    ignored, c=1 and c=``a.served_concurrency``; prints each one's tokens/s (names ending in ``tag``) and the
    ratio."""
    tokenizer = load_tokenizer(tokenizer_dir)
    make = lambda label, n: [exact_token_prompt(tokenizer, a.prompt_tokens, f"{label} {i}")  # noqa: E731
                             for i in range(n)]
    single, many, warm = make("single", a.c1_requests + 1), make("request", a.served_concurrency), make("warm-up", 2)
    results = {}
    for name, serving in (("llama-server", lambda: LlamaServer(Path(gguf))),
                          ("llmbus", lambda: Server(["--model-id", model_id, "--dtype", "bfloat16"],
                                                    ready_timeout=READY_TIMEOUT_S))):
        with serving() as server:
            results[name] = r = measure(server.url, single, many, warm, a.new_tokens)
        print(f"{name + tag:>20}: c=1 {r['c1']:7.2f} tok/s   c={a.served_concurrency} {r['c64']:7.2f} tok/s",
              flush=True)
    ours, theirs = results["llmbus"], results["llama-server"]
    print(f"llmbus / llama-server: c=1 {ours['c1'] / theirs['c1']:.2f}x, "
          f"c={a.served_concurrency} {ours['c64'] / theirs['c64']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join([*PEER_FORMS, *LLMBUS_FORMS]))
    p.add_argument("--c1-requests", type=int, default=4)
    p.add_argument("--c64-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="llmbus activations")
    p.add_argument("--output", default="gguf_peers.json")
    a = p.parse_args()
    exit_on_sigterm()
    from tokenizers import Tokenizer

    dense = dense_folder("bfloat16")
    tokenizer = Tokenizer.from_file(str(dense / "tokenizer.json"))
    make = lambda tag, n: [exact_token_prompt(tokenizer, a.prompt_tokens, f"{tag} {i}") for i in range(n)]  # noqa: E731
    single, many, warm = make("single", a.c1_requests + 1), make("request", a.c64_requests), make("warm-up", 8)
    print(f"load average before: {load_average()}", flush=True)
    results = {}
    for name in a.systems.split(","):
        if name in PEER_FORMS:
            with LlamaServer(peer_gguf(PEER_FORMS[name])) as srv:
                results[name] = measure(srv.url, single, many, warm, a.new_tokens)
        else:
            extra = LLMBUS_FORMS[name]
            model = ["--model-id", str(package_gguf())] if extra is None else ["--model-id", str(dense), *extra]
            with Server([*model, "--dtype", a.dtype], ready_timeout=READY_TIMEOUT_S) as srv:
                results[name] = measure(srv.url, single, many, warm, a.new_tokens)
                results[name]["worker_rss_mib"] = worker_rss_mib(srv)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(f"\nload average after: {load_average()}")
    print(f"{'system':20} {'c=1 tok/s':>10} {'c=64 tok/s':>11} {'worker RSS MiB':>15}")
    for name, r in results.items():
        rss = r.get("worker_rss_mib")
        print(f"{name:20} {r['c1']:10.1f} {r['c64']:11.1f} {'' if rss is None else f'{rss:15.0f}'}")
    ratio = lambda x, y: (results[x][k] / results[y][k] for k in ("c1", "c64"))  # noqa: E731
    pairs = [("llmbus-bf16", "llama-server-bf16"), ("llmbus-int8", "llama-server-q8_0"),
             ("llmbus-q4_1", "llama-server-q4_1"), ("llmbus-int4", "llama-server-q4_1")]
    for ours, theirs in pairs:
        if ours in results and theirs in results:
            c1, c64 = ratio(ours, theirs)
            print(f"{ours} / {theirs}: c=1 {c1:.2f}x, c=64 {c64:.2f}x")
    if "llmbus-int8" in results and "llama-server-q8_0" in results:
        c1 = results["llmbus-int8"]["c1"] / results["llama-server-q8_0"]["c1"]
        print(f"target int8 c=1 >= llama-server q8_0: {c1:.2f}x {'pass' if c1 >= 1 else 'MISS'}")
    if results.get("llmbus-int8", {}).get("worker_rss_mib") and results.get("llmbus-bf16", {}).get("worker_rss_mib"):
        m = results["llmbus-int8"]["worker_rss_mib"] / results["llmbus-bf16"]["worker_rss_mib"]
        print(f"target int8 worker memory <= 0.6x bf16: {m:.2f}x {'pass' if m <= 0.6 else 'MISS'}")
    Path(a.output).write_text(json.dumps({"config": vars(a), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
