"""A native Llama-family decoder over a paged KV cache, tensor-parallel across ranks: serves the
``model_type``s "llama", "mistral", "qwen2" and "qwen3", and with routed experts (``moe.py``) "mixtral" and
"qwen3_moe".

The forward pass works on one flat ``[T, hidden]`` batch: the new tokens of every sequence of a step,
concatenated. Attention is delegated to a backend (``workers/attention.py``) that knows how the tokens
map to sequences and KV slots.

Tensor parallelism (Megatron style): QKV and gate/up are column-parallel (each rank holds whole heads
and a slice of the intermediate size), ``o_proj`` and ``down_proj`` are row-parallel and followed by an
all-reduce; the embedding and the LM head are split over the vocabulary. Projections are fused at load
time (one QKV matmul, one gate/up matmul) so a layer runs two matmuls before attention and two after.

Variants fit through ``DecoderConfig``: biases are loaded whenever the checkpoint has them (Llama's
``attention_bias``/``mlp_bias``, Qwen2's q/k/v biases); Qwen3's per-head RMSNorm of queries and keys
before RoPE (``q_norm``/``k_norm``) whenever the checkpoint has those weights, and gpt-oss's per-head
attention sinks (``self_attn.sinks``, handed to the attention backend) likewise; a layer's MLP may be a
routed mixture of experts (``moe.py``); and each layer's sliding window (Mistral's ``sliding_window``,
Qwen2's and Qwen3's ``layer_types`` or ``use_sliding_window``/``max_window_layers``) is a mask term in
the attention backend. Keys that slide out of a window keep their KV blocks until the request ends (the
scheduler owns the blocks); they are only masked.

LoRA adapters (``workers/lora.py``) add their deltas at the four projections' call sites, a row-parallel
one's before its all-reduce; the fused decode layer adds them in its own projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmbus.workers import gpu_ops
from llmbus.workers.attention import AttentionMetadata, make_attention_backend
from llmbus.workers.fused_decode import FusedDecodeLayers, fused_decode_applies
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.lora import ActiveAdapters, StepAdapters
from llmbus.workers.models.moe import MoEConfig, build_sparse_moe
from llmbus.workers.models.rotary import RotaryEmbedding
from llmbus.workers.weight_builder import WeightBuilder


@dataclass(slots=True)
class DecoderConfig:
    """What the forward pass needs from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict  # {"rope_type": ..., "factor": ..., ...}; {"rope_type": "default"} when none
    # Per layer: a query at position q attends the keys k with q - window < k <= q; None: every k <= q.
    sliding_windows: tuple[int | None, ...] = ()
    model_type: str = "llama"
    partial_rotary_factor: float = 1.0  # the share of each head that RoPE rotates (Phi-4-mini: 0.75)
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # Gemma 2 and 3 (models/gemma3.py): attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5,
    # the sliding layers' RoPE base, and tanh soft-capping of the logits and (Gemma 2) of every layer's
    # attention scores.
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @property
    def attention_softcaps(self) -> tuple[float | None, ...]:
        """Each layer's soft cap of its attention scores (the attention backend's ``softcaps``)."""
        return (self.attn_logit_softcapping,) * self.num_layers if self.attn_logit_softcapping else ()

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        act = config.get("hidden_activation") or config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        num_heads = config["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
        if rope["rope_type"] == "mrope":  # Qwen2-VL's older configs: default RoPE in M-RoPE's sections
            rope["rope_type"] = "default"
        partial_rotary_factor = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        # Phi-3's LongRoPE was first called su, and Phi3Config reads yarn as longrope too.
        if rope["rope_type"] == "su" or (rope["rope_type"] == "yarn" and config.get("model_type") == "phi3"):
            rope["rope_type"] = "longrope"
        if config.get("original_max_position_embeddings") is not None:  # Phi-3 keeps it beside rope_scaling
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        if rope["rope_type"] in ("llama3", "yarn", "longrope"):  # older configs leave it out: transformers' default
            rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            sliding_windows=_sliding_windows(config),
            model_type=config.get("model_type", "llama"),
            partial_rotary_factor=float(partial_rotary_factor or 1.0),
            hidden_act=act,
        )


