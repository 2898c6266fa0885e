"""LoRA adapters served beside the base model (``--lora-adapters``, a request's ``adapter_id``), as vLLM, SGLang
and TGI serve them: the base weights stay as they are, shared by every request, and a step's rows of adapter
``a`` get ``a``'s low-rank delta added to the projections it adapts.

An adapter is a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``): for a projection
``W [out, in]``, ``y = W x + s * B (A x)`` with ``A [r, in]``, ``B [out, r]`` and ``s = alpha / r``
(``alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern``/``alpha_pattern`` give a module its own ``r`` and
``alpha``, matched as PEFT matches them). ``s`` is folded into ``B`` at load, and both are cast to the dtype the
model computes in, as PEFT computes the delta in the adapter's dtype.

The native decoder fuses its projections (``models/llama.py``): one QKV and one gate/up matmul
(column-parallel), ``o_proj`` and ``down`` (row-parallel). A delta goes where its base product goes:

- column-parallel: ``A`` whole, ``B``'s rows cut exactly as the base weight's rows are
  (``WeightBuilder.row_spans``: the same parts, key/value heads replicated alike when ranks outnumber them).
  The q, k and v adapters of a layer shrink in one matmul (their ``A`` stacked) and expand through one
  block-diagonal ``B`` (zero where a part is not adapted), so a fused projection costs two matmuls per adapter
  in the step whatever it targets; Phi-3's fused ``qkv_proj``/``gate_up_proj`` are one ``A`` cut into parts.
- row-parallel: ``A``'s columns cut as the base weight's columns, ``B`` whole: each rank adds its partial delta
  before the all-reduce, which sums it exactly as it sums the base's partial products.

A step's rows are grouped by adapter once (``StepAdapters``, built by the runner): one adapter covering the
whole step takes no index ops; several gather their rows (``index_select``) and add back (``index_add_``).
Where the layers' small ops are Triton kernels (CUDA) the deltas are too (``gpu_ops.lora_delta``): every
adapter stacked, each row reading its own from a per-row slot, so a CUDA graph holds them
(``cuda_graphs.py`` captures each size again with them).
On CPU the fused decode layer adds them itself (``FusedDecodeLayers.attach_lora``: the stacked float32 form,
``B`` transposed; decode_layer.c's ``lora_add``), only to adapter rows, so a base row computes exactly what it
computes without adapter rows beside it (batch invariance).
A step with no adapter row runs exactly the code it ran before adapters existed: the layers' deltas return at
once, and the fused CPU decode layer and the plain CUDA graphs take it as before.

What cannot be served is refused at load with ``LoraError``, naming the adapter and the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.bus.service import ServiceError
from llmbus.workers import gpu_ops
from llmbus.workers.launched_step import to_device

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# A checkpoint module's name -> the native decoder's projection it adds to (the block's attribute
# ``<site>_lora``, and its ``lora_sites`` entry: which rows or columns of which modules this rank holds).
SITE_OF_MODULE = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o_proj",
                  "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up", "down_proj": "down"}
BLOCK_OF_SITE = {"qkv": "self_attn", "o_proj": "self_attn", "gate_up": "mlp", "down": "mlp"}
ROW_PARALLEL_SITES = ("o_proj", "down")
# A decoder layer's module as PEFT saves it: under the text model of a causal LM (``model.``) or of Gemma 3's
# multimodal checkpoint (``model.language_model.`` in transformers 5, ``language_model.model.`` before).
_LAYER_MODULE = re.compile(r"(?:model\.|model\.language_model\.|language_model\.model\.)layers\.(?P<layer>\d+)\."
                           r"(?P<block>[^.]+)\.(?P<name>.+)")
_KEY_PREFIX = "base_model.model."
# LoraConfig fields whose LoRA variants compute something other than ``W x + s * B (A x)``.
_VARIANTS = ("use_dora", "lora_bias", "use_qalora", "use_bdlora", "kasa_config", "arrow_config",
             "monteclora_config", "alora_invocation_tokens", "trainable_token_indices", "layer_replication",
             "target_parameters")


class LoraError(ServiceError, ValueError):
    """An adapter that cannot be served, and why: said to whoever started the server, in one line (a
    ServiceError, which the rank reports without a traceback)."""


@dataclass(frozen=True, slots=True)
class AdapterModule:
    """One adapted module of a checkpoint: ``A [r, in]`` and ``B [out, r]`` with its scaling folded in (float32)."""

    layer: int
    block: str  # self_attn, mlp
    name: str  # q_proj, ..., gate_up_proj
    shrink: torch.Tensor
    expand: torch.Tensor


def read_adapter(name: str, path: str) -> list[AdapterModule]:
    """The modules adapter ``name`` (a PEFT LoRA folder at ``path``) adapts, checked for what can be served."""

    def refuse(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} ({path}): {why}")

    config_path, weights_path = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(config_path):
        raise refuse(f"no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise refuse("only adapter_model.bin (a pickle) is there: convert it to adapter_model.safetensors "
                         "(PeftModel.from_pretrained(...).save_pretrained(..., safe_serialization=True))")
        raise refuse(f"no {ADAPTER_WEIGHTS}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise refuse(f"{ADAPTER_CONFIG} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    _check_config(config, refuse)
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types, said in one line
        raise refuse(f"{ADAPTER_WEIGHTS} cannot be read: {type(e).__name__}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, matrix = _split_key(key, refuse)
        pairs.setdefault(module, {})[matrix] = tensor
    if not pairs:
        raise refuse(f"{ADAPTER_WEIGHTS} holds no LoRA matrices")
    modules = []
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise refuse(f"{module} has lora_{'A' if 'B' in pair else 'B'} and not the other")
        shrink, expand = pair["A"].float(), pair["B"].float()
        if shrink.dim() != 2 or expand.dim() != 2 or shrink.shape[0] != expand.shape[1]:
            raise refuse(f"{module}: lora_A {list(shrink.shape)} and lora_B {list(expand.shape)} are not "
                         f"[r, in] and [out, r]")
        match = _LAYER_MODULE.fullmatch(module)
        if match is None:
            raise refuse(f"adapts {module}, which is not a decoder layer's projection (supported: "
                         f"{', '.join(SITE_OF_MODULE)})")
        block, module_name = match["block"], match["name"]
        if "experts" in module_name.split(".") or block == "block_sparse_moe":
            raise refuse(f"adapts {module}, a routed expert's projection: LoRA on MoE experts is not supported "
                         f"(attention projections are)")
        site = SITE_OF_MODULE.get(module_name)
        if site is None or BLOCK_OF_SITE[site] != block:
            raise refuse(f"adapts {module}, which LoRA cannot be applied to here (supported: "
                         f"{', '.join(SITE_OF_MODULE)} of self_attn and mlp)")
        rank = shrink.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(AdapterModule(int(match["layer"]), block, module_name, shrink, expand * scaling))
    return modules


def _check_config(config: dict, refuse) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise refuse(f"peft_type is {peft_type!r}: only LORA adapters are served")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} replaces whole base modules: not supported")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config['bias']!r} trains the base model's biases: only bias \"none\" is supported")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out (Conv1D-style weights, GPT-2) is not supported")
    variants = [field for field in _VARIANTS if config.get(field)]
    if variants:
        raise refuse(f"{', '.join(variants)}: LoRA variants other than plain LoRA are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        others = [t for t in targets if t.rsplit(".", 1)[-1] not in SITE_OF_MODULE]
        if others:
            raise refuse(f"target_modules {others} cannot be adapted (supported: {', '.join(SITE_OF_MODULE)}; "
                         f"not embed_tokens, lm_head or MoE experts)")


def _split_key(key: str, refuse) -> tuple[str, str]:
    """(the module's name in the base model, "A" or "B") of a saved key
    ``base_model.model.<module>.lora_A.weight``."""
    module, _, suffix = key.removeprefix(_KEY_PREFIX).rpartition(".lora_")
    if not key.startswith(_KEY_PREFIX) or suffix not in ("A.weight", "B.weight"):
        what = key.removeprefix(_KEY_PREFIX).split(".lora_")[0]
        raise refuse(f"{key} is not a linear LoRA matrix ({what} cannot be adapted: supported are "
                     f"{', '.join(SITE_OF_MODULE)})")
    return module, suffix[0]


def _pattern_value(patterns: dict, module: str, default):
    """``patterns``' value for ``module`` as PEFT's ``get_pattern_key`` picks it: the first key that matches
    the end of the module's name at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class StepAdapters:
    """A step's token rows by adapter, in the two forms the deltas take them: grouped, ``(adapter index,
    rows)`` per adapter present, rows None when it covers every row of the step (its delta then needs no index
    op); and ``slots``, each row's adapter index + 1 (0: the base model) on the device, which the Triton
    kernels read (``gpu_ops.lora_delta``). A CUDA graph's step has only ``slots``, in the graph's buffers."""

    __slots__ = ("groups", "slots")

    def __init__(self, groups: list[tuple[int, torch.Tensor | None]] | None, slots: torch.Tensor | None = None):
        self.groups, self.slots = groups, slots

    @classmethod
    def of(cls, adapters: list[str], query_lens: list[int], index: dict[str, int], device: torch.device,
           grouped: bool = True) -> "StepAdapters | None":
        """The rows of a step whose sequence ``i`` names ``adapters[i]`` ("" for the base model) and has
        ``query_lens[i]`` rows; None when no row has an adapter. ``grouped=False``: ``slots`` only (the kernels
        read nothing else), no index tensors to upload."""
        if not any(adapters):
            return None
        rows: dict[int, list[int]] = {}
        slots: list[int] = []
        start = 0
        for name, count in zip(adapters, query_lens):
            if name:
                if name not in index:
                    raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(index) or 'none'})")
                rows.setdefault(index[name], []).extend(range(start, start + count))
            slots.extend([index[name] + 1 if name else 0] * count)
            start += count
        groups = ([(adapter, None if len(taken) == start else to_device(taken, torch.long, device))
                   for adapter, taken in rows.items()] if grouped else None)
        return cls(groups, to_device(slots, torch.int32, device))


