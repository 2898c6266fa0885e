"""GPTQ, AWQ, FP8 and MXFP4 checkpoints written for tests, from a float checkpoint, with the float checkpoint they
hold.

Each projection of the decoder layers is put on a grid, ``scale * (q - zero)`` per output and group of inputs
(float16 scales, as the formats store them), and packed as AutoGPTQ/GPTQModel (``gptq``, its original format
storing each zero point minus one, or ``gptq_v2``) or AutoAWQ's GEMM layout (``awq``) write it — the layouts
TGI's server reads (``bus/prequantized.py`` describes them). The other copy holds the same grid's numbers as
plain float weights: what transformers computes with from such a checkpoint, so its ``generate`` is the
reference the served checkpoint is compared with.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from llmbus.workers import mxfp4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def grid(weight: torch.Tensor, bits: int, group_size: int | None, *, symmetric: bool, act_order: bool,
         min_zero: int = 0, seed: int = 0):
    """``weight`` ``[N, K]`` on a ``bits`` grid: (q ``[N, K]``, zero points ``[N, G]``, float16 scales ``[N, G]``,
    each input's group ``[K]``, the grid's float32 weight). ``act_order`` puts inputs in groups by a random
    order, as GPTQ's desc_act does (by its Hessian's diagonal)."""
    n, k = weight.shape
    size = group_size or k
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    groups = torch.empty(k, dtype=torch.long)
    groups[order] = torch.arange(k) // size
    top = (1 << bits) - 1
    num_groups = int(groups.max()) + 1
    q = torch.empty(n, k, dtype=torch.long)
    zeros = torch.empty(n, num_groups, dtype=torch.long)
    scales = torch.empty(n, num_groups, dtype=torch.float16)
    for g in range(num_groups):
        members = (groups == g).nonzero().flatten()
        w = weight[:, members].float()
        if symmetric:
            scale = (w.abs().amax(dim=1) / (top // 2)).clamp(min=1e-4).half()
            zero = torch.full((n,), (top + 1) // 2, dtype=torch.long)
        else:
            low, high = w.amin(dim=1), w.amax(dim=1)
            scale = ((high - low) / top).clamp(min=1e-4).half()
            zero = torch.round(-low / scale.float()).long().clamp(min_zero, top)
        q[:, members] = (torch.round(w / scale.float()[:, None]).long() + zero[:, None]).clamp(0, top)
        zeros[:, g], scales[:, g] = zero, scale
    dequantized = scales.float()[:, groups] * (q - zeros[:, groups]).float()
    return q, zeros, scales, groups, dequantized


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Non-negative ints packed ``32 / bits`` to an int32 word along ``dim`` (0 or 1), lowest bits first;
    ``order[j]``: which of a run's values goes to the word's j-th place."""
    per_word = 32 // bits
    v = values.long() if dim == 1 else values.long().t()
    runs = v.reshape(v.shape[0], -1, per_word)
    if order is not None:
        runs = runs[:, :, list(order)]
    words = sum(runs[:, :, j] << (bits * j) for j in range(per_word))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()


