"""Checkpoints published already quantized (GPTQ, AWQ, FP8, MXFP4): what a model folder says about its
quantization, and whether llmbus reads it.

A GPTQ or AWQ checkpoint stores each projection ``X`` of the decoder as packed integers instead of
``X.weight``: ``X.qweight`` (int32 words of 32 / bits values), ``X.scales`` (one per output and group of
``group_size`` inputs), ``X.qzeros`` (packed zero points alike) and, for GPTQ, ``X.g_idx`` (each input's group).
A weight is ``scale * (q - zero)``. The two formats differ in how they pack (``workers/prequantized_checkpoint.py``
unpacks them):

- GPTQ (AutoGPTQ, GPTQModel, optimum): ``qweight`` ``[K * bits / 32, N]``, packed along the inputs;
  ``qzeros`` ``[G, N * bits / 32]``, packed along the outputs. Its original format (``checkpoint_format``
  "gptq", the default) stores each zero point minus one; "gptq_v2" stores it as it is. With ``desc_act``
  (act-order) the groups are not runs of adjacent inputs: ``g_idx`` says which group each input is in.
- AWQ (AutoAWQ's GEMM version): ``qweight`` ``[K, N * bits / 32]`` and ``qzeros`` ``[G, N * bits / 32]``,
  both packed along the outputs, the eight values of a word in the order 0, 2, 4, 6, 1, 3, 5, 7.

FP8 checkpoints keep ``X.weight``, stored as float8 (e4m3), with a float32 scale beside it: one for the tensor,
one per output row, or one per block of outputs and inputs; a weight is ``w8 * scale``. Three writers: transformers'
``fp8`` (Qwen3's and DeepSeek's FP8 uploads: ``X.weight_scale_inv``, blocks of ``weight_block_size``, multiplied
despite its name), Meta's ``fbgemm_fp8`` (``X.weight_scale`` per row) and llm-compressor's ``compressed-tensors``
in its ``float-quantized`` format (``X.weight_scale`` per tensor, row or block). Activations' scales (the FP8
GEMMs' inputs) are not used: llmbus computes with the model's dtype.

MXFP4 (gpt-oss, the only form its weights are published in) stores each expert projection ``X`` of the mixture
as ``X_blocks`` (two 4-bit e2m1 values a byte, 32 a block) and ``X_scales`` (one power of two a block, e8m0); the
attention, router, embeddings and head stay bf16. The native gpt-oss expands the experts to the model's dtype as
it reads them (``workers/mxfp4.py``); on the transformers fallback transformers does (its
``Mxfp4Config(dequantize=True)``), to the same numbers.

Where it is said: ``quantization_config`` in ``config.json`` (what transformers writes), else the
``quantize_config.json`` of AutoGPTQ or the ``quant_config.json`` of AutoAWQ beside it (older uploads), read
in that order as TGI's server reads them.

Pure file reading: the launcher refuses a checkpoint it cannot serve in one line before anything starts,
the workers read the packed tensors, the frontend reports the method in ``/info``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmbus.bus.model_files import read_config
from llmbus.bus.shared_settings import CHECKPOINT_METHODS
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization llmbus does not read: the message names it and says what would serve."""


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # one of CHECKPOINT_METHODS: "gptq", "awq", "fp8", "compressed-tensors", "mxfp4"
    bits: int  # 4 (GPTQ, AWQ, MXFP4) or 8 (GPTQ, FP8)
    group_size: int | None = None  # inputs sharing a scale and zero point; None: all of a row's (GPTQ's -1)
    zero_offset: int = 0  # added to each stored zero point (1 for GPTQ's original format, which stores zero - 1)
    scale_name: str = "weight_scale"  # FP8: the scale tensor beside X.weight
    scale_block: tuple[int, int] | None = None  # FP8: (outputs, inputs) one scale covers, where scales are blocks

    @property
    def packed(self) -> bool:
        """Integers packed in int32 words (GPTQ, AWQ); else float8 weights under their own names."""
        return self.method in ("gptq", "awq")

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def label(self) -> str:
        """How the startup log names a tensor stored so: "gptq int4", "float8 e4m3", "mxfp4"."""
        if self.method == "mxfp4":
            return "mxfp4"
        return f"{self.method} int{self.bits}" if self.packed else "float8 e4m3"



def checkpoint_quantization(model_dir: str | Path) -> CheckpointQuantization | None:
    """The quantization ``model_dir``'s checkpoint was published in; None for float weights.
    UnsupportedQuantization for one llmbus does not read, ValueError for a config it cannot parse."""
    folder = Path(model_dir)
    config = read_config(folder / "config.json")
    section = config.get("quantization_config")
    if section is not None:
        if not isinstance(section, dict):
            raise ValueError(f"{folder / 'config.json'}: quantization_config is not an object")
        return _from_section(section, "config.json")
    legacy_gptq = read_config(folder / "quantize_config.json")
    if legacy_gptq:
        method = "awq" if "zero_point" in legacy_gptq or str(legacy_gptq.get("version", "")).lower() == "gemm" \
            else "gptq"
        return _from_section({"quant_method": method, **legacy_gptq}, "quantize_config.json")
    legacy_awq = read_config(folder / "quant_config.json")
    if legacy_awq:
        return _from_section({"quant_method": "awq", "bits": legacy_awq.get("w_bit"),
                              "group_size": legacy_awq.get("q_group_size"), **legacy_awq}, "quant_config.json")
    return None