# The MLP gate's activation by config name: SwiGLU's, and GeGLU's (Gemma) as transformers computes it.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig's and Qwen2Config's when config.json has no sliding_window


def _sliding_windows(config: dict) -> tuple[int | None, ...]:
    """Each layer's attention window, read as transformers' config class of ``model_type`` reads it."""
    num_layers = config["num_hidden_layers"]
    model_type = config.get("model_type", "llama")
    if model_type == "mistral":  # one window for every layer; null means full attention
        return (config.get("sliding_window", DEFAULT_SLIDING_WINDOW),) * num_layers
    if model_type in ("mixtral", "phi3"):  # as Mistral, but their configs' default is no window
        return (config.get("sliding_window"),) * num_layers
    if model_type == "qwen3_moe":  # Qwen3MoeConfig: one window for every layer, only with use_sliding_window
        return ((config.get("sliding_window", DEFAULT_SLIDING_WINDOW) if config.get("use_sliding_window", False)
                 else None),) * num_layers
    if model_type in ("qwen2", "qwen3"):
        # Qwen2Config drops the window unless use_sliding_window; then transformers 5's layer_types
        # names each layer's kind, and older configs window the layers from max_window_layers on.
        window = (config.get("sliding_window", DEFAULT_SLIDING_WINDOW) if config.get("use_sliding_window", False)
                  else None)
        if window is None:
            return (None,) * num_layers
        layer_types = config.get("layer_types")
        if layer_types is None:
            first = config.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if model_type == "gpt_oss":  # GptOssConfig: layer_types, local first where it lists none
        window = config.get("sliding_window", 128)
        return tuple(window if kind == "sliding_attention" else None for kind in alternating_layer_types(config))
    return (None,) * num_layers


def alternating_layer_types(config: dict) -> list[str]:
    """Each layer's kind: config.json's ``layer_types``, else sliding and full layers alternating, sliding first
    (how Gemma2Config and GptOssConfig derive them)."""
    num_layers = config["num_hidden_layers"]
    layer_types = list(config.get("layer_types") or
                       ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)])
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    return layer_types


# The residual stream (embeddings, each layer's sum) is kept in float32 whatever the weights' dtype, as
# llama.cpp keeps it: real checkpoints carry outlier features large enough that a bfloat16 sum keeps only
# steps of about a hundred, and 30 layers of that rounding flipped SmolLM2's first answer token (two
# near-tied candidates) on a plain chat prompt (design notes, "The residual stream in float32"). Norms hand
# the matmuls the model dtype, and adding a layer's output promotes it, so the stream costs no extra op per
# layer.
RESIDUAL_DTYPE = torch.float32


