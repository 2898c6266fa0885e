"""Routed mixture-of-experts MLP blocks (Mixtral, Qwen3-MoE, gpt-oss) for the native decoder (``llama.py``).

A router scores every expert per token (softmax in float32), the top ``k`` are kept, and Mixtral (always)
or Qwen3-MoE (``norm_topk_prob``) rescales those ``k`` to sum to one, as transformers does. The experts run
as grouped matmuls: the step's (token, expert) pairs are sorted by expert, and each expert that received
tokens multiplies all of them at once (one gate/up and one down projection per expert with tokens, none for
an idle one), the weighted results added back to their tokens' rows.

Tensor parallelism splits every expert's intermediate dimension across ranks, as a dense MLP's: each rank
holds a column slice of each expert's gate/up and the matching row slice of its down projection, so a rank
computes a partial sum for every routed token and one all-reduce after the block completes it. The router
is replicated (every rank routes the same way). Each expert's projections come from the same
``WeightBuilder`` as dense ones, so ``--quantize`` covers them; the router stays dense (its logits decide
which experts run, and it is small).

On one CPU rank the fused decode layer computes these blocks for the steps it takes (``decode_layer.c``'s
``routed_experts``: the same routing, grouping and order of sums, each expert's rows through the layer's
GEMVs or tiled products), so a Mixtral or Qwen3-MoE step is one native call like a dense model's; this class
is the reference and the path for everything else (GPUs, tensor parallelism, large float32 batches).

LoRA adapters reach a MoE model's attention, and the dense MLP of a layer without experts, never the experts:
``lora.py`` refuses an adapter of an expert's projections (this block has no ``lora_sites``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """How a checkpoint's sparse MLP blocks are laid out and routed."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # rescale the kept top-k probabilities to sum to one
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP of intermediate_size
    block: str  # the MLP's name in the layer: "block_sparse_moe" (Mixtral) or "mlp" (Qwen3-MoE)
    expert_names: tuple[str, str, str]  # gate, up and down projections of one expert
    swiglu: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU: (alpha, limit); None: SwiGLU
    router: str = "gate"  # the router's name in the block ("router": gpt-oss's, which has a bias)
    expert_biases: bool = False  # the experts' projections have biases (gpt-oss's)

    @classmethod
    def from_hf(cls, config: dict) -> "MoEConfig | None":
        """The MoE layout of a ``config.json``, or None for a model without routed experts."""
        model_type = config.get("model_type")
        num_layers = config["num_hidden_layers"]
        if model_type == "mixtral":
            return cls(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                       expert_intermediate_size=config["intermediate_size"], renormalize=True,
                       sparse_layers=(True,) * num_layers, block="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        if model_type == "qwen3_moe":
            # Hub configs name the expert count num_experts; transformers 5 writes num_local_experts.
            num_experts = config.get("num_experts", config.get("num_local_experts"))
            dense_layers = set(config.get("mlp_only_layers") or ())
            step = config.get("decoder_sparse_step", 1)
            sparse = tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
                           for i in range(num_layers))
            return cls(num_experts=num_experts, top_k=config["num_experts_per_tok"],
                       expert_intermediate_size=config["moe_intermediate_size"],
                       renormalize=bool(config.get("norm_topk_prob", False)), sparse_layers=sparse, block="mlp",
                       expert_names=("gate_proj", "up_proj", "down_proj"))
        if model_type == "gpt_oss":  # experts as models/gpt_oss.py's reader shows them; softmax over the top k
            return cls(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                       expert_intermediate_size=config["intermediate_size"], renormalize=True,
                       sparse_layers=(True,) * num_layers, block="mlp",
                       expert_names=("gate_proj", "up_proj", "down_proj"),
                       swiglu=(float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))),
                       router="router", expert_biases=True)
        return None


