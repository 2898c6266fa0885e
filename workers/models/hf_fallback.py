"""Any causal LM that transformers can load, served over llmbus's paged KV cache.

Model types without a native implementation (``models/llama.py``) run through transformers' own
modeling code, with one substitution: attention. The adapter registers an attention function under
``ATTENTION_IMPLEMENTATION`` with transformers' ``AttentionInterface`` and loads the model with that
``attn_implementation``. Each step then runs the model once on the flat packed batch (``[1, T]`` with
explicit ``position_ids``, ``use_cache=False``): the model's own embeddings, projections, RoPE or
learned positions, norms and MLPs run as usual, and every attention call lands in ``_paged_attention``,
which writes the new K/V into the ``PagedKVCache`` slots of its layer and attends through the attention
backend with the step's ``AttentionMetadata``. The metadata reaches it through the forward kwargs, which
transformers passes down to the attention function.

Because the custom implementation is not in transformers' ``AttentionMaskInterface``, transformers'
``create_causal_mask`` returns ``None`` without building anything: causality and the sequence
boundaries of the packed batch come from the metadata alone.

Only the rows the runner asks for reach the LM head: they are handed to the model's own
``logits_to_keep``, so model-specific logit scaling or capping still applies.

At load time one single-token probe forward records what the model sends to attention (layer indices,
K/V heads, head size, sliding windows, soft caps, sinks, masks), so the KV layout comes from the
model as it runs rather than from the config's naming conventions. Sliding windows, soft caps of the scores
(Gemma 2's ``softcap``) and attention sinks (gpt-oss's ``s_aux``, one logit per query head) go to the
attention backend per layer. Models that cannot run this way fail at startup with a clear message instead of
producing wrong tokens: modeling code that does not take a registered attention function (GPT-J, GPT-Neo,
BLOOM, Falcon, MPT, CodeGen in transformers 5.23), hybrid recurrent layers, ALiBi-style masks. Tensor
parallelism is not supported here.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch

from llmbus.bus.model_files import config_max_positions, config_rope_scaling, scaled_positions
from llmbus.bus.prequantized import CheckpointQuantization
from llmbus.workers.attention import AttentionBackend, AttentionMetadata, make_attention_backend
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.models.fallback_rotary import wrap_length_rotaries

ATTENTION_IMPLEMENTATION = "llmbus_paged"
STEP_KWARG = "llmbus_step"  # the forward kwarg that carries the step to the attention function
DEFAULT_MAX_POSITIONS = 2048  # when the config names no context length
# The step of the forward running on this thread, for models whose decoder layers do not pass the forward
# kwargs on to attention (StableLM); everywhere else the step arrives through the kwargs.
_running = threading.local()


@dataclass(slots=True)
class FallbackConfig:
    """What ``ModelRunner`` and the server read from a model's config."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


@dataclass(slots=True)
class _Step:
    """One step's cache, metadata and backend, handed to every attention call."""

    kv_cache: PagedKVCache
    meta: AttentionMetadata
    backend: AttentionBackend


@dataclass(slots=True)
class _LayerProbe:
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None  # [Hq] the module's sink logits


@dataclass(slots=True)
class _Probe:
    """Collects what each attention call receives during the load-time probe forward."""

    layers: dict[int, _LayerProbe] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _probe_attention(module, query, key, value, attention_mask, probe: _Probe, kwargs) -> torch.Tensor:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        probe.problems.append(f"attention module {type(module).__name__} has no integer layer_idx")
        layer = -1 - len(probe.layers)
    if attention_mask is not None:
        probe.problems.append("the model passes its own attention mask or bias (e.g. ALiBi) to attention")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],)):
        probe.problems.append(f"attention sinks of shape {getattr(sinks, 'shape', type(sinks).__name__)}, not one "
                              f"per query head")
        sinks = None
    if layer in probe.layers:
        probe.problems.append(f"attention layer {layer} is called more than once per forward")
    probe.layers[layer] = _LayerProbe(num_kv_heads=key.shape[1], head_dim=key.shape[-1],
                                      value_head_dim=value.shape[-1], sliding_window=kwargs.get("sliding_window"),
                                      softcap=kwargs.get("softcap"), sinks=sinks)
    batch, _, num_tokens, _ = query.shape
    return query.new_zeros(batch, num_tokens, query.shape[1], value.shape[-1])


