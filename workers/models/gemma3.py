"""Gemma 3 text models (``model_type`` gemma3_text) on the native decoder of ``llama.py``, Gemma 2 beside them
(``Gemma2ForCausalLM``), and the text model inside a multimodal Gemma 3 checkpoint (``model_type`` gemma3 with a
``text_config``: its ``language_model.*`` weights, and its vision side, ``llava.Gemma3Vision``, where the checkpoint
has an image processor (``preprocessor_config.json``; without one it serves text only). An image's placeholders
attend each other both ways (``images_attend_both_ways``: the runner gives their rows key limits,
``vision.image_key_limits``).

What differs from Llama, as transformers' Gemma3ForCausalLM computes it:

- RMSNorm scales by ``1 + weight``, in float32 (``GemmaRMSNorm``); a layer has four of them: before and
  after attention, before and after the MLP (the residual adds the post-normalised output);
- queries and keys get a per-head RMSNorm before RoPE (QK-norm), and attention scales by
  ``query_pre_attn_scalar ** -0.5``;
- sliding (local) and full (global) layers interleave (``layer_types``, or every
  ``sliding_window_pattern``-th layer global); local layers rotate with ``rope_local_base_freq`` and no
  scaling, global ones with ``rope_theta`` and the config's scaling: two cos/sin pairs per step;
- embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype; the MLP is GeGLU
  (``gelu_pytorch_tanh``); logits are soft-capped (``tanh(x / cap) * cap``) when
  ``final_logit_softcapping`` is set.

Gemma 2 is the same decoder without QK-norm, with one RoPE for every layer (local and global alike) and its
attention scores soft-capped (``attn_logit_softcapping``: ``tanh(s / cap) * cap`` before the mask), which the
attention backend applies per layer.

The fused CPU decode layer (decode_layer.c) computes Llama's layer, so Gemma runs the torch layers. Its
attention and MLP are Llama's classes, so LoRA adapters reach them as they reach Llama's (``lora.py``).
Bidirectional attention (not used by Gemma's text models) is refused.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from llmbus.workers.models.llama import (DecoderConfig, LlamaAttention, LlamaForCausalLM, LlamaMLP, TensorParallel,
                                         alternating_layer_types)
from llmbus.workers.models.rotary import RotaryEmbedding
from llmbus.workers.weight_builder import WeightBuilder


class PrefixedReader:
    """A checkpoint reader whose names are another's under ``prefix`` (``model.norm.weight`` read as
    ``language_model.model.norm.weight``). Every access goes through ``stored`` and ``shown``: a reader of
    another renaming overrides those two."""

    def __init__(self, reader, prefix: str):
        self.reader, self.prefix = reader, prefix

    def __enter__(self) -> "PrefixedReader":
        return self

    def __exit__(self, *exc) -> None:
        pass  # the wrapped reader is closed by whoever opened it

    def stored(self, name: str) -> str:
        """The wrapped reader's name of ``name``."""
        return self.prefix + name

    def shown(self, stored: str) -> str | None:
        """The name this reader gives the wrapped reader's ``stored``; None for a tensor it does not show."""
        return stored.removeprefix(self.prefix) if stored.startswith(self.prefix) else None

    def names(self) -> list[str]:
        return [shown for shown in map(self.shown, self.reader.names()) if shown is not None]

    def has(self, name: str) -> bool:
        return self.reader.has(self.stored(name))

    def shape(self, name: str) -> list[int]:
        return self.reader.shape(self.stored(name))

    def read(self, name: str) -> torch.Tensor:
        return self.reader.read(self.stored(name))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.reader.read_rows(self.stored(name), start, stop)

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.reader.read_cols(self.stored(name), start, stop)

    def __getattr__(self, attribute: str):
        """The wrapped reader's optional methods (``qtype``, ``read_quantized``, ``dtype``) by stored name,
        where it has them: a quantized checkpoint's projections stay quantized under the prefix too."""
        if attribute not in ("qtype", "read_quantized", "dtype"):
            raise AttributeError(attribute)
        method = getattr(self.reader, attribute)
        return lambda name, *args, **kwargs: method(self.stored(name), *args, **kwargs)


MULTIMODAL_TEXT_PREFIX = "language_model."  # where a Gemma3ForConditionalGeneration checkpoint keeps its text model


class GemmaRMSNorm:
    """``x / rms(x) * (1 + weight)`` in float32, back in the dtype the model computes in."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # as stored; the scale is 1 + weight
        self.scale = 1.0 + weight.float()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale).to(self.weight.dtype)


class Gemma3DecoderLayer:
    def __init__(self, *, input_norm, attention: LlamaAttention, post_attention_norm, pre_feedforward_norm,
                 mlp: LlamaMLP, post_feedforward_norm, local: bool):
        self.input_norm, self.attention, self.post_attention_norm = input_norm, attention, post_attention_norm
        self.pre_feedforward_norm, self.mlp = pre_feedforward_norm, mlp
        self.post_feedforward_norm = post_feedforward_norm
        self.local = local  # a sliding-window layer, rotated with the local RoPE base

    def __call__(self, hidden, cos, sin, backend, kv_cache, meta):
        attended = self.attention(self.input_norm(hidden), cos, sin, backend, kv_cache, meta)
        hidden = hidden + self.post_attention_norm(attended)
        return hidden + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(hidden)))


def _layer_types(config: dict) -> list[str]:
    """Each layer's kind, as Gemma3TextConfig derives it when config.json does not list them."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config["num_hidden_layers"])]


