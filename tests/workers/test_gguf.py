"""GGUF files: the model folder made from one, its weights read by Hugging Face names (against transformers'
own reading of the same file), the raw quantized blocks, the committed K-quant fixture, and clear errors
for files llmbus cannot serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmbus.supervisor.gguf_model import materialize
from llmbus.supervisor.weights import ModelNotFound, resolve_model
from llmbus.testing.gguf_files import transformers_reads_cached, write_gguf
from llmbus.workers import quant
from llmbus.workers.gguf_checkpoint import GGUFCheckpointReader, GGUFError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gguf"
K_QUANT_FIXTURE = FIXTURES / "tiny-q4_k_m.gguf"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
PROMPTS = ("Hello world, the capital of France is Paris.", "  spaces\tand\nnewlines 123 ünïcödé", "")


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Folders made from GGUFs go to this module's own cache (never the user's)."""
    old = os.environ.get("LLMBUS_CACHE")
    os.environ["LLMBUS_CACHE"] = str(tmp_path_factory.mktemp("llmbus-cache"))
    import llmbus.supervisor.gguf_model as gguf_model

    saved = gguf_model.CACHE_ROOT
    gguf_model.CACHE_ROOT = Path(os.environ["LLMBUS_CACHE"]) / "gguf"
    yield
    gguf_model.CACHE_ROOT = saved
    if old is None:
        os.environ.pop("LLMBUS_CACHE", None)
    else:
        os.environ["LLMBUS_CACHE"] = old


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("gguf")
    for kind in TYPES:
        write_gguf(tiny_model_dir, out / f"tiny-{kind}.gguf", kind)
    return out


def transformers_state(path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    with transformers_reads_cached():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("kind", TYPES)
def test_weights_equal_transformers_reading(kind, gguf_dir):
    path = gguf_dir / f"tiny-{kind}.gguf"
    expected = transformers_state(path)
    with GGUFCheckpointReader(path) as reader:
        assert set(reader.names()) == set(expected)
        for name in reader.names():
            assert torch.equal(reader.read(name), expected[name]), name
        q = "model.layers.1.self_attn.q_proj.weight"  # interleaved heads in the file: rows of heads 1-2
        assert torch.equal(reader.read_rows(q, 32, 96), expected[q][32:96])
        down = "model.layers.2.mlp.down_proj.weight"
        assert torch.equal(reader.read_cols(down, 160, 352), expected[down][:, 160:352])


@pytest.mark.parametrize("kind", ("Q4_0", "Q4_1", "Q8_0"))
def test_raw_blocks_become_quantized_weights(kind, gguf_dir):
    with GGUFCheckpointReader(gguf_dir / f"tiny-{kind}.gguf") as reader:
        name = "model.layers.0.self_attn.k_proj.weight"
        weight = reader.read_quantized(name, rows=(32, 64), cols=(32, 96))
        assert reader.qtype(name) == kind and weight.shape == (32, 64)
        expected = reader.read(name)[32:64, 32:96]
        # the file's own values and scales: Q8_0 as int8 in groups of 32, Q4_0/Q4_1 as int4
        assert isinstance(weight, quant.Int8Weight if kind == "Q8_0" else quant.Int4Weight)
        torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=1e-6)
        assert reader.read_quantized("model.layers.0.input_layernorm.weight") is None


def test_column_slices_off_the_blocks_are_left_to_expand(gguf_dir):
    with GGUFCheckpointReader(gguf_dir / "tiny-Q4_0.gguf") as reader:
        assert reader.read_quantized("model.layers.0.mlp.down_proj.weight", cols=(0, 176)) is None


def test_k_quant_blocks_become_quantized_weights():
    """llama.cpp's Q4_K becomes int4 in groups of 32 (each sub-block's scale, minus its min) and Q6_K int8 in
    groups of 16, holding the file's values exactly: whole, and as a rank's rows and whole super-blocks of
    columns; columns off a super-block (256 weights) are left to be expanded."""
    with GGUFCheckpointReader(K_QUANT_FIXTURE) as reader:
        for name in reader.names():
            kind = reader.qtype(name)
            if kind in ("Q4_K", "Q6_K"):
                weight = reader.read_quantized(name)
                assert isinstance(weight, quant.Int4Weight if kind == "Q4_K" else quant.Int8Weight), name
                assert weight.group == (32 if kind == "Q4_K" else 16)
                assert torch.equal(weight.dequantize(), reader.read(name)), name
        for layer, kind in ((0, "Q4_K"), (1, "Q6_K")):
            name = f"model.layers.{layer}.mlp.down_proj.weight"  # [256, 512]
            assert reader.qtype(name) == kind
            part = reader.read_quantized(name, rows=(8, 24), cols=(256, 512))
            assert torch.equal(part.dequantize(), reader.read(name)[8:24, 256:512]), kind
            assert reader.read_quantized(name, cols=(0, 128)) is None


