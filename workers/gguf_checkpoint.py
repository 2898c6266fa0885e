"""Reading a GGUF file's weights by their Hugging Face names, a tensor-parallel slice at a time.

The same interface as ``loader.CheckpointReader`` (``names``, ``has``, ``shape``, ``read``, ``read_rows``,
``read_cols``), over the file's memory map (``gguf_index.py``: GGUFReader's layout without its eager
metadata): a rank touches only the rows or the column blocks it asks for. Quantized tensors come back
dequantized to float32 (``gguf_dequant.py``: gguf's numpy arithmetic, in torch), or, through
``read_quantized``, with their own values in llmbus's quantized forms for the types llmbus computes with
directly (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, MXFP4: ``quant.from_gguf`` of their raw blocks, ``GGUFRaw``).

Families whose llama.cpp layout differs from Hugging Face's are read into the names the native models load:
Qwen3-MoE's and gpt-oss's stacked experts (``ffn_*_exps``, one 3-D tensor per layer; gpt-oss's biases one 2-D
tensor) as one matrix (vector) per expert, Phi-3's fused ``attn_qkv``/``ffn_up`` as ``qkv_proj``/
``gate_up_proj``, Gemma 2's and 3's norms less the one llama.cpp adds.

llama.cpp's converter reorders the rows of each attention head's query and key projections for its RoPE
layout (the two halves of a head interleaved) in Llama-architecture files; reading undoes it, per head, so
the same row permutation serves float rows and raw quantized rows alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmbus.bus.model_files import GGUFError  # defined without torch: the supervisor catches it
from llmbus.workers import gguf_dequant, quant

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gpt-oss")
# Types with a dequantizer here. Q8_0/Q4_0/Q4_1, Q4_K/Q6_K and MXFP4 can also stay quantized (KEPT_TYPES).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "MXFP4")
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "MXFP4")
# Architectures whose files carry llama.cpp's interleaved query/key rows (its Qwen2 and Qwen3 writers leave them).
PERMUTED_QK = ("llama", "mistral")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",  # Qwen3
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 2's and 3's four norms a layer: llama.cpp's ffn_norm is the pre-FFN one
_GEMMA_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Where a family's llama.cpp names mean other Hugging Face tensors than a Llama's.
_FAMILY_LAYER_NAMES = {
    "qwen3moe": {"ffn_gate_inp.weight": "mlp.gate.weight"},  # the router
    # Phi-3 keeps its fused projections: ffn_up holds gate_up_proj's gate rows then its up rows
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    # gpt-oss: its FFN's input norm, the output projection's bias, the sinks and the biased router
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"},
}
# Mixture-of-experts files stack a layer's experts in one 3-D tensor (gpt-oss's biases in one 2-D tensor);
# each expert reads as its own matrix (vector), under models/gpt_oss.py's and Qwen3-MoE's per-expert names.
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
                    "ffn_down_exps.weight": "down_proj.weight", "ffn_gate_exps.bias": "gate_proj.bias",
                    "ffn_up_exps.bias": "up_proj.bias", "ffn_down_exps.bias": "down_proj.bias"}
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")
# llama.cpp's Gemma 2 and 3 converters store every RMSNorm weight plus one (its norm multiplies by the weight,
# the Hugging Face one by 1 + weight); reading takes the one back off.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Tensors the native model computes itself: llama3's per-frequency RoPE factors become config.json's
# rope_parameters when the folder is made (supervisor/gguf_model.py).
_IGNORED = ("rope_freqs.weight",)


@dataclass(frozen=True)
class GGUFRaw:
    """A quantized matrix as its GGUF blocks: ``data`` is ``[rows, row_bytes]`` uint8 (each row a run of
    blocks of 32 weights), ``shape`` the (rows, columns) of the weights it holds."""

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]


def open_gguf(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - the reader asserts and overruns its memory map on a damaged file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def open_gguf_index(path: str | Path):
    """The file's header as a rank reads it: ``gguf_index.GGUFIndex`` (values decoded when read), or
    GGUFReader for the files the index leaves to it. Both give ``fields`` and ``tensors`` alike."""
    from llmbus.workers.gguf_index import GGUFHeaderError, GGUFIndex, readable_here

    try:
        if not readable_here(path):
            return open_gguf(path)
        return GGUFIndex(path)
    except (GGUFHeaderError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field_value(reader, key: str, default=None):
    """A metadata value of the file (a number, a string, a list), or ``default`` when it has none."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def check_servable(reader, path: str | Path) -> dict:
    """What llmbus needs to know before serving the file, or GGUFError naming what it cannot serve."""
    import gguf

    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch not in MOE_ARCHITECTURES and any(t.name.endswith("_exps.weight") for t in reader.tensors):
        # llama.cpp writes Mixtral as a llama file with stacked experts; transformers' GGUF reader (the
        # reference for every file served here) does not read those
        raise GGUFError(f"{path}: a {arch} file with routed experts (Mixtral-style) is not supported "
                        f"(supported mixture-of-experts architectures: {', '.join(MOE_ARCHITECTURES)})")
    types: dict[str, int] = {}
    names = set()
    for t in reader.tensors:
        type_name = gguf.GGMLQuantizationType(t.tensor_type).name
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} has type {type_name}, which llmbus cannot read "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")
        types[type_name] = types.get(type_name, 0) + 1
        names.add(t.name)
        expected = int(np.prod([int(d) for d in t.shape]))
        if int(t.n_elements) != expected or t.data.size == 0:
            raise GGUFError(f"{path}: tensor {t.name} is truncated")
    if "token_embd.weight" not in names:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    file_type = field_value(reader, "general.file_type")
    try:
        file_type_name = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        file_type_name = str(file_type)
    return {"architecture": arch, "tensor_types": types, "tied": "output.weight" not in names,
            "file_type": file_type_name, "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id")}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (a stacked-experts one: the prefix its experts' names share)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        names = {**_LAYER_NAMES, **_FAMILY_LAYER_NAMES.get(arch, {})}
        if rest in names:
            return f"model.layers.{layer}.{names[rest]}"
        if rest in _STACKED_EXPERTS and arch in MOE_ARCHITECTURES:
            return f"model.layers.{layer}.mlp.experts."
    return None


@dataclass(frozen=True)
class _ExpertMatrix:
    """One expert's matrix of a stacked-experts tensor, with the attributes read here of a ReaderTensor."""

    tensor_type: int
    shape: tuple[int, ...]  # innermost first, as GGUF lists them
    data: np.ndarray


def _expert_matrices(t, prefix: str) -> dict[str, _ExpertMatrix]:
    projection = _STACKED_EXPERTS[t.name.split(".", 2)[2]]
    shape = tuple(int(d) for d in t.shape[:-1])  # the experts are the outermost (last listed) dimension
    return {f"{prefix}{e}.{projection}": _ExpertMatrix(t.tensor_type, shape, t.data[e])
            for e in range(int(t.shape[-1]))}


class GGUFCheckpointReader:
    """Name -> tensor access over one GGUF file, with Hugging Face names (see module docstring)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = str(path)
        self._reader = open_gguf_index(path)
        self.summary = check_servable(self._reader, path)
        self._gguf = gguf
        arch = self.summary["architecture"]
        self._heads = {"q": field_value(self._reader, f"{arch}.attention.head_count"),
                       "k": field_value(self._reader, f"{arch}.attention.head_count_kv")}
        self._heads["k"] = self._heads["k"] or self._heads["q"]
        self._permuted = arch in PERMUTED_QK
        self._norms_plus_one = arch in _NORMS_PLUS_ONE
        self._tensors = {}
        for t in self._reader.tensors:
            name = hf_name(t.name, arch)
            if name is not None and name.endswith(".experts."):
                self._tensors.update(_expert_matrices(t, name))
            elif name is not None and len(t.shape) < 3:
                self._tensors[name] = t
            elif t.name not in _IGNORED:
                raise GGUFError(f"{path}: tensor {t.name} has no place in a {arch} model")

    def __enter__(self) -> "GGUFCheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._tensors.clear()
        self._reader = None  # drops the memory map once the last view is gone

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise KeyError(f"{self.path}: weight {name!r} not in the GGUF file")
        return self._tensors[name]

    def qtype(self, name: str) -> str:
        return self._gguf.GGMLQuantizationType(self._tensor(name).tensor_type).name

    def shape(self, name: str) -> list[int]:
        # GGUF lists dimensions innermost first; torch outermost first
        return [int(d) for d in reversed(self._tensor(name).shape)]

    def _row_order(self, name: str, start: int, stop: int) -> np.ndarray:
        """The file's rows that hold rows ``start:stop`` of the Hugging Face tensor."""
        rows = np.arange(start, stop)
        projection = name.rsplit(".", 2)[-2] if ".self_attn." in name else ""
        kind = projection[0] if projection in ("q_proj", "k_proj") else None
        if not self._permuted or kind is None:
            return rows
        num_rows = self.shape(name)[0]
        head_dim = num_rows // self._heads[kind]
        head, within = np.divmod(rows, head_dim)
        half, index = np.divmod(within, head_dim // 2)
        return head * head_dim + 2 * index + half

    def _rows_data(self, name: str, start: int, stop: int) -> np.ndarray:
        data = self._tensor(name).data
        order = self._row_order(name, start, stop)
        if data.ndim == 1:  # a vector (norms, biases)
            return np.asarray(data[order])
        if order.size and np.array_equal(order, np.arange(order[0], order[0] + order.size)):
            return np.asarray(data[order[0]:order[0] + order.size])
        return np.asarray(data[order])

    def _dequantize(self, name: str, data: np.ndarray) -> torch.Tensor:
        t = self._tensor(name)
        qtype = self._gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name in gguf_dequant.IMPLEMENTED:
            values = gguf_dequant.dequantize(data, qtype.name)
        else:  # a type llmbus has no torch dequantizer for: gguf-py's numpy one
            values = torch.from_numpy(np.ascontiguousarray(
                self._gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)))
        if self._norms_plus_one and name.endswith("norm.weight"):
            values = values - 1
        return values

    def read(self, name: str) -> torch.Tensor:
        return self.read_rows(name, 0, self.shape(name)[0])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dimension 0, dequantized to float32."""
        return self._dequantize(name, self._rows_data(name, start, stop))

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of dimension 1: whole quantization blocks are dequantized, then cut."""
        rows, cols = self.shape(name)
        block = self._block_size(name)
        first, last = start // block, -(-stop // block)
        data = self._rows_data(name, 0, rows)
        bytes_per_block = data.shape[1] // (cols // block) if cols % block == 0 else None
        if bytes_per_block is None:
            return self.read(name)[:, start:stop].contiguous()
        part = data[:, first * bytes_per_block:last * bytes_per_block]
        values = self._dequantize(name, np.ascontiguousarray(part))
        return values[:, start - first * block:stop - first * block].contiguous()

    def _block_size(self, name: str) -> int:
        return self._gguf.GGML_QUANT_SIZES[self._gguf.GGMLQuantizationType(self._tensor(name).tensor_type)][0]

    def read_quantized(self, name: str, rows: tuple[int, int] | None = None,
                       cols: tuple[int, int] | None = None) -> quant.QuantizedWeight | None:
        """``name`` (rows and/or columns sliced) as its own values in llmbus's quantized form when it is stored
        as a KEPT_TYPES type, else None; None too for columns that do not fall on the type's blocks (a K-quant's
        256 weights), which the caller expands."""
        qtype = self.qtype(name)
        if qtype not in KEPT_TYPES:
            return None
        num_rows, num_cols = self.shape(name)
        start, stop = rows if rows is not None else (0, num_rows)
        data = self._rows_data(name, start, stop)
        col_start, col_stop = cols if cols is not None else (0, num_cols)
        if (col_start, col_stop) != (0, num_cols):
            block = self._block_size(name)
            if col_start % block or col_stop % block:
                return None
            bytes_per_block = data.shape[1] // (num_cols // block)
            data = data[:, col_start // block * bytes_per_block:col_stop // block * bytes_per_block]
        # a copy: a view would keep the file's memory map (and its pages) alive, and it is read-only
        tensor = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True, order="C"))
        return quant.from_gguf(GGUFRaw(qtype, tensor, (stop - start, col_stop - col_start)))
