"""The ctypes side of ``csrc/llmbus_kernels.h``: its structures, its constants, every entry point's
signature, and the loader, which checks them against the library's own before anything is called.

``library()`` is the one loaded library (built if needed, ``build.py``), or None where the kernels cannot run
here: ``LLMBUS_CPU_KERNELS=0``, no C compiler, or a failed build (logged once, with what runs instead). A
library whose structure sizes or constants differ from these (``llmbus_kernels_abi``) is refused with
``KernelABIError``: a field added on one side fails at load, not as a misread pointer in a step.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess

import structlog

from llmbus.workers.kernels import build

log = structlog.get_logger("llmbus.workers.kernels")

MAX_ROWS = 8  # batch rows one GEMV pass of the fused decode layer serves
QUANT_TILE = 16  # output rows per vector of quant_kernels.c's weight layout
# columns a block of integer_products.c's 16-bit activations: int4 and int8 groups are whole ones
ACTIVATION_BLOCK = 32

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


# quant_kernels.c's tiled forms (Tiled.kind)
TILED_INT8, TILED_INT4, TILED_BF16, TILED_MXFP4 = 1, 2, 3, 4
# which tiled kernel a build has (tiled_kernel_isa): none, quant_kernels_avx2.c's, quant_kernels.c's VDPBF16PS
TILED_ISA_NONE, TILED_ISA_AVX2, TILED_ISA_AVX512_BF16 = 0, 1, 2
TILED_ISA_NAMES = {TILED_ISA_NONE: None, TILED_ISA_AVX2: "AVX2", TILED_ISA_AVX512_BF16: "AVX512-BF16"}


class Tiled(ctypes.Structure):
    """A projection in quant_kernels.c's tiled layout: int8/int4/MXFP4 with group scales, or bf16."""

    _fields_ = [("values", _P), ("scale", _P), ("low", _P), ("kind", _I64), ("k_padded", _I64), ("group", _I64),
                ("split", _I64)]


class Proj(ctypes.Structure):
    """A projection's weight: float32 rows, int8 rows with group scales, or both; and a bfloat16 copy; or a
    tiled form (``tiled.values`` set), which every GEMV of it then reads, its first ``rows`` outputs only
    where ``next`` points to the part that gives the rest (parts of different tiled forms)."""


Proj._fields_ = [("dense", _P), ("values", _P), ("scale", _P), ("group", _I64), ("bf16", _P), ("tiled", Tiled),
                 ("next", ctypes.POINTER(Proj)), ("rows", _I64)]


class Experts(ctypes.Structure):
    """A layer's routed experts: the router, each expert's gate/up and down projections, and the routing."""

    _fields_ = [("router", _P), ("gate_ups", _P), ("downs", _P), ("num_experts", _I64), ("top_k", _I64),
                ("renormalize", _I64), ("intermediate", _I64)]


class LoraSite(ctypes.Structure):
    """One projection's LoRA adapters, stacked (``workers/lora.py``); shrink null: none adapts it."""

    _fields_ = [("shrink", _P), ("expand_t", _P), ("rank", _I64), ("out_first", _P), ("out_last", _P)]


class LayerLora(ctypes.Structure):
    """A layer's LoRA adapters, by projection."""

    _fields_ = [(name, LoraSite) for name in ("qkv", "o_proj", "gate_up", "down")]


class LayerArgs(ctypes.Structure):
    """One decoder layer's weights for ``decode_layers_f32``."""

    _fields_ = ([(name, _P) for name in ("input_norm", "qkv_bias", "o_bias", "post_norm", "gate_up_bias",
                                         "down_bias")]
                + [(name, Proj) for name in ("qkv", "o_proj", "gate_up", "down")]
                + [("window", _I64)]
                + [(name, _P) for name in ("q_norm", "k_norm", "experts", "lora")])


class StepArgs(ctypes.Structure):
    """One step of ``decode_layers_f32``: shapes, per-row inputs, scratch and the paged pool."""

    _fields_ = ([(name, _I64) for name in ("batch", "hidden", "intermediate", "num_heads", "num_kv_heads",
                                           "head_dim", "pool_blocks", "block_size", "table_stride",
                                           "scores_stride")]
                + [("eps", _F32), ("scale", _F32)]
                + [(name, _P) for name in ("cos", "sin", "slots", "tables", "lens", "normed", "qkv_out",
                                           "attended", "act", "scores")]
                + [("rows_share_sequences", _I64)]
                + [(name, _P) for name in ("gate_up_out", "panels", "pool_key", "pool_value")]
                + [("pool_layer_stride", _I64), ("starts", _P), ("pool_f16", _I64), ("prepared", _P),
                   ("prepared_sums", _P)]
                + [(name, _P) for name in ("expert_probs", "expert_weights", "expert_in", "expert_out",
                                           "expert_sum", "expert_rows", "adapter_slots", "lora_scratch")])


_ATTENTION = [_P, _I64, _P, _I64, _P, _I64,  # query, new key, new value (+ row strides)
              _P, _P, _I64, _I64,  # pool K/V, pool blocks, block size
              _P, _P, _I64,  # slots (or null), block tables (+ row stride)
              _P, _P, _P,  # out, lens, starts
              _I64, _I64, _I64, _I64, _F32,  # batch, heads, kv heads, head dim, scale
              _F32, _P,  # soft cap (0: none), sinks [Hq] float32 (or null)
              _P, _I64]  # scratch (+ row stride)