class ActiveAdapters:
    """What the model's adapted projections read while a step with adapter rows runs its layers; ``kernels``:
    whether they add their deltas with the Triton kernels (by ``StepAdapters.slots``, so a CUDA graph can hold
    them), decided where the adapters are loaded."""

    __slots__ = ("step", "kernels")

    def __init__(self):
        self.step: StepAdapters | None = None
        self.kernels = False

    @contextmanager
    def serving(self, step: StepAdapters | None):
        self.step = step
        try:
            yield
        finally:
            self.step = None


class LoraProjection:
    """The adapters of one of a layer's projections on this rank: per adapter index, ``(A, B)`` to add as
    ``(x @ A.T) @ B.T`` to its output, or None where that adapter leaves it alone; where the kernels run, all of
    them stacked instead (``stacked``: every ``A`` in ``[adapters + 1, R, in]``, every ``B`` in ``[adapters + 1,
    out, R]``, zero-padded to the largest rank R, index 0 the base model's, never read)."""

    __slots__ = ("active", "pairs", "stacked")

    def __init__(self, active: ActiveAdapters, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]):
        self.active = active
        self.pairs, self.stacked = (None, _stacked(pairs)) if active.kernels else (pairs, None)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``, a tensor of its own) with each of the step's rows' adapter delta
        added, in place."""
        step = self.active.step
        if step is None:
            return y
        if self.stacked is not None:  # every row's own delta in two kernels, whatever the mix
            return gpu_ops.lora_delta(x, y, *self.stacked, step.slots)
        for adapter, rows in step.groups:
            pair = self.pairs[adapter]
            if pair is None:
                continue
            shrink, expand = pair
            if rows is None:
                y.add_(F.linear(F.linear(x, shrink), expand).to(y.dtype))
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), shrink), expand).to(y.dtype))
        return y


def stacked_for_native(projection: "LoraProjection | None") -> tuple[torch.Tensor, ...] | None:
    """A projection's adapters stacked as ``LoraProjection.stacked``, float32, ``B`` transposed to ``[slots,
    R, out]`` (each rank's column contiguous over the outputs), and per (slot, rank) the first and past-last
    output its column reaches (int64; equal where it reaches none: a padded rank), for the fused CPU layer
    (decode_layer.c's LoraSite); None where no adapter adapts it."""
    if projection is None:
        return None
    shrink, expand = projection.stacked if projection.stacked is not None else _stacked(projection.pairs)
    expand_t = expand.float().transpose(1, 2).contiguous()
    reached = expand_t != 0
    some = reached.any(dim=-1)
    width = expand_t.shape[-1]
    first = torch.where(some, reached.int().argmax(dim=-1), 0)
    last = torch.where(some, width - reached.flip(-1).int().argmax(dim=-1), 0)
    return shrink.float().contiguous(), expand_t, first.long().contiguous(), last.long().contiguous()


def _stacked(pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """``LoraProjection.stacked`` of ``pairs`` (on the model's device, in its dtype)."""
    live = [pair for pair in pairs if pair is not None]
    rank = max(shrink.shape[0] for shrink, _ in live)
    like = live[0][0]
    shrink = like.new_zeros(len(pairs) + 1, rank, like.shape[1])
    expand = like.new_zeros(len(pairs) + 1, live[0][1].shape[0], rank)
    for slot, pair in enumerate(pairs, start=1):
        if pair is not None:
            shrink[slot, :pair[0].shape[0]] = pair[0]
            expand[slot, :, :pair[1].shape[1]] = pair[1]
    return shrink, expand


def _base_shapes(config) -> dict[str, tuple[int, int]]:
    """Each adaptable module's whole ``[out, in]`` in a model of ``config`` (a ``DecoderConfig``)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "qkv_proj": (q + 2 * kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def _site_pair(site: str, spans: list[tuple[str, int, int]], modules: dict[str, AdapterModule]):
    """This rank's ``(A, B)`` of one adapter on one projection (None if it adapts none of its parts).

    ``spans``: the base projection's parts on this rank, ``(checkpoint prefix, first, stop)``: rows of the
    fused output in order for a column-parallel site, the one column slice for a row-parallel one."""
    if site in ROW_PARALLEL_SITES:
        (prefix, start, stop), = spans
        module = modules.get(prefix.rsplit(".", 1)[-1])
        return None if module is None else (module.shrink[:, start:stop], module.expand)
    names = [prefix.rsplit(".", 1)[-1] for prefix, _, _ in spans]
    adapted = [n for n in dict.fromkeys(names) if n in modules]  # a fused module's A once for its parts
    if not adapted:
        return None
    offsets, rank = {}, 0
    for n in adapted:
        offsets[n], rank = rank, rank + modules[n].shrink.shape[0]
    out_rows = sum(stop - start for _, start, stop in spans)
    expand = torch.zeros(out_rows, rank)
    row = 0
    for n, (_, start, stop) in zip(names, spans):
        if n in modules:
            expand[row:row + stop - start, offsets[n]:offsets[n] + modules[n].shrink.shape[0]] = \
                modules[n].expand[start:stop]
        row += stop - start
    return torch.cat([modules[n].shrink for n in adapted]), expand


def attach_adapters(model, adapters: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """Load ``adapters`` ((name, PEFT folder) each) into ``model``'s projections, this rank's slice of each;
    {name: index}, in order. Raises ``LoraError`` for what cannot be served."""
    if not adapters:
        return {}
    names = [name for name, _ in adapters]
    for name in names:
        if not name or names.count(name) > 1:
            raise LoraError(f"LoRA adapter names must be unique and not empty: {names}")
    layers = getattr(model, "layers", None)
    if getattr(model, "active_adapters", None) is None or layers is None:
        raise LoraError(f"LoRA adapters {names}: model_type {model.config.model_type!r} runs through the "
                        f"transformers fallback; adapters need a natively served model")
    shapes = _base_shapes(model.config)
    by_adapter = []
    for name, path in adapters:
        wanted: dict[tuple[int, str], dict[str, AdapterModule]] = {}
        for module in read_adapter(name, path):
            where = f"LoRA adapter {name!r} ({path}): layer {module.layer}'s {module.block}.{module.name}"
            if module.layer >= len(layers):
                raise LoraError(f"{where}: the model has {len(layers)} layers")
            site = SITE_OF_MODULE[module.name]
            block = layers[module.layer].attention if module.block == "self_attn" else layers[module.layer].mlp
            sites = getattr(block, "lora_sites", None)
            if sites is None:
                raise LoraError(f"{where}: this layer's {module.block} is {type(block).__name__} (routed experts), "
                                f"which LoRA cannot reach")
            if module.name not in {p.rsplit(".", 1)[-1] for p, _, _ in sites[site]}:
                present = sorted({p.rsplit(".", 1)[-1] for p, _, _ in sites[site]})
                raise LoraError(f"{where}: the base model's layer has {', '.join(present)} instead")
            expected = shapes[module.name]
            found = (module.expand.shape[0], module.shrink.shape[1])
            if found != expected:
                raise LoraError(f"{where} is [out, in] = {list(found)}, the base model's is {list(expected)}: "
                                f"an adapter for another model")
            wanted.setdefault((module.layer, site), {})[module.name] = module
        by_adapter.append(wanted)
    active = model.active_adapters
    # Where the layers' small ops run as Triton kernels (CUDA), so do the deltas: graph-capturable, one pair
    # of launches a projection whatever the step's adapters.
    active.kernels = gpu_ops.available(torch.empty(0, device=model.device))
    for i, layer in enumerate(layers):
        for block in (layer.attention, layer.mlp):
            for site, spans in getattr(block, "lora_sites", {}).items():
                pairs = [_site_pair(site, spans, wanted.get((i, site), {})) for wanted in by_adapter]
                if any(pair is not None for pair in pairs):
                    setattr(block, f"{site}_lora", LoraProjection(active, [
                        None if pair is None else tuple(_on_model(t, model) for t in pair) for pair in pairs]))
    if getattr(model, "fused_decode", None) is not None:
        model.fused_decode.attach_lora(model)
    return {name: i for i, name in enumerate(names)}


def _on_model(t: torch.Tensor, model) -> torch.Tensor:
    """``t`` on the model's device in the dtype it computes in."""
    return t.to(device=model.device, dtype=model.dtype).contiguous()
