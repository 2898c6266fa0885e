"""Compile the Triton attention kernels for a GPU on this machine, no GPU needed, and say what each variant takes:
registers a thread and bytes spilled (ptxas -v), or why it does not compile.

    python benchmarks/kernel_registers.py [--arch 90] [--json] [--ptxas-cache DIR]

triton's wheel carries its NVIDIA backend and ptxas, so ``triton.compile`` with a ``GPUTarget`` runs here as it
would at a GPU's first launch. The interpreter (``TRITON_INTERPRET=1``), which tests the kernels' numerics in CI,
runs Python instead: a kernel it runs can still fail to compile (a value the key loop reassigns with another
shape), or spill registers to local memory. The variants are ``paged_attention``'s on Llama-3.1-8B's heads (head
dim 128, four query heads a KV head) in bfloat16: decode rows (one query token a program, keys split or not) and
prompt tiles of 16 tokens, each without and with a sliding window, with the pool already written and with the
step's keys written by the launch (``NEW_KV``); and three that other models' layers compile: prompt tiles with
an image's key limits (Gemma 3, ``LIMITS``), and decode rows with soft-capped scores (Gemma 2, ``SOFTCAP``) or
sinks and a window (gpt-oss, ``SINKS``). Then the other kernels a step's graphs hold, once each at those
shapes: RoPE with the K/V write, the split keys' merge, RoPE alone (the piecewise parts'), RMSNorm with the
residual, SiLU-and-mul and the greedy choice's two kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels decorated for the compiler, not the interpreter

# (name, NEW_KV, query tokens a program, query heads a program's rows hold, key splits, sliding window, and the
# constexprs of other models' layers that are on)
VARIANTS = [(f"{'new_kv' if new_kv else 'written'} q{block_q} s{splits}{' window' if sliding else ''}",
             new_kv, block_q, block_h, splits, sliding, ())
            for new_kv in (False, True) for block_q, block_h, splits in ((1, 16, 1), (1, 16, 4), (16, 4, 1))
            for sliding in (False, True)] + [
    ("written q16 s1 limits", False, 16, 4, 1, False, ("LIMITS",)),
    ("new_kv q1 s4 softcap", True, 1, 16, 4, False, ("SOFTCAP",)),
    ("new_kv q1 s4 sinks window", True, 1, 16, 4, True, ("SINKS",)),
]
SHAPING = ("LIMITS", "SOFTCAP", "SINKS")


def _others() -> list[tuple]:
    """(name, kernel, its pointer and float arguments' types, its constexprs, warps) of the other kernels: each
    argument not named is an integer."""
    from llmbus.workers import _gpu_ops_kernels as ops
    from llmbus.workers.attention import triton_kernels as kernels

    bf16 = "*bf16"
    return [
        ("rotary_kv_write", kernels._rotary_kv_write_kernel,
         dict(qk_ptr=bf16, value_ptr=bf16, cos_ptr=bf16, sin_ptr=bf16, slots_ptr="*i64", query_ptr=bf16,
              key_slots_ptr=bf16, value_slots_ptr=bf16), dict(HALF=64, BLOCK_H=16, BLOCK_D=64), 4),
        ("combine_splits", kernels._combine_splits_kernel,
         dict(partial_out_ptr="*fp32", partial_ml_ptr="*fp32", out_ptr=bf16, sinks_ptr="*fp32"),
         dict(HEAD_DIM=128, BLOCK_D=128, SPLITS=16, SINKS=True), 4),
        ("rotary", ops._rotary_kernel, dict(x_ptr=bf16, cos_ptr=bf16, sin_ptr=bf16, out_ptr=bf16),
         dict(HALF=64, BLOCK_H=16, BLOCK_D=64), 4),
        ("rms_norm residual", ops._rms_norm_kernel,
         dict(x_ptr=bf16, residual_ptr="*fp32", weight_ptr=bf16, out_ptr=bf16, eps="fp32"),
         dict(HAS_RESIDUAL=True, BLOCK=4096), 8),
        ("silu_and_mul", ops._silu_and_mul_kernel, dict(gate_up_ptr=bf16, out_ptr=bf16), dict(BLOCK=1024), 4),
        ("greedy chunk", ops._greedy_chunk_kernel,
         dict(logits_ptr="*fp32", max_ptr="*fp32", index_ptr="*i32", sum_ptr="*fp32"), dict(BLOCK=ops.GREEDY_CHUNK), 8),
        ("greedy combine", ops._greedy_combine_kernel,
         dict(max_ptr="*fp32", index_ptr="*i32", sum_ptr="*fp32", ids_ptr="*i64", logprobs_ptr="*fp32"),
         dict(BLOCK_C=64), 1),
        # the decode graphs' first kernel with every optional field: an adapter slot and M-RoPE's shift
        ("unpack decode rows", ops._unpack_decode_rows_kernel,
         dict(staged_ptr="*i32", fed_ptr="*i64", small_ptr="*i64", tables_ptr="*i64", slot_tables_ptr="*i64"),
         dict(ROW_FIELDS=5, BLOCK=128), 1),
    ]


def _ptxas_report(ptx: str, arch: int, cache: Path | None) -> str:
    """What ptxas -v says (its stderr) compiling ``ptx`` for ``sm_<arch>``. With ``cache``, a folder, the report
    of a run on these exact bytes, flags and ptxas binary is read from it (and a new one written to it): the
    triton cache holds the compiled kernels, and ptxas on the attention variants is most of a warm run."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    flags = ["-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}"]
    cached = None
    if cache is not None:
        binary = os.stat(ptxas)
        key = "\0".join([ptxas, str(binary.st_size), str(binary.st_mtime_ns), *flags, ptx])
        cached = cache / f"{hashlib.sha256(key.encode()).hexdigest()}.txt"
        if cached.exists():
            return cached.read_text()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx_file:
        ptx_file.write(ptx)
    done = subprocess.run([ptxas, *flags, ptx_file.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(ptx_file.name)
    if cached is not None and done.returncode == 0:
        cache.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")  # whole or absent to a run reading it meanwhile
        partial.write_text(done.stderr)
        partial.replace(cached)
    return done.stderr


def _compile(fn, types: dict, constexprs: dict, warps: int, arch: int, ptxas_cache: Path | None = None) -> dict:
    """``fn`` compiled for ``sm_<arch>``: its registers and spilled bytes by ptxas -v, or the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    source = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    except Exception as exc:  # noqa: BLE001  (what the compiler said is the row)
        return {"error": f"{type(exc).__name__}: {exc}"[-600:]}
    said = _ptxas_report(compiled.asm["ptx"], arch, ptxas_cache)
    row = {}
    for line in said.splitlines():
        if "Used" in line and "registers" in line:
            row["registers"] = int(line.split("Used")[1].split("registers")[0])
        if "spill stores" in line:
            row["spilled_bytes"] = int(line.split("bytes spill stores")[0].split(",")[-1])
    return row


def compile_variants(arch: int, ptxas_cache: Path | None = None) -> list[dict]:
    from llmbus.workers.attention import triton_kernels as kernels

    fn = kernels._paged_attention_kernel
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i64",
                "program_seq_ptr": "*i32", "program_row_ptr": "*i32", "query_starts_ptr": "*i64",
                "query_lens_ptr": "*i64", "num_computed_ptr": "*i64", "partial_out_ptr": "*fp32",
                "partial_ml_ptr": "*fp32", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "slots_ptr": "*i64",
                "key_limits_ptr": "*i64", "sinks_ptr": "*fp32", "qk_scale": "fp32", "softcap": "fp32"}
    rows = []
    for name, new_kv, block_q, block_h, splits, sliding, shaping in VARIANTS:
        constexprs = dict(HEAD_DIM=128, BLOCK_D=128, QUERIES_PER_KV=4, BLOCK_H=block_h, BLOCK_Q=block_q,
                          BLOCK_N=kernels.NEW_KV_BLOCK_N if new_kv else kernels.BLOCK_N, BLOCK_SIZE=16,
                          SLIDING=sliding, PRECISION="ieee", NEG_START=kernels._NEG_START, UPCAST=False,
                          SPLITS=splits, NEW_KV=new_kv, **{flag: flag in shaping for flag in SHAPING})
        # eight warps: paged_attention's choice for head dim 128
        rows.append({"name": f"paged_attention {name}"} | _compile(fn, pointers, constexprs, 8, arch, ptxas_cache))
    for name, other, types, constexprs, warps in _others():
        rows.append({"name": name} | _compile(other, types, constexprs, warps, arch, ptxas_cache))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--ptxas-cache", type=Path, default=None,
                        help="a folder keeping ptxas -v's reports by their PTX, to reuse where a kernel is unchanged "
                             "(the test's; default: ptxas runs on every kernel)")
    args = parser.parse_args()
    rows = compile_variants(args.arch, args.ptxas_cache)
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        said = row.get("error") or f"{row.get('registers')} registers, {row.get('spilled_bytes')} bytes spilled"
        print(f"sm_{args.arch} {row['name']:42} {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