_WRITE_KV = [_P, _I64, _P, _I64,  # new key, new value (+ row strides)
             _P, _P, _I64, _I64,  # pool K/V, pool blocks, block size
             _P, _I64, _I64, _I64]  # slots, tokens, kv heads, head dim
# Per pool dtype, the suffix of the decode attention entries: bf16, f32, f16kv (float32 activations over a
# float16 pool).
POOL_SUFFIXES = ("bf16", "f32", "f16kv")

# Every entry point: (argtypes, restype).
SIGNATURES: dict[str, tuple[list, type | None]] = {
    "llmbus_kernels_abi": ([ctypes.c_char_p], _I64),
    **{f"decode_attention_{suffix}": (_ATTENTION, _INT) for suffix in POOL_SUFFIXES},
    **{f"write_kv_{suffix}": (_WRITE_KV, None) for suffix in POOL_SUFFIXES},
    "decode_layers_f32": ([ctypes.POINTER(StepArgs), ctypes.POINTER(LayerArgs), _I64, _P], _INT),
    # weight, norm (or null), eps, x, in, out, rows, normed scratch, y, prepared scratch, their sums (tiled)
    "lm_head_f32": ([ctypes.POINTER(Proj), _P, _F32, _P, _I64, _I64, _I64, _P, _P, _P, _P], _INT),
    # weight, bias (or null), x, in, out, rows, y, prepared scratch, their sums (tiled)
    "gemv_proj": ([ctypes.POINTER(Proj), _P, _P, _I64, _I64, _I64, _P, _P, _P], _INT),
    "decode_layer_reads_bf16": ([], _INT),
    "attention_threads": ([], _I64),
    "decode_layer_panel_floats": ([_I64, _I64], _I64),
    "gemm_f32_runs": ([], _INT),
    "gemm_f32": ([_P] * 3 + [_I64] * 3 + [_P], _INT),  # x, w, bias, m, n, k, y
    "tiled_kernel_isa": ([], _INT),
    # x, x is float32, split float32 x, m, k, x stride, values, scale, (int4: low,) n, k padded, group, bias, y,
    # rows, sums
    "int8_matmul": ([_P, _INT, _INT, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P], _INT),
    # x, x is float32, split float32 x, m, k, x stride, values, n, k padded, bias, y, rows
    "bf16_matmul": ([_P, _INT, _INT, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _P], _INT),
    "int4_matmul": ([_P, _INT, _INT, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P], _INT),
    "mxfp4_matmul": ([_P, _INT, _INT, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P], _INT),  # no low
    "greedy_f32": ([_P, _I64, _I64, _I64, _P, _P], _INT),  # logits, rows, vocab, stride, ids, logprobs
    # logits, raw, rows, vocab, stride, sampled, temperatures, uniforms, scratch, scratch rows, ids, logprobs
    "sample_f32": ([_P, _P, _I64, _I64, _I64] + [_P] * 4 + [_I64] + [_P] * 2, _INT),
}

# What the library runs that torch does instead where it cannot be built (the warning says so).
_FALLBACK = ("decode attention, token choice, quantized and float32 projections and decode steps run on torch "
             "ops (slower)")


class KernelABIError(RuntimeError):
    """The library and these bindings disagree on a structure or constant."""


def abi_expectations() -> dict[str, int]:
    """What ``llmbus_kernels_abi`` must answer for each name: these bindings' sizes and constants."""
    return {"sizeof(Tiled)": ctypes.sizeof(Tiled), "sizeof(Proj)": ctypes.sizeof(Proj),
            "sizeof(Experts)": ctypes.sizeof(Experts), "sizeof(LayerArgs)": ctypes.sizeof(LayerArgs),
            "sizeof(StepArgs)": ctypes.sizeof(StepArgs), "sizeof(LoraSite)": ctypes.sizeof(LoraSite),
            "sizeof(LayerLora)": ctypes.sizeof(LayerLora),
            "MAX_ROWS": MAX_ROWS, "QUANT_TILE": QUANT_TILE, "ACTIVATION_BLOCK": ACTIVATION_BLOCK,
            "TILED_INT8": TILED_INT8, "TILED_INT4": TILED_INT4, "TILED_BF16": TILED_BF16, "TILED_MXFP4": TILED_MXFP4,
            "TILED_ISA_AVX2": TILED_ISA_AVX2, "TILED_ISA_AVX512_BF16": TILED_ISA_AVX512_BF16}


def check_abi(lib: ctypes.CDLL, expected: dict[str, int] | None = None) -> None:
    """Raise ``KernelABIError`` naming every entry of ``expected`` (default: ``abi_expectations()``) on
    which the library disagrees."""
    expected = abi_expectations() if expected is None else expected
    answers = {name: lib.llmbus_kernels_abi(name.encode()) for name in expected}
    wrong = [f"{name} is {answers[name]} in the library, {value} in bindings.py"
             for name, value in expected.items() if answers[name] != value]
    if wrong:
        raise KernelABIError(f"the CPU kernel library does not match workers/kernels/bindings.py "
                             f"({'; '.join(wrong)}): csrc/llmbus_kernels.h and bindings.py must change together")


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every entry point's signature set, once its ABI is checked."""
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    check_abi(lib)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library, built if needed and bound; None where it cannot be (logged once, with the reason)."""
    if build.disabled():
        return None
    compiler = build.find_compiler()
    if compiler is None:
        log.warning(f"no C compiler found: {_FALLBACK}")
        return None
    try:
        lib = ctypes.CDLL(str(build.build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning(f"could not build the CPU kernels: {_FALLBACK}", error=str(exc))
        return None
    return bind(lib)