class SparseMoE:
    """Top-k routed SwiGLU experts over a flat ``[T, hidden]`` batch, with one all-reduce after. A family whose
    experts differ (gpt-oss: a biased router, its own gate, biased experts) subclasses ``route``,
    ``activate`` and gives ``down_biases``."""

    def __init__(self, *, router: torch.Tensor, gate_ups: list, downs: list, intermediate: int, top_k: int,
                 renormalize: bool, tp, router_bias: torch.Tensor | None = None,
                 down_biases: torch.Tensor | None = None):
        self.router = router  # [num_experts, hidden], replicated
        self.router_bias = router_bias  # [num_experts] or None
        self.gate_ups, self.downs = gate_ups, downs  # per expert: this rank's fused gate/up and down slices
        self.down_biases = down_biases  # [num_experts, hidden], added once after the all-reduce; None: none
        self.intermediate = intermediate  # each expert's width on this rank
        self.num_experts = len(gate_ups)
        self.top_k, self.renormalize = top_k, renormalize
        self.tp = tp

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights ``[T, k]`` in ``hidden``'s dtype, chosen experts ``[T, k]``)."""
        probs = torch.softmax(F.linear(hidden, self.router, self.router_bias).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), chosen

    # Each expert's share of the tokens is read on the host (one matmul per busy expert), so a step through this
    # block cannot be captured in a CUDA graph (workers/cuda_graphs.py asks).
    capturable = False

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(hidden)
        # Sort the (token, expert) pairs by expert: each expert's tokens are then one contiguous run.
        flat_experts = chosen.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            gate, up = self.gate_ups[expert](hidden.index_select(0, rows)).chunk(2, dim=-1)
            expert_out = self.downs[expert](self.activate(gate, up))
            out.index_add_(0, rows, expert_out * pair_weights[start:start + count])
            start += count
        out = self.tp.all_reduce(out)
        if self.down_biases is None:
            return out
        # each chosen expert's bias, weighted as its output is: once, after the ranks' partial sums are added
        return out + (weights[:, :, None] * self.down_biases[chosen]).sum(dim=1)

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of an expert's gate and up projections (SwiGLU)."""
        return F.silu(gate).mul_(up)


class GptOssMoE(SparseMoE):
    """gpt-oss's experts: softmax over the top ``k`` router logits, its clamped SwiGLU, biased projections."""

    def __init__(self, *, alpha: float, limit: float, **kwargs):
        super().__init__(**kwargs)
        self.alpha, self.limit = alpha, limit

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.router, self.router_bias)
        top, chosen = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


def build_sparse_moe(build, config: MoEConfig, layer_prefix: str, world_size: int, tp) -> SparseMoE:
    """Layer ``layer_prefix``'s experts from ``build`` (a ``WeightBuilder``), each expert's intermediate
    dimension split over ``world_size`` ranks."""
    if config.expert_intermediate_size % world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs the experts' intermediate size "
                         f"({config.expert_intermediate_size}) divisible by {world_size}")
    rows = config.expert_intermediate_size // world_size
    block = f"{layer_prefix}{config.block}."
    gate_name, up_name, down_name = config.expert_names
    gate_ups, downs, down_biases = [], [], []
    for expert in range(config.num_experts):
        prefix = f"{block}experts.{expert}."
        gate_ups.append(build.column_parallel([(prefix + gate_name, rows), (prefix + up_name, rows)]))
        down, down_bias = build.row_parallel(prefix + down_name, rows)
        if (down_bias is not None) != config.expert_biases:
            raise ValueError(f"{prefix + down_name}: expert biases are "
                             f"{'missing' if config.expert_biases else 'not supported'}")
        downs.append(down)
        down_biases.append(down_bias)
    router = f"{block}{config.router}."
    router_bias = build.vector(router + "bias") if build.reader.has(router + "bias") else None
    common = dict(router=build.vector(router + "weight"), router_bias=router_bias, gate_ups=gate_ups, downs=downs,
                  down_biases=torch.stack(down_biases) if config.expert_biases else None, intermediate=rows,
                  top_k=config.top_k, renormalize=config.renormalize, tp=tp)
    if config.swiglu is not None:
        return GptOssMoE(alpha=config.swiglu[0], limit=config.swiglu[1], **common)
    return SparseMoE(**common)