class Gemma3ForCausalLM(LlamaForCausalLM):
    FUSED_DECODE = False
    norm_class = GemmaRMSNorm
    images_attend_both_ways = False  # True where the vision side is loaded (from_checkpoint)

    def __init__(self, *, config: DecoderConfig, device: torch.device, dtype: torch.dtype, **kwargs):
        super().__init__(config=config, device=device, dtype=dtype, **kwargs)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.local_rope_theta, {"rope_type": "default"},
                                            config.max_position_embeddings, device)
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, **kwargs) -> "Gemma3ForCausalLM":
        if "text_config" in hf_config:  # multimodal: the text model's config and weights only
            # transformers' Gemma3ForConditionalGeneration does not soft-cap its logits, whatever the text
            # config says (Gemma 3's own configs set no cap)
            text_config = {**hf_config["text_config"], "model_type": "gemma3_text", "final_logit_softcapping": None,
                           "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)}
            if not reader.has(MULTIMODAL_TEXT_PREFIX + "model.embed_tokens.weight"):
                raise ValueError(f"a multimodal Gemma 3 checkpoint without {MULTIMODAL_TEXT_PREFIX}model.* weights")
            model = super().from_checkpoint(text_config, PrefixedReader(reader, MULTIMODAL_TEXT_PREFIX), **kwargs)
            model_dir = getattr(reader, "model_dir", None)
            if model_dir is not None and os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
                from llmbus.workers.models.llava import Gemma3Vision

                # the vision side computes in the decoder's dtype, as LLaVA's (llava.py)
                model.vision = Gemma3Vision(hf_config, model_dir, reader, dtype=model.dtype, device=kwargs["device"])
                model.images_attend_both_ways = True
            return model
        return super().from_checkpoint(hf_config, reader, **kwargs)

    @classmethod
    def make_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention is not supported natively")
        layer_types = _layer_types(hf_config)
        if len(layer_types) != hf_config["num_hidden_layers"]:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is "
                             f"{hf_config['num_hidden_layers']}")
        # transformers >= 5: rope_parameters per layer kind; older configs: rope_theta and rope_scaling for the
        # global layers, rope_local_base_freq for the local ones.
        rope = hf_config.get("rope_parameters") or {}
        global_rope = dict(rope.get("full_attention") or hf_config.get("rope_scaling") or {})
        global_rope.setdefault("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
        local_theta = (rope.get("sliding_attention") or {}).get(
            "rope_theta", hf_config.get("rope_local_base_freq", 10_000.0))
        window = hf_config.get("sliding_window", 4096)
        plain = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        config = DecoderConfig.from_hf({**plain, "rope_parameters": global_rope})
        return dataclasses.replace(
            config,
            sliding_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            query_pre_attn_scalar=float(hf_config.get("query_pre_attn_scalar", config.head_dim)),
            local_rope_theta=float(local_theta),
            final_logit_softcapping=hf_config.get("final_logit_softcapping"),
            attn_logit_softcapping=hf_config.get("attn_logit_softcapping"),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)))

    @classmethod
    def build_layer(cls, build: WeightBuilder, config: DecoderConfig, i: int, tp: TensorParallel,
                    moe) -> Gemma3DecoderLayer:
        prefix = f"model.layers.{i}."

        def norm(name: str) -> GemmaRMSNorm:
            return GemmaRMSNorm(build.vector(f"{prefix}{name}.weight"), config.rms_norm_eps)

        return Gemma3DecoderLayer(
            input_norm=norm("input_layernorm"),
            attention=cls.build_attention(build, config, i, tp, scale=config.query_pre_attn_scalar ** -0.5),
            post_attention_norm=norm("post_attention_layernorm"),
            pre_feedforward_norm=norm("pre_feedforward_layernorm"), mlp=cls.build_dense_mlp(build, config, i, tp),
            post_feedforward_norm=norm("post_feedforward_layernorm"),
            local=config.sliding_windows[i] is not None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def run_layers(self, hidden, positions, cos, sin, kv_cache, meta):
        local_cos, local_sin = self.local_rotary.cos_sin(positions, self.dtype)
        for layer in self.layers:
            rope = (local_cos, local_sin) if layer.local else (cos, sin)
            hidden = layer(hidden, *rope, self.attention_backend, kv_cache, meta)
        return hidden

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (``model_type`` gemma2): Gemma 3's decoder with soft-capped attention scores, no QK-norm (its
    checkpoints have none, which ``build_attention`` reads as none) and one RoPE for all layers."""

    def __init__(self, *, config: DecoderConfig, device: torch.device, dtype: torch.dtype, **kwargs):
        super().__init__(config=config, device=device, dtype=dtype, **kwargs)
        self.local_rotary = self.rotary  # the sliding layers rotate as the global ones, scaling included

    @classmethod
    def make_config(cls, hf_config: dict) -> DecoderConfig:
        rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf_config.get("rope_theta", 10_000.0))
        as_gemma3 = {**hf_config, "layer_types": alternating_layer_types(hf_config),
                     "rope_parameters": {"full_attention": rope, "sliding_attention": rope}}
        return super().make_config(as_gemma3)

    def run_layers(self, hidden, positions, cos, sin, kv_cache, meta):
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, self.attention_backend, kv_cache, meta)
        return hidden