def quantize_problem(quantization: CheckpointQuantization | None, quantize: str | None) -> str | None:
    """Why ``--quantize quantize`` cannot serve a checkpoint quantized as ``quantization`` (None: it can)."""
    if quantize is None:
        return None
    if quantize in CHECKPOINT_METHODS:
        if quantization is None:
            return (f"--quantize {quantize} reads a checkpoint published in {quantize}'s format, and this one has "
                    f"float weights: give a {quantize} checkpoint, or quantize this one at load with "
                    f"--quantize int8 or int4")
        if quantization.method != quantize:
            return f"--quantize {quantize} was given, but the checkpoint is quantized with {quantization.method}"
        return None
    if quantization is not None:
        return (f"--quantize {quantize} quantizes float weights, and this checkpoint is already quantized with "
                f"{quantization.method}: leave --quantize out (or give {quantization.method})")
    return None


def _from_section(section: dict, source: str) -> CheckpointQuantization:
    method = str(section.get("quant_method", "")).lower()
    where = f"the checkpoint's {source}"
    if method == "fbgemm_fp8":  # TGI's --quantize fp8 serves it
        return CheckpointQuantization("fp8", 8)
    if method == "fp8":
        return _fp8(section, where)
    if method == "compressed-tensors":
        return _compressed_tensors(section, where)
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4", 4, group_size=32)
    if method not in CHECKPOINT_METHODS:
        raise UnsupportedQuantization(
            f"{where} says quant_method {method or '(none)'!r}: llmbus reads GPTQ, AWQ, FP8 and MXFP4 checkpoints "
            f"({', '.join(CHECKPOINT_METHODS)}); serve the model's float weights, quantized at load with "
            f"--quantize int8 or int4 if memory is short")
    bits, group_size = section.get("bits"), section.get("group_size", -1)
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise UnsupportedQuantization(f"{where} names no integer bits for its {method} weights")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise UnsupportedQuantization(f"{where} has group_size {group_size!r}: a positive size or -1 is read")
    if method == "gptq":
        if bits not in (4, 8):
            raise UnsupportedQuantization(f"{where}: {bits}-bit GPTQ weights are not read (4 and 8 bits are)")
        if section.get("is_marlin_format") or section.get("dynamic") or section.get("pack_dtype", "int32") != "int32":
            raise UnsupportedQuantization(f"{where}: GPTQ packed for Marlin, in words other than int32, or with bits "
                                          f"per module (dynamic) is not read")
        fmt = section.get("checkpoint_format") or "gptq"
        if fmt not in _GPTQ_FORMATS:
            raise UnsupportedQuantization(f"{where}: GPTQ checkpoint_format {fmt!r} is not read "
                                          f"({', '.join(_GPTQ_FORMATS)} are)")
        zero_offset = _GPTQ_FORMATS[fmt]
    else:
        version = str(section.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"{where}: AWQ's {version!r} layout is not read (its GEMM layout is)")
        if bits != 4:
            raise UnsupportedQuantization(f"{where}: {bits}-bit AWQ weights are not read (4 bits are)")
        if section.get("zero_point", True) is False:
            raise UnsupportedQuantization(f"{where}: AWQ weights without zero points are not read")
        zero_offset = 0
    return CheckpointQuantization(method, bits, None if group_size == -1 else group_size, zero_offset)


def _block(value, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise UnsupportedQuantization(f"{where}: FP8 block size {value!r} is not two positive integers")
    return value[0], value[1]


def _fp8(section: dict, where: str) -> CheckpointQuantization:
    fmt = str(section.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"{where}: FP8 weights in {fmt!r} are not read (e4m3 are)")
    # transformers' FineGrainedFP8Config blocks 128 x 128 unless told otherwise; older AutoFP8 uploads say fp8 too,
    # with one weight_scale per tensor (the reader takes either name)
    return CheckpointQuantization("fp8", 8, scale_name="weight_scale_inv",
                                  scale_block=_block(section.get("weight_block_size"), where) or (128, 128))


def _compressed_tensors(section: dict, where: str) -> CheckpointQuantization:
    """llm-compressor's FP8 weights (``float-quantized``); its integer formats are GPTQ's or AWQ's work,
    published in their own formats too."""
    fmt = section.get("format")
    groups = section.get("config_groups")
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    if (fmt not in ("float-quantized", "naive-quantized") or not weights
            or not all(isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)):
        raise UnsupportedQuantization(
            f"{where}: compressed-tensors format {fmt!r} is not read: llmbus reads its FP8 weights "
            f"(float-quantized, 8-bit float); for int4/int8 weights serve the model's GPTQ or AWQ upload")
    blocks = {(1, w["group_size"]) if w.get("strategy") == "group" and isinstance(w.get("group_size"), int)
              else _block(w.get("block_structure"), where) for w in weights}
    if len(blocks) != 1:
        raise UnsupportedQuantization(f"{where}: compressed-tensors groups with different FP8 blocks are not read")
    return CheckpointQuantization("compressed-tensors", 8, scale_block=blocks.pop())