class TensorParallel:
    """This rank's place in the tensor-parallel group and the two collectives the model uses."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def gather_last_dim_to_first_rank(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``tensor`` along the last dimension, on rank 0 only."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


class RMSNorm:
    """Normalises in float32 and scales in the model dtype, as transformers' LlamaRMSNorm does."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if gpu_ops.available(x):  # one kernel instead of eight (workers/gpu_ops.py)
            return gpu_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` normalised, and that sum (the new residual; on a GPU, ``residual`` updated in
        place by the same kernel)."""
        if gpu_ops.available(x) and residual.dtype == torch.float32 and residual.is_contiguous():
            return gpu_ops.rms_norm(x, self.weight, self.eps, residual=residual)
        residual = residual + x
        return self(residual), residual


class LlamaAttention:
    """Fused column-parallel QKV, RoPE, paged attention, row-parallel output projection; optionally an
    RMSNorm over each query and key head before RoPE (Qwen3's QK-norm).

    ``lora_sites``: for each projection (qkv, o_proj), the checkpoint parts this rank holds, as LoRA adapters
    are cut to match (``workers/lora.py``, which sets ``qkv_lora``/``o_proj_lora`` where an adapter adds to
    them)."""

    def __init__(self, *, layer: int, qkv, o_proj, o_bias, num_heads: int, num_kv_heads: int,
                 head_dim: int, tp: TensorParallel, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 scale: float | None = None, lora_sites: dict[str, list[tuple[str, int, int]]] | None = None):
        self.layer = layer
        self.qkv = qkv  # a Linear or a quant.QuantizedLinear: the projections only need __call__
        self.o_proj = o_proj
        self.lora_sites = lora_sites or {}
        self.qkv_lora = self.o_proj_lora = None
        self.o_bias = o_bias
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_width = (num_heads + num_kv_heads) * head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.tp = tp
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sinks: torch.Tensor | None = None  # [num_heads] this rank's sink logits (gpt-oss), for the backend

    def __call__(self, hidden, cos, sin, backend, kv_cache: PagedKVCache, meta: AttentionMetadata):
        qk, value = self.project(hidden)
        return self.output(self.attend(qk, value, cos, sin, backend, kv_cache, meta))

    def project(self, hidden):
        """(query and key heads, QK-normed where the model does; value heads) of ``hidden``'s rows."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv(hidden)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora(hidden, qkv)
        qk = qkv[:, :self.qk_width].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        return qk, qkv[:, self.qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)

    def attend(self, qk, value, cos, sin, backend, kv_cache: PagedKVCache, meta: AttentionMetadata, out=None):
        """The heads' attention over the pool, this step's keys and values written to it first: the one part
        of a layer that reads the step's metadata (piecewise_graphs.py runs it between captured parts, the
        heads into ``out``)."""
        # RoPE is the backend's: the Triton one rotates the keys as it writes them to the pool.
        return backend.forward_rotary(self.layer, qk, value, cos, sin, self.num_heads, kv_cache, meta, self.scale,
                                      out)

    def attend_rotated(self, qk, value, backend, kv_cache: PagedKVCache, meta: AttentionMetadata, out=None):
        """``attend`` on heads that are rotated already (a piecewise step's parts rotate them in their graphs,
        ``piecewise_graphs.py``): where the backend writes the keys inside its attention, one launch."""
        return backend.forward(self.layer, qk[:, :self.num_heads], qk[:, self.num_heads:], value, kv_cache, meta,
                               self.scale, out)

    def output(self, attended):
        """The output projection of ``attend``'s heads, summed over the ranks."""
        attended = attended.reshape(attended.shape[0], -1)
        out = self.o_proj(attended)
        if self.o_proj_lora is not None:  # this rank's partial delta, summed by the all-reduce as the base's is
            out = self.o_proj_lora(attended, out)
        out = self.tp.all_reduce(out)
        # The bias of a row-parallel layer is added once, after the reduction.
        return out + self.o_bias if self.o_bias is not None else out


class LlamaMLP:
    """SwiGLU (or GeGLU) with a fused column-parallel gate/up projection and a row-parallel down projection.
    ``lora_sites`` as ``LlamaAttention``'s, for gate_up and down."""

    def __init__(self, *, gate_up, down, down_bias, tp: TensorParallel, hidden_act: str = "silu",
                 lora_sites: dict[str, list[tuple[str, int, int]]] | None = None):
        self.hidden_act, self.activation = hidden_act, ACTIVATIONS[hidden_act]
        self.gate_up = gate_up
        self.down = down
        self.down_bias = down_bias
        self.tp = tp
        self.lora_sites = lora_sites or {}
        self.gate_up_lora = self.down_lora = None

    def __call__(self, hidden):
        gate_up = self.gate_up(hidden)
        if self.gate_up_lora is not None:
            gate_up = self.gate_up_lora(hidden, gate_up)
        if self.hidden_act == "silu" and gpu_ops.available(gate_up):
            activated = gpu_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = self.activation(gate).mul_(up)
        out = self.down(activated)
        if self.down_lora is not None:  # before the all-reduce, as o_proj's
            out = self.down_lora(activated, out)
        out = self.tp.all_reduce(out)
        return out + self.down_bias if self.down_bias is not None else out


class LlamaDecoderLayer:
    def __init__(self, *, input_norm: RMSNorm, attention: LlamaAttention, post_attention_norm: RMSNorm,
                 mlp: LlamaMLP):
        self.input_norm, self.attention = input_norm, attention
        self.post_attention_norm, self.mlp = post_attention_norm, mlp

    def __call__(self, residual, pending, cos, sin, backend, kv_cache, meta):
        """(the residual stream, this layer's MLP output not yet added to it). The add is left to the next
        layer's input norm, which on a GPU does it in the norm's own kernel (``RMSNorm.add_and_norm``), as
        the post-attention norm does the attention's; ``pending`` is the layer before's (None: the first)."""
        residual, qk, value = self.before_attention(residual, pending)
        return self.after_attention(residual, self.attention.attend(qk, value, cos, sin, backend, kv_cache, meta))

    def before_attention(self, residual, pending):
        """(the residual stream, the query-key and value heads): the layer up to its attention."""
        if pending is None:
            normed = self.input_norm(residual)
        else:
            normed, residual = self.input_norm.add_and_norm(residual, pending)
        return (residual, *self.attention.project(normed))

    def after_attention(self, residual, attended):
        """(the residual stream, the MLP's output not yet added to it): the layer from its attention's heads."""
        normed, residual = self.post_attention_norm.add_and_norm(residual, self.attention.output(attended))
        return residual, self.mlp(normed)


class LlamaForCausalLM:
    """Llama decoder with vocab-parallel embedding and LM head; logits come back on rank 0 only.

    A family that differs in its layers subclasses it (``gemma3.py``): ``build_layer`` and ``run_layers``,
    ``embed`` and ``finish_logits``, and ``FUSED_DECODE`` where decode_layer.c does not compute its layer."""

    FUSED_DECODE = True  # whether decode_layer.c computes this family's layers (where fused_decode.py applies)
    norm_class = RMSNorm

    def __init__(self, *, config: DecoderConfig, tp: TensorParallel, embedding, vocab_per_rank: int,
                 layers: list[LlamaDecoderLayer], norm: RMSNorm, lm_head, dtype: torch.dtype,
                 device: torch.device, weight_summary: str = "", plain_head_weight: torch.Tensor | None = None,
                 attention_backend: str = "auto"):
        self.config = config
        self.tp = tp
        # ids -> rows of this rank's [vocab_per_rank, hidden] shard (zero rows past the real vocabulary)
        self.embedding = embedding
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # the same vocabulary rows as a projection (one int8 copy when tied)
        self.plain_head_weight = plain_head_weight  # the head as a dense [vocab, hidden] tensor, if there is one
        self.vocab_per_rank = vocab_per_rank
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.num_local_heads = config.num_heads // tp.world_size
        self.num_local_kv_heads = kv_heads_per_rank(config.num_kv_heads, tp.world_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings, device, config.partial_rotary_factor)
        self.max_position_embeddings = self.rotary.max_positions
        sinks = [layer.attention.sinks for layer in layers]  # each layer's (gpt-oss), this rank's query heads'
        self.attention_backend = make_attention_backend(device, config.sliding_windows, name=attention_backend,
                                                        softcaps=config.attention_softcaps, sinks=sinks)
        self.dtype = dtype
        self.device = device
        self.weight_summary = weight_summary  # what each checkpoint tensor became (weight_builder.py)
        self.active_adapters = ActiveAdapters()  # the step's LoRA rows, read by adapted projections (lora.py)
        # Small decode-only steps in one native call for all layers, where it applies (fused_decode.py).
        self.fused_decode = FusedDecodeLayers.for_model(self) if self.FUSED_DECODE else None
        if self.fused_decode is not None and self.fused_decode.takes_large_batches:
            # Prompt steps through the fused layer too: one native call instead of ~30 torch ops a layer,
            # no slower and faster for short prompts (design notes, "Small decode steps"), from a backend
            # that gives them as kernel rows (the layer keeps the same windows' order).
            self.attention_backend = make_attention_backend(device, config.sliding_windows, prompt_rows=True,
                                                            name=attention_backend, softcaps=config.attention_softcaps,
                                                            sinks=sinks)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.embedding(input_ids)
        # Each rank embeds the ids in its vocabulary range, zeros for the rest; the sum is the embedding.
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.vocab_per_rank)
        hidden = self.embedding(local_ids.masked_fill(outside, 0))
        hidden.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_index: torch.Tensor,
                adapters: StepAdapters | None = None,
                embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the flat batch ``input_ids [T]`` at ``positions [T]``; return float32 logits
        ``[len(logits_index), vocab]`` of the rows ``logits_index`` on rank 0, None elsewhere. ``adapters``:
        which rows get which LoRA adapter's deltas (lora.py). ``embeddings``: (rows, their embeddings) read in
        place of those rows' token embeddings (an image's placeholders, ``vision.py``). ``rope_positions``: what
        the rows are rotated by where it is not their place in the cache (M-RoPE's ``[3, T]``, ``mrope.py``).

        Every rank must call this with the same shapes (the collectives pair up)."""
        hidden = self.embed(input_ids).to(RESIDUAL_DTYPE)
        if embeddings is not None:
            hidden.index_copy_(0, embeddings[0], embeddings[1].to(RESIDUAL_DTYPE))
        by_sequence = self.rotary.per_sequence or meta.sequence_horizons is not None
        cos, sin = self.rotary.cos_sin(positions if rope_positions is None else rope_positions, self.dtype,
                                       meta.start_mask(len(positions)) if by_sequence else None,
                                       meta.sequence_horizons if by_sequence else None)
        # The fused C layer adds the adapter rows' deltas itself (lora.py hands it the adapters); elsewhere the
        # torch layers' projections do, while the step's rows are being served.
        fused = self.fused_decode is not None and self.fused_decode.run(hidden, cos, sin, kv_cache, meta, adapters)
        if not fused:
            with self.active_adapters.serving(adapters):  # None: no row has an adapter, no delta is added
                hidden = self.run_layers(hidden, positions, cos, sin, kv_cache, meta)
        return self.logits_of(hidden, logits_index, fused)

    def logits_of(self, hidden: torch.Tensor, logits_index: torch.Tensor, fused: bool = False) -> torch.Tensor | None:
        """``forward``'s logits from the last layer's output ``hidden [T, hidden]`` (``fused``: the fused C
        layer's, whose head computes them too)."""
        if logits_index.numel() == 0:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32) if self.tp.rank == 0 else None
        # The final norm is per token, so it only runs on the rows that need logits.
        rows = hidden.index_select(0, logits_index)
        head_out = self.fused_decode.logits(rows, self.norm) if fused else self.lm_head(self.norm(rows))
        logits = self.tp.gather_last_dim_to_first_rank(head_out)
        if logits is None:
            return None
        return self.finish_logits(logits[:, : self.config.vocab_size].float())

    def run_layers(self, hidden, positions, cos, sin, kv_cache: PagedKVCache, meta: AttentionMetadata):
        pending = None
        for layer in self.layers:
            hidden, pending = layer(hidden, pending, cos, sin, self.attention_backend, kv_cache, meta)
        return hidden if pending is None else hidden + pending

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    @classmethod
    def make_config(cls, hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config)

    @classmethod
    def from_checkpoint(cls, hf_config: dict, reader, *, rank: int, world_size: int, dtype: torch.dtype,
                        device: torch.device, quantize: str | None = None, bf16_inputs: bool = False,
                        attention_backend: str = "auto") -> "LlamaForCausalLM":
        """Read this rank's shards from ``reader`` (a ``loader.CheckpointReader`` or a GGUF reader) and
        fuse them; ``quantize`` (a form of ``quant.WEIGHT_FORMS``) and ``bf16_inputs`` as
        ``quant.compute_plan`` gives them (``weight_builder.py``)."""
        config = cls.make_config(hf_config)
        if config.num_heads % world_size or (config.num_kv_heads % world_size and world_size % config.num_kv_heads):
            raise ValueError(
                f"tensor parallelism over {world_size} ranks needs the number of attention heads "
                f"({config.num_heads}) to be divisible by {world_size}, and the number of key/value heads "
                f"({config.num_kv_heads}) to divide it or be divisible by it")
        if config.intermediate_size % world_size:
            raise ValueError(f"tensor parallelism over {world_size} ranks needs intermediate_size "
                             f"({config.intermediate_size}) divisible by {world_size}")
        tp = TensorParallel(rank, world_size)
        moe = MoEConfig.from_hf(hf_config)
        keep_plain = cls.FUSED_DECODE and fused_decode_applies(device, world_size, dtype, quantize, attention_backend)
        build = WeightBuilder(reader, rank=rank, world_size=world_size, dtype=dtype, device=device,
                              quantize=quantize, bf16_inputs=bf16_inputs, keep_plain=keep_plain)
        layers = [cls.build_layer(build, config, i, tp, moe) for i in range(config.num_layers)]
        tied = _head_is_the_embedding(config, reader)
        embedding, lm_head, vocab_per_rank = build.embedding_and_head(config.vocab_size, config.hidden_size, tied)
        norm = cls.norm_class(build.vector("model.norm.weight"), config.rms_norm_eps)
        plain_head = getattr(embedding, "weight", None) if tied else None
        return cls(config=config, tp=tp, embedding=embedding, vocab_per_rank=vocab_per_rank, layers=layers,
                   norm=norm, lm_head=lm_head, dtype=dtype, device=device, weight_summary=build.summary(),
                   plain_head_weight=plain_head if isinstance(plain_head, torch.Tensor) else None,
                   attention_backend=attention_backend)

    @classmethod
    def build_attention(cls, build: WeightBuilder, config: DecoderConfig, i: int, tp: TensorParallel,
                        scale: float | None = None) -> LlamaAttention:
        attn, world_size = f"model.layers.{i}.self_attn.", tp.world_size
        o_width = config.num_heads // world_size * config.head_dim
        o_proj, o_bias = build.row_parallel(attn + "o_proj", o_width)
        qkv_parts = _qkv_parts(build.reader, attn, config, world_size)
        q_norm, k_norm = (
            (cls.norm_class(build.vector(attn + "q_norm.weight"), config.rms_norm_eps),
             cls.norm_class(build.vector(attn + "k_norm.weight"), config.rms_norm_eps))
            if build.reader.has(attn + "q_norm.weight") else (None, None))
        attention = LlamaAttention(
            layer=i, qkv=build.column_parallel(qkv_parts), o_proj=o_proj, o_bias=o_bias,
            lora_sites={"qkv": build.row_spans(qkv_parts), "o_proj": [build.column_span(attn + "o_proj", o_width)]},
            num_heads=config.num_heads // world_size, num_kv_heads=kv_heads_per_rank(config.num_kv_heads, world_size),
            head_dim=config.head_dim, tp=tp, q_norm=q_norm, k_norm=k_norm, scale=scale)
        if build.reader.has(attn + "sinks"):  # gpt-oss: this rank's query heads' sink logits
            heads = attention.num_heads
            attention.sinks = build.vector(attn + "sinks")[tp.rank * heads:(tp.rank + 1) * heads]
        return attention

    @staticmethod
    def build_dense_mlp(build: WeightBuilder, config: DecoderConfig, i: int, tp: TensorParallel) -> LlamaMLP:
        mlp, width = f"model.layers.{i}.mlp.", config.intermediate_size // tp.world_size
        down, down_bias = build.row_parallel(mlp + "down_proj", width)
        gate_up_parts = _gate_up_parts(build.reader, mlp, config.intermediate_size, tp.world_size)
        return LlamaMLP(
            gate_up=build.column_parallel(gate_up_parts), down=down, down_bias=down_bias, tp=tp,
            hidden_act=config.hidden_act, lora_sites={"gate_up": build.row_spans(gate_up_parts),
                                                      "down": [build.column_span(mlp + "down_proj", width)]})

    @classmethod
    def build_layer(cls, build: WeightBuilder, config: DecoderConfig, i: int, tp: TensorParallel,
                    moe: MoEConfig | None) -> LlamaDecoderLayer:
        prefix = f"model.layers.{i}."
        mlp_block = (build_sparse_moe(build, moe, prefix, tp.world_size, tp) if moe is not None and moe.sparse_layers[i]
                     else cls.build_dense_mlp(build, config, i, tp))
        return LlamaDecoderLayer(
            input_norm=RMSNorm(build.vector(prefix + "input_layernorm.weight"), config.rms_norm_eps),
            attention=cls.build_attention(build, config, i, tp),
            post_attention_norm=RMSNorm(build.vector(prefix + "post_attention_layernorm.weight"), config.rms_norm_eps),
            mlp=mlp_block)


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """Key/value heads each rank holds: its share, or one where there are fewer heads than ranks (each then
    replicated on ``world_size // num_kv_heads`` ranks, whose query heads all read it)."""
    return max(num_kv_heads // world_size, 1)


def _qkv_parts(reader, attn: str, config: DecoderConfig, world_size: int) -> list[tuple[str, int, int, int]]:
    """This rank's query, key and value rows as ``WeightBuilder.column_parallel`` parts: from separate
    q/k/v projections, or from the thirds of Phi-3's fused ``qkv_proj`` (query heads, then key, then value).
    Rank r's query heads all share key/value head ``r // ranks_per_kv_head`` when heads are replicated."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    kv_heads = kv_heads_per_rank(config.num_kv_heads, world_size)
    q_rows, kv_rows = q_width // world_size, kv_heads * config.head_dim
    ranks_per_kv_head = max(world_size // config.num_kv_heads, 1)
    if reader.has(attn + "qkv_proj.weight"):
        fused = attn + "qkv_proj"
        return [(fused, q_rows, 0, 1), (fused, kv_rows, q_width, ranks_per_kv_head),
                (fused, kv_rows, q_width + kv_width, ranks_per_kv_head)]
    return [(attn + "q_proj", q_rows, 0, 1), (attn + "k_proj", kv_rows, 0, ranks_per_kv_head),
            (attn + "v_proj", kv_rows, 0, ranks_per_kv_head)]


def _gate_up_parts(reader, mlp: str, intermediate_size: int, world_size: int) -> list[tuple[str, int, int]]:
    """This rank's gate and up rows: from separate projections or the halves of Phi-3's ``gate_up_proj``."""
    rows = intermediate_size // world_size
    if reader.has(mlp + "gate_up_proj.weight"):
        return [(mlp + "gate_up_proj", rows, 0), (mlp + "gate_up_proj", rows, intermediate_size)]
    return [(mlp + "gate_proj", rows, 0), (mlp + "up_proj", rows, 0)]


def _head_is_the_embedding(config: DecoderConfig, reader) -> bool:
    """Whether the LM head is the embedding matrix: where the checkpoint holds no head of its own, or one equal
    to it under ``tie_word_embeddings``. transformers 5 computes with a head the checkpoint holds even where the
    config ties them, so a different one is kept; an equal copy is not held twice."""
    if not reader.has("lm_head.weight"):
        return True
    if not config.tie_word_embeddings or reader.shape("lm_head.weight") != reader.shape("model.embed_tokens.weight"):
        return False
    return torch.equal(reader.read("model.embed_tokens.weight"), reader.read("lm_head.weight"))