def pack_gptq(q, zeros, scales, groups, bits: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One projection's tensors as GPTQ stores them (``q``: ``[N, K]``)."""
    stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
    assert stored_zeros.min() >= 0, "GPTQ's original format cannot store a zero point of 0"
    return {"qweight": _pack(q.t(), bits, dim=0), "qzeros": _pack(stored_zeros.t(), bits, dim=1),
            "scales": scales.t().contiguous(), "g_idx": groups.to(torch.int32)}


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    """One projection's tensors as AutoAWQ's GEMM layout stores them (4 bits)."""
    return {"qweight": _pack(q.t(), 4, dim=1, order=AWQ_ORDER), "qzeros": _pack(zeros.t(), 4, dim=1, order=AWQ_ORDER),
            "scales": scales.t().contiguous()}


def write_prequantized(path: str, out: str, reference_out: str, method: str, *, bits: int = 4,
                       group_size: int | None = 32, symmetric: bool = False, act_order: bool = False,
                       checkpoint_format: str = "gptq") -> dict:
    """The float checkpoint in ``path`` (one ``model.safetensors``) as a ``method`` ("gptq" or "awq")
    checkpoint in ``out`` and as the grid's float weights in ``reference_out``; the quantization_config
    written."""
    from safetensors.torch import load_file, save_file

    for folder in (out, reference_out):
        shutil.copytree(path, folder)
    state = load_file(os.path.join(path, "model.safetensors"))
    packed, reference = {}, dict(state)
    for i, (name, weight) in enumerate(sorted(state.items())):
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rpartition(".")[2] in PROJECTIONS):
            packed[name] = weight
            continue
        q, zeros, scales, groups, dequantized = grid(
            weight, bits, group_size, symmetric=symmetric, act_order=act_order, seed=i,
            min_zero=1 if method == "gptq" and checkpoint_format == "gptq" else 0)
        parts = (pack_gptq(q, zeros, scales, groups, bits, checkpoint_format) if method == "gptq"
                 else pack_awq(q, zeros, scales))
        packed.update({f"{prefix}.{part}": tensor for part, tensor in parts.items()})
        reference[name] = dequantized.to(weight.dtype)
    save_file(packed, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, os.path.join(reference_out, "model.safetensors"), metadata={"format": "pt"})
    section = {"quant_method": method, "bits": bits, "group_size": group_size or -1}
    if method == "gptq":
        section |= {"sym": symmetric, "desc_act": act_order, "checkpoint_format": checkpoint_format}
    else:
        section |= {"zero_point": True, "version": "gemm"}
    return _declare(out, section)


def _declare(out: str, section: dict) -> dict:
    """``section`` as the quantization_config of ``out``'s config.json; ``section``."""
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "quantization_config": section}, f, indent=2)
    return section


FLOAT8_MAX = 448.0  # e4m3's largest finite value
# how each writer lays out its FP8 scales: (config's quant_method, scale's name, its granularity)
FLOAT8_WRITERS = {"fp8": ("fp8", "weight_scale_inv", "block"), "fbgemm_fp8": ("fbgemm_fp8", "weight_scale", "row"),
                  "compressed-tensors": ("compressed-tensors", "weight_scale", "tensor")}


