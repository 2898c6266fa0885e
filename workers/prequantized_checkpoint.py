"""Reading a GPTQ, AWQ, FP8 or MXFP4 checkpoint (``bus/prequantized.py`` says what it is): each quantized tensor
reads under its float name (``X.weight``; gpt-oss's ``X``), so the models build from it as from any checkpoint.

MXFP4 (``Mxfp4CheckpointReader``): a tensor stored as ``X_blocks``/``X_scales`` (gpt-oss's experts, each the
``[outputs, inputs]`` transpose of ``X``'s matrix) reads as ``X`` in float32, expanded exactly
(``workers/mxfp4.py``); ``read_rows`` of its first dimension (one expert) expands only those rows.
``read_mxfp4`` gives one expert's matrix as it is stored, ``quant.Mxfp4Weight``, for the CPU's kernels.

FP8 (``Float8CheckpointReader``): a float8 weight with a scale beside it reads as float32 ``w8 * scale``, the
product of two exact numbers rounded once. It is expanded to the model's dtype (llmbus has no FP8 kernel;
the CPU has no FP8 arithmetic).

GPTQ and AWQ (``PackedCheckpointReader``):

- ``read``/``read_rows``/``read_cols`` give a packed weight's slice as float32 numbers, exactly
  ``scale * (q - zero)`` (a float16 scale times an integer below 2^8 is exact in float32): what the float32
  model and a GPU compute with, and what transformers computes from the same checkpoint.
- ``read_quantized`` gives it as llmbus's own quantized form, with its values, for the CPU's kernels
  (``weight_builder.py`` asks for it with bfloat16 activations): 4 bits as ``quant.Int4Weight`` (the affine
  grid ``q * scale + low``, ``low = -scale * zero``), 8 bits with every zero point 128 (symmetric) as
  ``quant.Int8Weight``, both in groups of 32 inputs, each taking its group's scale (a format's group of 128
  is four of them). None where that form cannot hold the weight (GPTQ's act-order groups, which are not
  runs of adjacent inputs; asymmetric 8 bits; groups not a multiple of 32): the builder then expands it.
"""

from __future__ import annotations

import torch

from llmbus.bus.prequantized import CheckpointQuantization
from llmbus.workers import mxfp4, quant

_PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output a word's j-th value belongs to, in a run of eight


class _ReaderOver:
    """A reader over ``base`` (a ``loader.CheckpointReader``), closed with it."""

    def __init__(self, base, quantization: CheckpointQuantization):
        self.base, self.q = base, quantization
        self.model_dir = base.model_dir

    def __enter__(self):
        self.base.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.base.__exit__(*exc)