def _paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]``
    after the model's own position encoding -> ``([1, T, Hq, D], None)``."""
    step = kwargs.get(STEP_KWARG) or getattr(_running, "step", None)
    if not isinstance(step, _Step):
        if isinstance(step, _Probe):
            return _probe_attention(module, query, key, value, attention_mask, step, kwargs), None
        raise RuntimeError(f"the {ATTENTION_IMPLEMENTATION!r} attention only runs inside "
                           "HFFallbackForCausalLM.forward, which passes the step's paged KV metadata")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # The backend takes token-major [T, H, D]; it views the query in place, so it must be contiguous.
    attended = step.backend.forward(module.layer_idx, query[0].transpose(0, 1).contiguous(),
                                    key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    step.kv_cache, step.meta, scaling)
    return attended.unsqueeze(0), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _paged_attention)


def _max_positions(hf_config) -> int:
    """The positions the model embeds: its config's, stretched by its RoPE scaling (``scaled_positions``), as
    the launcher and the native models' rotary.py read it."""
    config = hf_config.to_dict()
    return scaled_positions(config_rope_scaling(config), config_max_positions(config) or DEFAULT_MAX_POSITIONS)


class HFFallbackForCausalLM:
    """A transformers causal LM behind the interface ``ModelRunner`` uses from ``LlamaForCausalLM``."""

    def __init__(self, model, *, model_type: str, device: torch.device, log=None, attention_backend: str = "auto"):
        self.model = model
        # dynamic NTK and LongRoPE rotate each token as for its sequence alone (fallback_rotary.py); None: neither
        self.rotary = wrap_length_rotaries(model, lambda: getattr(_running, "step", None))
        self.dtype = next(model.parameters()).dtype
        self.device = device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.config, layers = self._probe(model_type)
        windows = [layer.sliding_window for layer in layers]
        self.attention_backend = make_attention_backend(
            self.device, windows, name=attention_backend, softcaps=[layer.softcap for layer in layers],
            sinks=[layer.sinks for layer in layers])
        self.num_layers = self.config.num_layers
        self.num_local_kv_heads = self.config.num_kv_heads
        self.max_position_embeddings = self.config.max_position_embeddings
        if log is not None:
            log.info("transformers fallback loaded", architecture=type(model).__name__,
                     num_layers=self.num_layers, num_kv_heads=self.num_local_kv_heads,
                     head_dim=self.config.head_dim, sliding_windows=sorted({w for w in windows if w is not None}),
                     soft_caps=sorted({layer.softcap for layer in layers if layer.softcap is not None}),
                     sinks=any(layer.sinks is not None for layer in layers),
                     max_position_embeddings=self.max_position_embeddings)

    @classmethod
    def from_pretrained(cls, model_dir: str, *, model_type: str, rank: int = 0, world_size: int = 1,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        log=None, trust_remote_code: bool = False, attention_backend: str = "auto",
                        rope_scaling: tuple[str, float] | None = None,
                        prequantized: CheckpointQuantization | None = None) -> "HFFallbackForCausalLM":
        """``prequantized``: the checkpoint's published quantization (``bus.prequantized``), of which the fallback
        reads MXFP4, expanded to ``dtype`` by transformers as it loads."""
        if world_size > 1:
            raise ValueError(f"model_type {model_type!r} runs through the transformers fallback, which does not "
                             f"support tensor parallelism; use --gpus 1")
        from transformers import AutoModelForCausalLM

        _register_attention()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION,
                trust_remote_code=trust_remote_code, **_rope_config(model_dir, rope_scaling, trust_remote_code),
                **_expanded_quantization(prequantized))
        except (KeyError, NotImplementedError, ValueError) as e:
            # e.g. a model_type transformers does not know, or modeling code with a fixed set of
            # attention classes (GPT-Neo) that cannot take a registered attention function.
            raise ValueError(f"model_type {model_type!r} cannot be loaded through the transformers fallback "
                             f"with paged attention: {type(e).__name__}: {e}") from e
        device = torch.device(device)
        model = model.to(device).eval().requires_grad_(False)
        _silence_padding_check(model)
        return cls(model, model_type=model_type, device=device, log=log, attention_backend=attention_backend)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step, logits_index: torch.Tensor | None):
        kwargs = {"logits_to_keep": logits_index} if self._keeps_logits and logits_index is not None else {}
        _running.step = step
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                             **kwargs, **{STEP_KWARG: step})
        finally:
            _running.step = None
        return out.logits[0]

    def _probe(self, model_type: str) -> tuple[FallbackConfig, list[_LayerProbe]]:
        """One single-token forward that records what each attention call receives; the config and
        what each layer's attention is given (its sliding window, soft cap and sinks)."""
        probe = _Probe()
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                vocab_size = self._run(one, one, probe, one).shape[-1]
        except Exception as e:  # modeling code that needs a mask tensor (MPT) or its own cache
            raise ValueError(f"model_type {model_type!r} cannot run through the transformers fallback: a forward "
                             f"with paged attention fails ({type(e).__name__}: {e})") from e
        hf_config = self.model.config
        problems = list(dict.fromkeys(probe.problems))
        if not probe.layers:
            problems.append("its attention does not go through transformers' AttentionInterface")
        elif sorted(probe.layers) != list(range(len(probe.layers))):
            problems.append(f"its attention layers are {sorted(probe.layers)}, not 0..n-1 (a hybrid model with "
                            "recurrent layers, whose state a paged KV cache cannot hold)")
        shapes = {(p.num_kv_heads, p.head_dim, p.value_head_dim) for p in probe.layers.values()}
        if len(shapes) > 1:
            problems.append(f"its layers differ in K/V heads or head size {sorted(shapes)}")
        if any(p.head_dim != p.value_head_dim for p in probe.layers.values()):
            problems.append("its keys and values differ in head size")
        if problems:
            raise ValueError(f"model_type {model_type!r} cannot run through the transformers fallback: "
                             + "; ".join(problems))
        first = probe.layers[0]
        config = FallbackConfig(model_type=model_type, vocab_size=vocab_size, num_layers=len(probe.layers),
                                num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                                max_position_embeddings=_max_positions(hf_config))
        return config, [probe.layers[i] for i in range(len(probe.layers))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_index: torch.Tensor) -> torch.Tensor:
        """Run the flat batch ``input_ids [T]`` at ``positions [T]``; float32 logits
        ``[len(logits_index), vocab]`` of the rows ``logits_index`` (only those rows go through the LM
        head, via the model's own ``logits_to_keep``)."""
        logits = self._run(input_ids, positions, _Step(kv_cache, meta, self.attention_backend), logits_index)
        if not self._keeps_logits:
            logits = logits.index_select(0, logits_index)
        return logits.float()


def _silence_padding_check(model) -> None:
    """transformers' padding warning compares the first and last input ids with the pad id, a device
    sync per step; a packed batch has no padding, so the check is turned off on this instance."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = _no_padding_warning


def _no_padding_warning(input_ids, attention_mask) -> None:
    return None


def _expanded_quantization(prequantized: CheckpointQuantization | None) -> dict:
    """``from_pretrained``'s ``quantization_config`` for a checkpoint published in MXFP4: expanded to the model's
    dtype at load, always. Left to itself, transformers picks by what is installed (its Triton MXFP4 kernels
    need the ``kernels`` package, which fetches them from the hub), so a server would run one way or the other
    by its environment; none otherwise."""
    if prequantized is None or prequantized.method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _rope_config(model_dir: str, rope_scaling: tuple[str, float] | None, trust_remote_code: bool) -> dict:
    """``from_pretrained``'s ``config`` under a --rope-scaling override (``with_rope_override`` on its
    dict); none without one."""
    if rope_scaling is None:
        return {}
    from transformers import AutoConfig

    from llmbus.bus.model_files import with_rope_override

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return {"config": type(config).from_dict(with_rope_override(config.to_dict(), rope_scaling))}