def test_model_folder_has_config_tokenizer_and_template(gguf_dir, tiny_model_dir):
    from tokenizers import Tokenizer

    folder = materialize(gguf_dir / "tiny-Q4_1.gguf")
    assert materialize(gguf_dir / "tiny-Q4_1.gguf") == folder  # built once
    config, original = (json.loads((d / "config.json").read_text()) for d in (folder, tiny_model_dir))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert config[key] == pytest.approx(original[key], rel=1e-6), key  # GGUF stores float32
    assert config["model_type"] == "llama" and not config.get("tie_word_embeddings")
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (folder, tiny_model_dir))
    for text in PROMPTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
    template = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert (folder / "chat_template.jinja").read_text() == template
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert theirs.token_to_id("</s>") in eos
    manifest = json.loads((folder / "gguf.json").read_text())
    assert manifest["tensor_types"] == {"F32": 9, "Q4_1": 30} and manifest["architecture"] == "llama"


def test_a_cached_folder_is_found_without_importing_torch(gguf_dir):
    """`llmbus up` on a GGUF it has served before (the default model, every start after the first) finds the
    folder without importing the file reader's torch, 2 s of each start's CPU."""
    path = gguf_dir / "tiny-Q4_1.gguf"
    folder = materialize(path)
    code = ("import sys; from llmbus.supervisor.gguf_model import materialize; "
            f"print(materialize({str(path)!r}), 'torch' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert found == [str(folder), "False"]


def test_k_quant_fixture_reads_as_transformers_reads_it():
    with GGUFCheckpointReader(K_QUANT_FIXTURE) as reader:
        types = {reader.qtype(n) for n in reader.names()}
        assert {"Q4_K", "Q6_K"} <= types, types
        expected = transformers_state(K_QUANT_FIXTURE)
        for name in reader.names():
            assert torch.equal(reader.read(name), expected[name]), name


def _rewrite(tiny_model_dir, out: Path, *, raw_types: dict | None = None, fields: dict | None = None,
             tensors: dict | None = None) -> Path:
    """The tiny model as an F32 GGUF, then changed: ``raw_types`` stores a tensor as another type (zero
    bytes of the right length), ``fields`` adds metadata (name -> (value, GGUFValueType)), ``tensors`` adds
    float32 tensors."""
    write_gguf(tiny_model_dir, out, "F32")
    reader = gguf.GGUFReader(str(out))
    writer = gguf.GGUFWriter(str(out) + ".tmp", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for name, (value, value_type) in (fields or {}).items():
        writer.add_key_value(name, value, value_type)
    for t in reader.tensors:
        qtype = (raw_types or {}).get(t.name)
        if qtype is not None:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            writer.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data))
    for name, values in (tensors or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return out


def test_unknown_tensor_type_is_one_clear_error(tiny_model_dir, tmp_path):
    path = _rewrite(tiny_model_dir, tmp_path / "iq.gguf",
                    raw_types={"blk.0.ffn_down.weight": gguf.GGMLQuantizationType.IQ4_NL})
    with pytest.raises(ModelNotFound, match=r"tensor blk\.0\.ffn_down\.weight has type IQ4_NL"):
        resolve_model(str(path))


def test_unsupported_architecture_is_one_clear_error(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir, tmp_path / "starcoder2.gguf", "F32", architecture="starcoder2")
    with pytest.raises(ModelNotFound, match=r"architecture 'starcoder2' is not supported \(supported: llama"):
        resolve_model(str(path))


def test_corrupt_and_truncated_files_are_clear_errors(gguf_dir, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    whole = (gguf_dir / "tiny-F16.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    for path in (corrupt, truncated, tmp_path / "missing.gguf"):
        with pytest.raises(ModelNotFound, match=str(path.name)):
            resolve_model(str(path))


def test_up_refuses_a_bad_gguf_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    result = subprocess.run([sys.executable, "-m", "llmbus.supervisor", "up", "--model-id", str(bad),
                             "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LLMBUS_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert "bad.gguf: not a readable GGUF file" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_qwen2_files_are_read_without_the_llama_interleave(tiny_model_dir, tmp_path):
    """llama.cpp interleaves query/key rows only in Llama-architecture files; a qwen2 file keeps HF order."""
    path = write_gguf(tiny_model_dir, tmp_path / "tiny-qwen2.gguf", "Q8_0", architecture="qwen2")
    expected = transformers_state(path)
    folder = materialize(path)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    with GGUFCheckpointReader(path) as reader:
        for name in reader.names():
            assert torch.equal(reader.read(name), expected[name]), name


def _llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float, context: int):
    """rope_freqs.weight as llama.cpp's converter computes it for a Llama 3.1-style rope_scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blended))


@pytest.mark.parametrize("scaling", [(8.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096)])
def test_llama3_rope_factors_become_the_configs_rope_scaling(scaling, tiny_model_dir, tmp_path):
    """Llama 3.1/3.2 files carry their RoPE scaling only as rope_freqs.weight (transformers' GGUF reading
    drops it): the folder's config must make llmbus's rotary embedding divide each frequency by it."""
    from transformers import AutoConfig

    from llmbus.workers.models.llama import DecoderConfig, RotaryEmbedding

    head_dim, theta = 32, 10000.0
    factors = _llama3_rope_factors(head_dim, theta, *scaling)
    path = _rewrite(tiny_model_dir, tmp_path / "llama3.gguf", tensors={"rope_freqs.weight": factors})
    folder = materialize(path)
    decoder = DecoderConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert decoder.rope_scaling["rope_type"] == "llama3"
    rotary = RotaryEmbedding(decoder.head_dim, decoder.rope_theta, decoder.rope_scaling, 2048, torch.device("cpu"))
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(rotary.inv_freq.double(), plain / torch.from_numpy(factors), rtol=1e-5, atol=0)
    assert AutoConfig.from_pretrained(folder).rope_parameters["rope_type"] == "llama3"  # transformers agrees
    with GGUFCheckpointReader(path) as reader:
        assert "rope_freqs.weight" not in " ".join(reader.names())


def test_rope_scaling_metadata(tiny_model_dir, tmp_path):
    string, number = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32
    linear = _rewrite(tiny_model_dir, tmp_path / "linear.gguf", fields={
        "llama.rope.scaling.type": ("linear", string), "llama.rope.scaling.factor": (4.0, number)})
    config = json.loads((materialize(linear) / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}
    yarn = _rewrite(tiny_model_dir, tmp_path / "yarn.gguf", fields={
        "llama.rope.scaling.type": ("yarn", string), "llama.rope.scaling.factor": (4.0, number)})
    with pytest.raises(ModelNotFound, match=r"yarn.gguf: RoPE scaling 'yarn' is not supported"):
        resolve_model(str(yarn))


def _same_as_gguf_reader(path: Path) -> int:
    """GGUFIndex against gguf.GGUFReader on one file: every metadata value, the tensor table, and each
    tensor's data view (dtype, shape, bytes); returns the number of tensors compared."""
    from llmbus.workers.gguf_index import GGUFIndex

    index, reader = GGUFIndex(path), gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # GGUFReader's own header entries
    assert list(index.fields) == keys
    assert all(index.fields[k].contents() == reader.fields[k].contents() for k in keys)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert (ours.tensor_type, list(ours.shape), ours.n_elements, ours.n_bytes) == (
            theirs.tensor_type, list(theirs.shape), theirs.n_elements, theirs.n_bytes), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name
    return len(index.tensors)


def test_the_ranks_header_index_reads_what_gguf_reads(gguf_dir):
    """Every tensor type's file, the K-quant fixture and SmolLM2's (49k-token tokenizer arrays of strings
    and numbers, a Q8_0 embedding beside Q4_1 matrices)."""
    from llmbus.supervisor.weights import smollm2_gguf

    files = [gguf_dir / f"tiny-{kind}.gguf" for kind in TYPES] + [K_QUANT_FIXTURE]
    if smollm2_gguf() is not None:
        files.append(Path(smollm2_gguf()))
    assert all(_same_as_gguf_reader(path) > 0 for path in files)


def test_a_rank_given_a_damaged_file_names_it(gguf_dir, tmp_path):
    whole = (gguf_dir / "tiny-Q8_0.gguf").read_bytes()
    for name, data in (("truncated.gguf", whole[: len(whole) - 100]), ("header-cut.gguf", whole[:300]),
                       ("corrupt.gguf", b"GGUF\x03\x00\x00\x00" + os.urandom(4096))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFError, match=f"{name}: not a readable GGUF file"):
            GGUFCheckpointReader(tmp_path / name)