class PackedCheckpointReader(_ReaderOver):
    """A ``loader.CheckpointReader``'s interface over a GPTQ or AWQ checkpoint read by ``base``."""

    def __init__(self, base, quantization: CheckpointQuantization):
        super().__init__(base, quantization)
        self._packed = {name.removesuffix(".qweight") for name in base.names() if name.endswith(".qweight")}

    def _prefix(self, name: str) -> str | None:
        prefix = name.removesuffix(".weight")
        return prefix if prefix != name and prefix in self._packed else None

    def names(self) -> list[str]:
        return [f"{prefix}.weight" if part == "qweight" else name for name in self.base.names()
                for prefix, _, part in [name.rpartition(".")]
                if not (prefix in self._packed and part in _PACKED_PARTS and part != "qweight")]

    def has(self, name: str) -> bool:
        return self._prefix(name) is not None or self.base.has(name)

    def qtype(self, name: str) -> str:
        """How ``name`` is stored, for the startup log: "gptq int4", or "safetensors"."""
        return self.q.label if self._prefix(name) is not None else "safetensors"

    def shape(self, name: str) -> list[int]:
        prefix = self._prefix(name)
        if prefix is None:
            return self.base.shape(name)
        return [self.base.shape(f"{prefix}.scales")[1], self._inputs(prefix)]

    def read(self, name: str) -> torch.Tensor:
        prefix = self._prefix(name)
        return self.base.read(name) if prefix is None else self._dequantized(prefix, None, None)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        prefix = self._prefix(name)
        return self.base.read_rows(name, start, stop) if prefix is None else self._dequantized(prefix, (start, stop),
                                                                                               None)

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        prefix = self._prefix(name)
        return self.base.read_cols(name, start, stop) if prefix is None else self._dequantized(prefix, None,
                                                                                               (start, stop))

    def read_quantized(self, name: str, rows: tuple[int, int] | None = None,
                       cols: tuple[int, int] | None = None) -> quant.QuantizedWeight | None:
        """``name``'s rows and columns in llmbus's quantized form (columns cut at multiples of 32), or None
        where it is not packed or that form cannot hold it (see the module's docstring)."""
        prefix = self._prefix(name)
        if prefix is None:
            return None
        k = self._inputs(prefix)
        group = self.q.group_size or k
        first, stop = cols if cols is not None else (0, k)
        if (group % quant.INT4_GROUP and group != k) or first % quant.INT4_GROUP:
            return None
        values, zeros, scales, groups = self._unpacked(prefix, rows, cols)
        if not torch.equal(groups, torch.arange(first, stop) // group):  # act-order: groups are not runs of inputs
            return None
        # each block of 32 inputs takes the scale and zero point of the format's group it lies in
        first_of_block = torch.arange(first, stop, quant.INT4_GROUP) // group
        scale, zero = scales[:, first_of_block], zeros[:, first_of_block].float()
        if self.q.bits == 4:
            return quant.Int4Weight(values.to(torch.uint8), scale, -scale * zero, quant.INT4_GROUP)
        if torch.all(zeros == 128):
            return quant.Int8Weight((values - 128).to(torch.int8), scale, quant.INT4_GROUP)
        return None

    # -- unpacking ---------------------------------------------------------------------------------------------

    def _inputs(self, prefix: str) -> int:
        rows = self.base.shape(f"{prefix}.qweight")[0]
        return rows * self.q.per_word if self.q.method == "gptq" else rows

    def _groups(self, prefix: str) -> torch.Tensor:
        """Each input's group (int64 ``[K]``)."""
        k = self._inputs(prefix)
        if self.q.method == "gptq" and self.base.has(f"{prefix}.g_idx"):
            return self.base.read(f"{prefix}.g_idx").long()
        return torch.arange(k) // (self.q.group_size or k)

    def _unpacked(self, prefix: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None):
        """(q ``[N', K']``, zero points ``[N', G]``, float32 scales ``[N', G]``, each input's group ``[K']``) of
        output rows ``rows`` and input columns ``cols`` (all: None), zero points with the format's offset added.
        Only the words holding those rows and columns are unpacked: a row-parallel rank's share, not the matrix."""
        n, k = self.base.shape(f"{prefix}.scales")[1], self._inputs(prefix)
        if self.base.dtype(f"{prefix}.qweight") != "I32":
            raise ValueError(f"{self.model_dir}: {prefix}.qweight is {self.base.dtype(f'{prefix}.qweight')}, not the "
                             f"int32 words {self.q.method} packs")
        start, stop = rows if rows is not None else (0, n)
        first, last = cols if cols is not None else (0, k)
        stop, last = min(stop, n), min(last, k)
        per_word, bits = self.q.per_word, self.q.bits
        word_start, word_stop = start // per_word, -(-stop // per_word)
        cut = slice(start - word_start * per_word, stop - word_start * per_word)
        packed_zeros = self.base.read_cols(f"{prefix}.qzeros", word_start, word_stop)
        order = _AWQ_ORDER if self.q.method == "awq" else None
        zeros = _unpack_columns(packed_zeros, bits, order)[:, cut].t() + self.q.zero_offset
        if self.q.method == "gptq":  # words along the inputs
            input_words = (first // per_word, -(-last // per_word))
            slab = self.base.read_rows(f"{prefix}.qweight", *input_words)[:, start:stop]
            skip = first - input_words[0] * per_word
            values = _unpack_rows(slab, bits)[skip:skip + last - first].t()
        else:  # words along the outputs
            slab = self.base.read_rows(f"{prefix}.qweight", first, last)[:, word_start:word_stop]
            values = _unpack_columns(slab, bits, order)[:, cut].t()
        scales = self.base.read_cols(f"{prefix}.scales", start, stop).float().t()
        groups = self._groups(prefix)[first:last]
        return values.contiguous(), zeros.contiguous(), scales.contiguous(), groups

    def _dequantized(self, prefix: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        values, zeros, scales, groups = self._unpacked(prefix, rows, cols)
        return scales[:, groups] * (values - zeros[:, groups]).float()


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]``, each word ``32 / bits`` values along the rows, lowest bits first -> int32 ``[R * 32 /
    bits, C]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1])


