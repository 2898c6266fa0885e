"""workers/gguf_dequant.py against gguf-py's numpy dequantizer, bit for bit: on blocks gguf-py quantized, on
random blocks (every code and bit pattern, finite scales), on the committed K-quant fixture and on SmolLM2's
GGUF; and GGUFCheckpointReader reading through it."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmbus.workers import gguf_dequant
from llmbus.workers.gguf_checkpoint import SUPPORTED_TYPES, GGUFCheckpointReader

K_QUANT_FIXTURE = Path(__file__).parents[1] / "fixtures" / "gguf" / "tiny-q4_k_m.gguf"
QUANTIZED = tuple(t for t in SUPPORTED_TYPES if t not in ("F32", "F16"))
# byte offsets of each type's float16 fields in a block: random bytes there could be NaN or inf, whose
# products say nothing about the formulas
HALF_FIELDS = {"BF16": (), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}


def reference(data: np.ndarray, type_name: str) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same float32 values to the bit (NaN payloads and the sign of zero included)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert got.is_contiguous()
    same = got.contiguous().view(torch.int32) == want.contiguous().view(torch.int32)
    if not bool(same.all()):
        where = torch.nonzero(~same)[0].tolist()
        raise AssertionError(f"{int((~same).sum())} of {same.numel()} differ, first at {where}: "
                             f"{got[tuple(where)].item()!r} != {want[tuple(where)].item()!r}")


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        half = (rng.standard_normal((rows, cols // block_size)) * 0.05).astype(np.float16)
        blocks[..., offset:offset + 2] = half.view(np.uint8).reshape(rows, cols // block_size, 2)
    data = blocks.reshape(rows, -1)
    data.flags.writeable = False  # as the file's memory map gives them
    return data


def test_every_quantized_type_is_implemented():
    assert set(QUANTIZED) <= set(gguf_dequant.IMPLEMENTED)
    assert set(HALF_FIELDS) == set(QUANTIZED)


@pytest.mark.parametrize("type_name", QUANTIZED)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_random_blocks(type_name, rows):
    data = random_blocks(type_name, rows, 1024, seed=rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning from torch
        got = gguf_dequant.dequantize(data, type_name)
    assert_same_bits(got, reference(data, type_name))


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_one_dimensional_and_chunked(type_name, monkeypatch):
    """A vector (norms, biases) and a tensor cut into several slices of blocks come out alike."""
    vector = random_blocks(type_name, 1, 512, seed=7)[0]
    assert_same_bits(gguf_dequant.dequantize(vector, type_name), reference(vector, type_name))
    monkeypatch.setattr(gguf_dequant, "_CHUNK_WEIGHTS", 768)  # not a multiple of any row
    data = random_blocks(type_name, 5, 2048, seed=8)
    assert_same_bits(gguf_dequant.dequantize(data, type_name), reference(data, type_name))


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_blocks_gguf_py_quantized(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    weights = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    weights[0] = 0.0  # an all-zero row: zero scales
    try:
        data = gguf.quants.quantize(weights, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf-py cannot quantize {type_name}")
    got = gguf_dequant.dequantize(data, type_name)
    assert_same_bits(got, reference(data, type_name))
    # and it is the weights, roughly (gguf-py's MXFP4 takes the block's power of two below its largest weight:
    # the top of a block is cut to 1.5 times it, up to 0.8 off for standard normal weights)
    assert torch.allclose(got, torch.from_numpy(weights), atol=1.0 if type_name == "MXFP4" else 0.5)


def test_bf16_bit_patterns():
    """Every bfloat16 bit pattern, NaNs and infinities included."""
    data = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(64, -1)
    assert_same_bits(gguf_dequant.dequantize(data, "BF16"), reference(data, "BF16"))


@pytest.mark.parametrize("type_name", ["F32", "F16"])
def test_plain_types_are_casts(type_name):
    data = np.random.default_rng(4).standard_normal((3, 64)).astype(type_name.lower().replace("f", "float"))
    data.flags.writeable = False
    got = gguf_dequant.dequantize(data, type_name)
    assert_same_bits(got, torch.from_numpy(data.astype(np.float32)))
    got.add_(1)  # its own memory, not the (read-only) file's


def gguf_files() -> list[Path]:
    from llmbus.supervisor.weights import smollm2_gguf

    files = [K_QUANT_FIXTURE]
    if smollm2_gguf() is not None:
        files.append(Path(smollm2_gguf()))
    return files


@pytest.mark.parametrize("path", gguf_files(), ids=lambda p: p.name)
def test_every_tensor_of_real_files(path):
    reader = gguf.GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name in ("F32", "F16"):
            continue
        seen.add(type_name)
        assert_same_bits(gguf_dequant.dequantize(t.data, type_name), reference(t.data, type_name))
    assert seen  # the file holds quantized tensors at all


def test_checkpoint_reader_reads_through_it():
    """GGUFCheckpointReader's rows and column blocks are gguf-py's values (Q4_K and Q6_K here)."""
    reader = gguf.GGUFReader(str(K_QUANT_FIXTURE))
    with GGUFCheckpointReader(K_QUANT_FIXTURE) as ckpt:
        for t in reader.tensors:
            if t.name != "token_embd.weight":
                continue
            want = reference(t.data, t.tensor_type.name)
            name = "model.embed_tokens.weight"
            assert_same_bits(ckpt.read(name), want)
            assert_same_bits(ckpt.read_rows(name, 1, 3), want[1:3].contiguous())
            cols = want.shape[1]
            assert_same_bits(ckpt.read_cols(name, 0, cols // 2), want[:, :cols // 2].contiguous())
