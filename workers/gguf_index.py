"""A GGUF file's header in one pass: its metadata, decoded when asked for, and its tensors as views of one
memory map, laid out as ``gguf.GGUFReader`` lays them out.

GGUFReader builds numpy views of every part of every metadata value when it opens a file: for SmolLM2's
tokenizer (49k tokens, 48k merges) that is two seconds before the first weight is read, and more for larger
vocabularies, on every rank at every start. A rank reads a handful of numbers from the metadata (the
architecture, the head counts, the file type), so here the values are walked past and decoded only when
read. The tensors keep GGUFReader's dtypes and shapes (bytes ``[rows, bytes per row]`` for quantized types,
innermost dimension last), so ``gguf.quants`` dequantizes them alike, and the supervisor, which converts
the tokenizer once per file, keeps GGUFReader itself. Files in the other byte order, or of GGUF version 1,
go to GGUFReader too.
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUFValueType -> struct format of a scalar (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4


class GGUFHeaderError(ValueError):
    """The header cannot be walked: a damaged or truncated file."""


@dataclass(frozen=True, slots=True)
class IndexedField:
    """One metadata value, decoded by ``contents()`` (what ``gguf.ReaderField.contents()`` gives: a number,
    a string or a list)."""

    buffer: Any
    offset: int  # where the value starts (after its key and type)
    value_type: int

    def contents(self) -> Any:
        return _value(self.buffer, self.offset, self.value_type, keep=True)[0]


@dataclass(frozen=True, slots=True)
class IndexedTensor:
    """A tensor's table entry and its data, with the attributes of ``gguf.ReaderTensor`` read in llmbus."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dimensions, innermost first, as GGUF lists them
    n_elements: int
    n_bytes: int
    data: np.ndarray  # a view of the file, shaped as GGUFReader shapes it


class GGUFIndex:
    """``fields`` (name -> ``IndexedField``) and ``tensors`` (``IndexedTensor``, in the file's order)."""

    def __init__(self, path: str | Path):
        import gguf

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buffer = memoryview(self._map)
        try:
            offset, tensor_count, kv_count = _preamble(buffer)
            self.fields: dict[str, IndexedField] = {}
            for _ in range(kv_count):
                key, offset = _string(buffer, offset, keep=True)
                (value_type,), offset = _unpack(buffer, offset, "<I")
                self.fields[key] = IndexedField(buffer, offset, value_type)
                _, offset = _value(buffer, offset, value_type, keep=False)
            table = []
            for _ in range(tensor_count):
                name, offset = _string(buffer, offset, keep=True)
                (n_dims,), offset = _unpack(buffer, offset, "<I")
                dims, offset = _unpack(buffer, offset, f"<{n_dims}Q")
                (raw_type, data_offset), offset = _unpack(buffer, offset, "<IQ")
                table.append((name, dims, raw_type, data_offset))
            alignment = self._alignment()
            data_start = -(-offset // alignment) * alignment
            self.tensors = [_tensor(buffer, gguf, data_start, *entry) for entry in table]
        except (struct.error, UnicodeDecodeError, KeyError) as e:
            raise GGUFHeaderError(f"{type(e).__name__}: {e}") from None
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFHeaderError("a tensor name appears twice")

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return _DEFAULT_ALIGNMENT
        alignment = field.contents()
        if field.value_type != _UINT32 or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFHeaderError(f"general.alignment {alignment!r} is not a power of two (uint32)")
        return alignment


def readable_here(path: str | Path) -> bool:
    """Whether ``GGUFIndex`` reads the file: GGUF version 2 or 3, in this (little-endian) machine's order."""
    with open(path, "rb") as f:
        head = f.read(8)
    return (sys.byteorder == "little" and len(head) == 8 and head[:4] == _MAGIC
            and struct.unpack("<I", head[4:])[0] in (2, 3))


def _preamble(buffer) -> tuple[int, int, int]:
    if bytes(buffer[:4]) != _MAGIC:
        raise GGUFHeaderError("no GGUF magic")
    (_version, tensor_count, kv_count), offset = _unpack(buffer, 4, "<IQQ")
    return offset, tensor_count, kv_count


def _unpack(buffer, offset: int, fmt: str) -> tuple[tuple, int]:
    return struct.unpack_from(fmt, buffer, offset), offset + struct.calcsize(fmt)


def _string(buffer, offset: int, keep: bool) -> tuple[str | None, int]:
    (length,), offset = _unpack(buffer, offset, "<Q")
    if offset + length > len(buffer):
        raise GGUFHeaderError("a string runs past the end of the file")
    return (str(buffer[offset:offset + length], "utf-8") if keep else None), offset + length


def _value(buffer, offset: int, value_type: int, keep: bool) -> tuple[Any, int]:
    """The value at ``offset`` (None unless ``keep``) and the offset after it."""
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        (value,), end = _unpack(buffer, offset, fmt)
        return value, end
    if value_type == _STRING:
        return _string(buffer, offset, keep)
    if value_type != _ARRAY:
        raise GGUFHeaderError(f"unknown metadata value type {value_type}")
    (item_type, count), offset = _unpack(buffer, offset, "<IQ")
    if item_type in _SCALARS:
        size = struct.calcsize(_SCALARS[item_type])
        end = offset + size * count
        if end > len(buffer):
            raise GGUFHeaderError("an array runs past the end of the file")
        if not keep:
            return None, end
        return list(struct.unpack_from(f"<{count}{_SCALARS[item_type][1]}", buffer, offset)), end
    items = []
    for _ in range(count):
        item, offset = _value(buffer, offset, item_type, keep)
        if keep:
            items.append(item)
    return (items if keep else None), offset


def _tensor(buffer, gguf, data_start: int, name: str, dims: tuple[int, ...], raw_type: int,
            data_offset: int) -> IndexedTensor:
    tensor_type = gguf.GGMLQuantizationType(raw_type)
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    n_bytes = n_elements * type_size // block_size
    shape = tuple(reversed(dims))
    item = _PLAIN_ITEMS.get(tensor_type.name)
    if item is None:  # quantized (and BF16): bytes, a row of blocks per row
        item, shape = np.uint8, gguf.quants.quant_shape_to_byte_shape(shape, tensor_type)
    start = data_start + data_offset
    if start + n_bytes > len(buffer):
        raise GGUFHeaderError(f"tensor {name} runs past the end of the file (truncated)")
    data = np.frombuffer(buffer, dtype=item, count=n_bytes // np.dtype(item).itemsize, offset=start).reshape(shape)
    return IndexedTensor(name, tensor_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, data)


_PLAIN_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
