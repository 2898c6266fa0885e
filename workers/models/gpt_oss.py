"""gpt-oss (``model_type`` gpt_oss) on the native decoder of ``llama.py``, sharded over ``--gpus N``.

What differs from Llama, as transformers' GptOssForCausalLM computes it:

- attention has biases on all four projections and one learned sink logit per query head
  (``self_attn.sinks``), which the attention backend adds to each row's softmax; each rank holds its query
  heads' sinks (``LlamaForCausalLM.build_attention`` reads them, as any bias, where the checkpoint has them).
  Sliding (128) and full layers alternate (``layer_types``: ``llama._sliding_windows``); RoPE is YaRN;
- the MLP is a mixture of experts (``moe.GptOssMoE``, built by ``moe.build_sparse_moe`` as Mixtral's are from
  ``moe.MoEConfig``): the router has a bias and its top ``k`` logits are
  softmaxed (the same weights as renormalising the top ``k`` of a softmax over all); each expert's gate and up
  projections have biases and are stored interleaved in one ``[experts, hidden, 2 * width]`` tensor
  (``gate_up_proj``: gate in the even columns, up in the odd), its down projection ``[experts, width, hidden]``
  with a bias; the gate is gpt-oss's clamped SwiGLU: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``,
  ``g = min(gate, 7)``;
- the experts are published in MXFP4 (``X_blocks``/``X_scales``), which the checkpoint's reader expands
  (``prequantized_checkpoint.Mxfp4CheckpointReader``), or as floats. Where the builder keeps quantized
  weights (bfloat16 on CPU), ``read_quantized`` gives each expert's projections as ``quant.Mxfp4Weight``
  instead, the stored codes and scales, which integer_products.c multiplies as integers.

``GptOssReader`` shows the experts to ``WeightBuilder`` as per-expert projections under Mixtral-like names, so
tensor parallelism splits each expert's width as it splits any MLP's, and one expert at a time is read (and
expanded) from the checkpoint. A reader that has those names itself (a GGUF file's: llama.cpp stores gate and
up apart) is passed through. The layers run in torch (the fused CPU decode layer computes Llama's layer):
what this class adds to Llama's is the reader and that.
"""

from __future__ import annotations

import torch

from llmbus.workers.models.llama import LlamaForCausalLM

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


class GptOssReader:
    """A checkpoint reader that shows each layer's experts as ``mlp.experts.<e>.<gate_proj|up_proj|down_proj>``
    ``.weight``/``.bias`` (``[width, hidden]``, ``[hidden, width]``), read from the stored ``gate_up_proj`` /
    ``down_proj`` one expert at a time; every other name is the wrapped reader's."""

    def __init__(self, reader):
        self.reader = reader
        # the last expert read of a stored tensor, expanded or as MXFP4: (form, name, expert, what was read)
        self._cached: tuple[str, str, int, object] | None = None

    def __enter__(self) -> "GptOssReader":
        return self

    def __exit__(self, *exc) -> None:
        pass  # the wrapped reader is closed by whoever opened it

    def _split(self, name: str) -> tuple[str, int, str, str] | None:
        """(the layer's experts prefix, expert, part, "weight" | "bias") of a shown expert name the wrapped
        reader does not have, else None."""
        if self.reader.has(name):
            return None
        head, sep, rest = name.partition("mlp.experts.")
        pieces = rest.split(".")
        if not sep or len(pieces) != 3 or not pieces[0].isdigit() or pieces[1] not in EXPERT_PARTS:
            return None
        return head + "mlp.experts.", int(pieces[0]), pieces[1], pieces[2]

    def _stored_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert`` of the stored 3-D tensor ``name`` (``[hidden, 2 * width]`` or ``[width, hidden]``);
        the last one read is kept (gate and up share it, and an MXFP4 expert is expanded once)."""
        return self._last("float", name, expert, lambda: self.reader.read_rows(name, expert, expert + 1)[0])

    def _last(self, form: str, name: str, expert: int, read):
        """``read()``, or what it gave for the same expert last time (gate and up share one stored tensor)."""
        if self._cached is None or self._cached[:3] != (form, name, expert):
            self._cached = (form, name, expert, read())
        return self._cached[3]

    def _expert(self, prefix: str, expert: int, part: str, kind: str) -> torch.Tensor:
        if part == "down_proj":
            if kind == "bias":
                return self.reader.read_rows(prefix + "down_proj_bias", expert, expert + 1)[0]
            return self._stored_expert(prefix + "down_proj", expert).T  # [hidden, width]
        column = 0 if part == "gate_proj" else 1  # interleaved: gate in the even columns, up in the odd
        if kind == "bias":
            return self.reader.read_rows(prefix + "gate_up_proj_bias", expert, expert + 1)[0][column::2]
        return self._stored_expert(prefix + "gate_up_proj", expert)[:, column::2].T  # [width, hidden]

    def read_quantized(self, name: str, rows: tuple[int, int] | None = None,
                       cols: tuple[int, int] | None = None):
        """An expert's projection (its rows and columns) as ``quant.Mxfp4Weight`` where the checkpoint stores it
        in MXFP4, else None (the builder then reads floats); any other name as the wrapped reader gives it."""
        split = self._split(name)
        if split is None:
            read_quantized = getattr(self.reader, "read_quantized", None)
            return None if read_quantized is None else read_quantized(name, rows, cols)
        prefix, expert, part, kind = split
        read_mxfp4 = getattr(self.reader, "read_mxfp4", None)
        if kind != "weight" or read_mxfp4 is None:
            return None
        stored = prefix + ("down_proj" if part == "down_proj" else "gate_up_proj")
        weight = self._last("mxfp4", stored, expert, lambda: read_mxfp4(stored, expert))  # [outputs, inputs]
        if weight is None:
            return None
        if part != "down_proj":
            weight = weight.rows(slice(0 if part == "gate_proj" else 1, None, 2))
        if rows is not None:
            weight = weight.rows(slice(*rows))
        return weight if cols is None else weight.cols(*cols)

    def has(self, name: str) -> bool:
        split = self._split(name)
        if split is None:
            return self.reader.has(name)
        prefix, _, part, kind = split
        stored = prefix + ("down_proj" if part == "down_proj" else "gate_up_proj")
        return self.reader.has(stored + "_bias" if kind == "bias" else stored)

    def names(self) -> list[str]:
        return self.reader.names()

    def shape(self, name: str) -> list[int]:
        split = self._split(name)
        return self.reader.shape(name) if split is None else list(self._expert(*split).shape)

    def read(self, name: str) -> torch.Tensor:
        split = self._split(name)
        return self.reader.read(name) if split is None else self._expert(*split).contiguous()

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        split = self._split(name)
        return self.reader.read_rows(name, start, stop) if split is None else self._expert(*split)[start:stop]

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        split = self._split(name)
        return self.reader.read_cols(name, start, stop) if split is None else self._expert(*split)[:, start:stop]

    def qtype(self, name: str) -> str:
        """How ``name`` is stored, for the startup log's ``weights`` line: as the wrapped reader says of the
        tensor it comes from."""
        qtype = getattr(self.reader, "qtype", None)
        split = self._split(name)
        if split is not None:
            name = split[0] + ("down_proj" if split[2] == "down_proj" else "gate_up_proj")
        return qtype(name) if qtype is not None else "safetensors"


class GptOssForCausalLM(LlamaForCausalLM):
    FUSED_DECODE = False

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, **kwargs) -> "GptOssForCausalLM":
        return super().from_checkpoint(hf_config, GptOssReader(reader), **kwargs)
