"""Reading a local Hugging Face model folder: ``config.json`` and ``*.safetensors``.

Each rank reads only its own slices through ``safe_open(...).get_slice(name)[...]``: a tensor-parallel
rank never materialises a full sharded weight. Both a single ``model.safetensors`` and a sharded
``model.safetensors.index.json`` are handled. Which weights are sliced along which dimension is the
model's business (see ``models/llama.py``, which serves the ``model_type``s llama, mistral, qwen2, qwen3,
mixtral, qwen3_moe and phi3, and ``models/gemma3.py`` gemma3_text and gemma3's text model);
this module only reads.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import structlog
import torch
from safetensors import safe_open

from llmbus.bus.model_files import lone_safetensors, with_rope_override
from llmbus.bus.prequantized import (CHECKPOINT_METHODS, CheckpointQuantization, checkpoint_quantization,
                                     quantize_problem)
from llmbus.workers.quant import compute_plan

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


class MissingWeight(KeyError):
    """A tensor a model needs that its checkpoint does not hold; the message names both."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointReader:
    """Name -> tensor access over a folder's safetensors files, reading slices only.

    Use as a context manager: files are opened lazily and closed on exit.
    """

    def __init__(self, model_dir: str, device: torch.device | str = "cpu"):
        self.model_dir = model_dir
        self.device = str(device)
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                self._file_of: dict[str, str] = json.load(f)["weight_map"]
        else:
            single = os.path.exists(os.path.join(model_dir, SINGLE_FILE))
            files = [SINGLE_FILE] if single else lone_safetensors(model_dir)
            if not files:
                raise FileNotFoundError(f"{model_dir}: no safetensors weights ({SINGLE_FILE}, {INDEX_FILE} or another "
                                        f"*.safetensors file)")
            self._file_of = {}
            for file_name in files:
                with safe_open(os.path.join(model_dir, file_name), framework="pt") as f:
                    for name in f.keys():
                        if name in self._file_of:  # two alternative uploads side by side (4-bit and 8-bit)
                            raise ValueError(f"{model_dir}: {name} is in both {self._file_of[name]} and {file_name}: "
                                             f"keep one model's weights in the folder")
                        self._file_of[name] = file_name
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise MissingWeight(f"{self.model_dir}: weight {name!r} not in the checkpoint")
        file_name = self._file_of[name]
        handle = self._handles.get(file_name)
        if handle is None:
            handle = self._stack.enter_context(
                safe_open(os.path.join(self.model_dir, file_name), framework="pt", device=self.device))
            self._handles[file_name] = handle
        return handle.get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """How ``name`` is stored, in safetensors' words ("BF16", "F8_E4M3", ...), without reading it."""
        return self._slice(name).get_dtype()

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor: for replicated weights (norms, unsharded layers)."""
        return self._slice(name)[:]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dimension 0 (column-parallel weights, biases, vocab shards)."""
        return self._slice(name)[start:stop]

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of dimension 1 (row-parallel weights)."""
        return self._slice(name)[:, start:stop]


def native_builders() -> dict[str, type]:
    """``model_type`` -> the native model class that serves it (benchmarks/families.py empties it to time
    the fallback on the same checkpoints)."""
    from llmbus.workers.models import gemma3, gpt_oss, llama, llava, qwen2_vl

    llama_family = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3")
    gemma3_family = ("gemma3_text", "gemma3")  # gemma3: the text model of the multimodal checkpoint
    return ({name: llama.LlamaForCausalLM for name in llama_family}
            | {name: gemma3.Gemma3ForCausalLM for name in gemma3_family}
            | {"gemma2": gemma3.Gemma2ForCausalLM, "gpt_oss": gpt_oss.GptOssForCausalLM}
            | {"llava": llava.LlavaForConditionalGeneration,  # a decoder above, with a vision tower
               "llava_next": llava.LlavaNextForConditionalGeneration,
               "qwen2_vl": qwen2_vl.Qwen2VLForConditionalGeneration,  # Qwen2's decoder with M-RoPE
               "qwen2_5_vl": qwen2_vl.Qwen2VLForConditionalGeneration})


def load_model(model_dir: str, *, rank: int = 0, world_size: int = 1, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", quantize: str | None = None, trust_remote_code: bool = False,
               attention_backend: str = "auto", rope_scaling: tuple[str, float] | None = None):
    """Build the native model for ``model_dir``'s ``model_type`` with this rank's weight shards; any other
    ``model_type`` gets the transformers fallback (``models/hf_fallback.py``, single rank only).
    ``attention_backend``: a name of ``workers.attention.BACKEND_CLASSES``, or auto (the device's default).
    ``rope_scaling``: TGI's --rope-scaling/--rope-factor, (kind, factor), in place of the config's own
    (``bus.model_files.with_rope_override``)."""
    config = with_rope_override(read_config(model_dir), rope_scaling)
    model_type = config.get("model_type")
    builders = native_builders()
    log = structlog.get_logger("llmbus.workers")
    prequantized = checkpoint_quantization(model_dir)
    problem = quantize_problem(prequantized, quantize)
    if problem is not None:
        raise ValueError(problem)
    if quantize in CHECKPOINT_METHODS:  # TGI's way to say what the checkpoint says: nothing to do at load
        quantize = None
    if prequantized is not None and prequantized.method == "mxfp4" and model_type in builders \
            and model_type != "gpt_oss":
        raise ValueError(f"a {prequantized.method} checkpoint is read for gpt-oss's experts (gpt_oss), not by the "
                         f"native {model_type}")
    if model_type not in builders:
        if prequantized is not None and prequantized.method != "mxfp4":
            raise ValueError(f"a {prequantized.method} checkpoint is read by the native models only "
                             f"({', '.join(sorted(builders))}), not {model_type}")
        if quantize is not None:
            raise ValueError(f"--quantize {quantize} needs a natively run model ({', '.join(sorted(builders))}), "
                             f"not {model_type}")
        # Any other causal LM runs through transformers' modeling code over the same paged KV cache.
        from llmbus.workers.models.hf_fallback import HFFallbackForCausalLM

        log.info("model path", model_type=model_type, path="transformers fallback",
                 native=", ".join(sorted(builders)))
        if torch.device(device).type == "cpu":
            log.warning("batch invariance not promised", why="transformers fallback: torch's kernels")
        model = HFFallbackForCausalLM.from_pretrained(model_dir, model_type=model_type, rank=rank,
                                                      world_size=world_size, dtype=dtype, device=device, log=log,
                                                      trust_remote_code=trust_remote_code,
                                                      attention_backend=attention_backend, rope_scaling=rope_scaling,
                                                      prequantized=prequantized)
        if prequantized is not None:
            log.info("weights", quantize=prequantized.method,
                     formats=f"{prequantized.label} -> {str(dtype).removeprefix('torch.')} (expanded by transformers)")
        return model
    log.info("model path", model_type=model_type, path="native")
    plan = compute_plan(torch.device(device), dtype, quantize)
    with _open_checkpoint(model_dir, prequantized) as reader:
        model = builders[model_type].from_checkpoint(config, reader, rank=rank, world_size=world_size,
                                                     dtype=plan.dtype, device=torch.device(device),
                                                     quantize=plan.form, bf16_inputs=plan.bf16_inputs,
                                                     attention_backend=attention_backend)
    # what was kept quantized, what was quantized or expanded: "210 Q4_1 -> int4 (kept), 61 ..."
    log.info("weights", quantize=quantize or (prequantized and prequantized.method), formats=model.weight_summary,
             activations=str(plan.dtype).removeprefix("torch."))
    fused = getattr(model, "fused_decode", None)
    gap = ("tensor parallel" if world_size > 1 else "no fused decode layer: torch's kernels" if fused is None
           else fused.invariance_gap)
    if torch.device(device).type == "cpu" and gap:  # issue #35 part 4: a step's rows do not change a request's tokens
        log.warning("batch invariance not promised", why=gap)
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Hand the float copies loading went through back to the OS. glibc keeps freed heap memory for
    reuse, so a model quantized at load held on to them, resident at about twice its quantized weights'
    size (design notes, "Freed memory stays in the heap")."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    try:
        ctypes.CDLL(libc_name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _open_checkpoint(model_dir: str, prequantized: CheckpointQuantization | None):
    """The weights of ``model_dir``: its safetensors (a GPTQ/AWQ checkpoint's unpacked, an FP8 one's scaled, an
    MXFP4 one's expanded), or the GGUF file a folder made from one names."""
    from llmbus.bus.model_files import gguf_source, is_gguf_folder
    from llmbus.workers.gguf_checkpoint import GGUFCheckpointReader
    from llmbus.workers.prequantized_checkpoint import (Float8CheckpointReader, Mxfp4CheckpointReader,
                                                        PackedCheckpointReader)

    if is_gguf_folder(model_dir):
        return GGUFCheckpointReader(gguf_source(model_dir)["path"])
    reader = CheckpointReader(model_dir, device="cpu")
    if prequantized is None:
        return reader
    kind = (PackedCheckpointReader if prequantized.packed else
            Mxfp4CheckpointReader if prequantized.method == "mxfp4" else Float8CheckpointReader)
    return kind(reader, prequantized)