def write_float8(path: str, out: str, reference_out: str, writer: str, block: tuple[int, int] = (32, 32)) -> dict:
    """The float checkpoint in ``path`` with its decoder projections as float8 (e4m3) weights and scales as
    ``writer`` (a key of FLOAT8_WRITERS) lays them out, in ``out``; the scaled numbers as float weights in
    ``reference_out``; the quantization_config written. compressed-tensors' copy carries activation scales
    too (a static scheme), which a reader must not take for weights."""
    from safetensors.torch import load_file, save_file

    method, scale_name, granularity = FLOAT8_WRITERS[writer]
    for folder in (out, reference_out):
        shutil.copytree(path, folder)
    state = load_file(os.path.join(path, "model.safetensors"))
    written, reference = {}, dict(state)
    for name, weight in sorted(state.items()):
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rpartition(".")[2] in PROJECTIONS):
            written[name] = weight
            continue
        w = weight.float()
        n, k = w.shape
        if granularity == "tensor":
            scale = (w.abs().amax() / FLOAT8_MAX).reshape(1)
            expanded = scale
        elif granularity == "row":
            scale = w.abs().amax(dim=1, keepdim=True) / FLOAT8_MAX
            expanded = scale
        else:
            blocks = (-(-n // block[0]), -(-k // block[1]))
            padded = torch.nn.functional.pad(w.abs(), (0, blocks[1] * block[1] - k, 0, blocks[0] * block[0] - n))
            scale = padded.view(blocks[0], block[0], blocks[1], block[1]).amax(dim=(1, 3)) / FLOAT8_MAX
            expanded = scale[torch.arange(n) // block[0]][:, torch.arange(k) // block[1]]
        values = (w / expanded).to(torch.float8_e4m3fn)
        written[name], written[f"{prefix}.{scale_name}"] = values, scale.float()
        if writer == "compressed-tensors":
            written[f"{prefix}.input_scale"] = torch.ones(1)
        reference[name] = (values.float() * expanded).to(weight.dtype)
    save_file(written, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, os.path.join(reference_out, "model.safetensors"), metadata={"format": "pt"})
    if writer == "fp8":
        section = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(block)}
    elif writer == "fbgemm_fp8":
        section = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    else:
        scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                  "targets": ["Linear"]}
        section = {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}
    return _declare(out, section)


__all__ = ["FLOAT8_WRITERS", "grid", "mxfp4_pack", "mxfp4_weight", "pack_awq", "pack_gptq", "write_float8",
           "write_mxfp4", "write_prequantized"]


# e2m1's magnitudes by their 3-bit code (the 4th bit is the sign), and the values sharing one scale
FP4_MAGNITUDES = mxfp4.FP4_VALUES[:8]
MXFP4_BLOCK = mxfp4.BLOCK
MXFP4_UNCONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [..., K]`` in blocks of 32 along K: (``blocks [..., K/32, 16]`` uint8, two codes a byte, the even
    value's in the low nibble; ``scales [..., K/32]`` uint8, e8m0: 127 + each block's exponent, the smallest that
    brings its largest magnitude within 6; the values those hold, float32 ``[..., K]``)."""
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    grouped = weight.float().reshape(*weight.shape[:-1], -1, MXFP4_BLOCK)
    largest = grouped.abs().amax(-1).clamp(min=2.0 ** -100)
    exponents = torch.ceil(torch.log2(largest / 6.0)).to(torch.int32)
    scaled = grouped / torch.ldexp(torch.ones_like(largest), exponents)[..., None]
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    values = magnitudes[codes] * torch.where(scaled < 0, -1.0, 1.0)
    codes = (codes | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    held = torch.ldexp(values, exponents[..., None].expand_as(values)).reshape(weight.shape)
    return blocks, (exponents + 127).to(torch.uint8), held


def mxfp4_weight(weight: torch.Tensor):
    """A float ``[N, K]`` weight rounded to MXFP4 as ``quant.Mxfp4Weight`` (its last block padded with zeros,
    then cut back to K columns)."""
    from llmbus.workers import quant

    k = weight.shape[1]
    blocks, scales, _ = mxfp4_pack(torch.nn.functional.pad(weight, (0, -k % MXFP4_BLOCK)))
    packed = quant.Mxfp4Weight.from_blocks(blocks, scales)
    return quant.Mxfp4Weight(packed.values[:, :k].contiguous(), packed.scale)


def write_mxfp4(path: str, out: str, reference_out: str) -> dict:
    """The float gpt-oss checkpoint in ``path`` (one ``model.safetensors``) with its experts' projections as
    gpt-oss publishes them (``X_blocks``/``X_scales`` of the transposed ``[experts, outputs, inputs]`` weight) in
    ``out``, and the values they hold as float weights in ``reference_out``; the quantization_config written."""
    from safetensors.torch import load_file, save_file

    for folder in (out, reference_out):
        shutil.copytree(path, folder)
    state = load_file(os.path.join(path, "model.safetensors"))
    packed, reference = {}, dict(state)
    for name, weight in state.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            packed[name] = weight
            continue
        blocks, scales, held = mxfp4_pack(weight.transpose(1, 2))  # stored [experts, outputs, inputs]
        packed |= {f"{name}_blocks": blocks.contiguous(), f"{name}_scales": scales.contiguous()}
        reference[name] = held.transpose(1, 2).to(weight.dtype).contiguous()
    save_file(packed, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, os.path.join(reference_out, "model.safetensors"), metadata={"format": "pt"})
    return _declare(out, {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_UNCONVERTED})