def _unpack_columns(words: torch.Tensor, bits: int, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 ``[R, C]``, each word ``32 / bits`` values along the columns -> int32 ``[R, C * 32 / bits]``; with
    ``order``, a word's j-th value is column ``order[j]`` of its run."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    if order is not None:
        values = values[:, :, torch.tensor(order).argsort()]
    return values.reshape(words.shape[0], -1)


class Float8CheckpointReader(_ReaderOver):
    """A ``loader.CheckpointReader``'s interface over an FP8 checkpoint read by ``base``: float8 weights with a
    scale beside them read scaled, in float32; their scales and activation scales are not listed."""

    def _scale_name(self, name: str) -> str | None:
        """The scale of ``name`` where it is a float8 weight (the config's name for it, else the other writers'):
        None for other tensors; ValueError for a float8 weight without one, which read as it is would be wrong
        by its scale."""
        if not name.endswith(".weight") or not self.base.has(name) or not self.base.dtype(name).startswith("F8"):
            return None
        prefix = name.removesuffix(".weight")
        for scale_name in dict.fromkeys((self.q.scale_name, "weight_scale", "weight_scale_inv")):
            if self.base.has(f"{prefix}.{scale_name}"):
                return f"{prefix}.{scale_name}"
        raise ValueError(f"{self.model_dir}: {name} is stored as float8 without a weight_scale or weight_scale_inv "
                         f"beside it")

    def names(self) -> list[str]:
        scaled = {name.removesuffix(".weight") for name in self.base.names() if self._scale_name(name)}
        return [name for name in self.base.names()
                if not (name.rpartition(".")[0] in scaled
                        and name.rpartition(".")[2] in ("weight_scale", "weight_scale_inv", "input_scale"))]

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def qtype(self, name: str) -> str:
        return self.q.label if self._scale_name(name) else "safetensors"

    def shape(self, name: str) -> list[int]:
        return self.base.shape(name)

    def read(self, name: str) -> torch.Tensor:
        return self._read(name, None, None)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, (start, stop), None)

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, None, (start, stop))

    def _read(self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        scale_name = self._scale_name(name)
        if rows is not None:
            values = self.base.read_rows(name, *rows)
        elif cols is not None:
            values = self.base.read_cols(name, *cols)
        else:
            values = self.base.read(name)
        if scale_name is None:
            return values
        n, k = self.base.shape(name)
        row_ids = torch.arange(n)[slice(*rows)] if rows is not None else torch.arange(n)  # cut as the values were
        col_ids = torch.arange(k)[slice(*cols)] if cols is not None else torch.arange(k)
        return values.float() * self._scales(scale_name, n, k, row_ids, col_ids)

    def _scales(self, scale_name: str, n: int, k: int, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        """The scale of each weight of the rows and columns read: one for the tensor, one per row, or one per
        block of ``scale_block``."""
        scale = self.base.read(scale_name).float()
        if scale.numel() == 1:
            return scale.reshape(())
        if scale.shape[0] == n and scale.numel() == n:
            return scale.reshape(n, 1)[row_ids]
        block = self.q.scale_block
        if block is None or scale.dim() != 2 or tuple(scale.shape) != (-(-n // block[0]), -(-k // block[1])):
            raise ValueError(f"{self.model_dir}: {scale_name} has shape {list(scale.shape)}, which is neither one "
                             f"scale, one per row of {n}, nor one per block of the config's {block}")
        return scale[row_ids // block[0]][:, col_ids // block[1]]


class Mxfp4CheckpointReader(_ReaderOver):
    """A ``loader.CheckpointReader``'s interface over an MXFP4 checkpoint read by ``base``: each ``X_blocks`` and
    ``X_scales`` pair reads as ``X``, float32, in the layout the float checkpoint would hold it."""

    def __init__(self, base, quantization: CheckpointQuantization):
        super().__init__(base, quantization)
        self._blocks = {name.removesuffix("_blocks") for name in base.names() if name.endswith("_blocks")}

    def names(self) -> list[str]:
        return [name.removesuffix("_blocks") if name.removesuffix("_blocks") in self._blocks else name
                for name in self.base.names()
                if not (name.endswith("_scales") and name.removesuffix("_scales") in self._blocks)]

    def has(self, name: str) -> bool:
        return name in self._blocks or self.base.has(name)

    def qtype(self, name: str) -> str:
        return self.q.label if name in self._blocks else "safetensors"

    def shape(self, name: str) -> list[int]:
        if name not in self._blocks:
            return self.base.shape(name)
        *lead, outputs, groups, _ = self.base.shape(name + "_blocks")
        return [*lead, groups * mxfp4.BLOCK, outputs]

    def read(self, name: str) -> torch.Tensor:
        return self.base.read(name) if name not in self._blocks else self._expanded(name, None)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self._blocks:
            return self.base.read_rows(name, start, stop)
        return self._expanded(name, (start, stop))

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self._blocks:
            return self.base.read_cols(name, start, stop)
        return self._expanded(name, None)[:, start:stop]

    def read_mxfp4(self, name: str, index: int) -> quant.Mxfp4Weight | None:
        """Matrix ``index`` of ``name``'s first dimension (one expert) as stored, ``[outputs, inputs]``: the
        transpose of what ``read_rows`` expands. None where ``name`` is not stored in MXFP4."""
        if name not in self._blocks:
            return None
        read = lambda n: self.base.read_rows(n, index, index + 1)[0]  # noqa: E731
        return quant.Mxfp4Weight.from_blocks(read(name + "_blocks"), read(name + "_scales"))

    def _expanded(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """``name``'s stored ``[..., outputs, inputs / 32, 16]`` blocks (rows of the first dimension only, where
        given) as ``[..., inputs, outputs]``."""
        read = self.base.read if rows is None else lambda n: self.base.read_rows(n, *rows)
        return mxfp4.dequantize(read(name + "_blocks"), read(name + "_scales")).transpose(-1, -2)
