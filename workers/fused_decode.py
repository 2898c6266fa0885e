"""Decode steps of a small batch through ``decode_layer.c``: one native call for all the layers of a step.

A batch-1 decode step of SmolLM2 in eager torch is ~30 ops a layer (norms, projections, RoPE's slices and
concatenations, attention's bookkeeping, SiLU, residual adds), each a few microseconds of dispatch,
allocation and Python around very little arithmetic: ~900 a step, as much time as streaming the weights.
``FusedDecodeLayers`` replaces the layer loop for steps that only decode: up to ``MAX_ROWS`` sequences
with GEMVs (a pass over each weight row is what bounds such a step), and larger batches of float32
weights with gemm.c's GEMMs inside the same call, where that is built (AVX2 without
AVX-512), as a batch-64 step's ~20 torch ops a layer around the GEMMs cost about a tenth of the step.
Steps with prompts join where the layer takes any batch: the attention backend then gives every token a
kernel row of its own (``AttentionBackend.prompt_rows``). The layer takes a step where the backend's
metadata gives it as kernel rows (``AttentionMetadata.kernel_rows``); everything else keeps the torch path,
which stays the reference.

It applies to a native Llama-family model (routed experts included: ``Experts``, decode_layer.c's
``routed_experts``) on CPU, float32 activations, one rank, an attention backend that
gives kernel rows (the CPU one), and projections it can read: plain float32 ones (the C layer reads weights
as checkpoints store them, [out, in] row-major, so such a model's projections are kept plain,
``Linear.plain``, and also reordered for oneDNN's GEMMs where host memory allows a second copy:
``weight_builder.SECOND_COPY_SHARE``), or int8 ones that otherwise compute through a dense float32 copy
(``--quantize int8`` where quant_kernels.c does not run): the layer's GEMVs then stream the int8 rows, a
quarter of the bytes, and its GEMMs (prompts, large batches) multiply that same float32 copy. Float32
weights that are all bfloat16 numbers (a bfloat16 checkpoint served in float32) also get a bfloat16 copy for
the GEMVs, half the bytes for the same bits (``Bfloat16Copies``). The KV pool is float32, or float16 under
``--kv-cache-dtype float16`` (the layer rounds K/V as it writes them and widens them as attention reads
them, decode_attention.c).
"""

from __future__ import annotations

import ctypes

import structlog
import torch

from llmbus.bus.procfs import mem_available_bytes
from llmbus.workers.attention import AttentionMetadata, attention_backend_class
from llmbus.workers.attention.decode_kernel import score_slots
from llmbus.workers.kernels import bindings
from llmbus.workers.kernels.bindings import MAX_ROWS, Experts, LayerArgs, LayerLora, LoraSite, Proj, StepArgs
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.linear import Linear, StackedLinear
from llmbus.workers.models.moe import SparseMoE
from llmbus.workers.quant import Int8Weight, _DensePack, _KernelPack, tiled_forms
from llmbus.workers.weight_builder import SECOND_COPY_SHARE

log = structlog.get_logger("llmbus.workers")

def _int8_source(projection) -> Int8Weight | None:
    """The int8 weight behind a ``QuantizedLinear`` that computes through a dense float32 copy (float32
    activations where quant_kernels.c does not run), else None."""
    pack = getattr(projection, "_pack", None)
    source = getattr(pack, "source", None)
    return source if isinstance(pack, _DensePack) and isinstance(source, Int8Weight) else None


def _dense_proj(weight: torch.Tensor, keep: list) -> Proj:
    weight = weight.contiguous()
    keep.append(weight)
    return Proj(dense=weight.data_ptr())


def _int8_proj(source: Int8Weight, keep: list) -> Proj:
    values, scale = source.values.contiguous(), source.scale.contiguous()
    keep += [values, scale]
    return Proj(values=values.data_ptr(), scale=scale.data_ptr(), group=source.group or values.shape[1])


class Bfloat16Copies:
    """bfloat16 copies of float32 weights every value of which is a bfloat16 number (a bfloat16 checkpoint
    served in float32), for the GEMVs of small batches to stream: half the bytes, the same numbers, the same
    sums (decode_layer.c's dot_rows_of). The float32 weight stays for the GEMMs of prompts and large
    batches, which arithmetic bounds, and for the torch path. Copies are made while they fit in
    ``budget`` bytes: the second-copy share of host memory, as for oneDNN's reordered weights."""

    CHUNK_ROWS = 4096  # the check converts this many rows at a time, not a second whole float32 weight

    def __init__(self, budget: int):
        self.budget = budget
        self.made = self.bytes = 0

    def add(self, proj: Proj, weight: torch.Tensor, keep: list) -> None:
        size = weight.numel() * 2
        if size > self.budget - self.bytes:
            return
        copy = torch.empty(weight.shape, dtype=torch.bfloat16)
        for start in range(0, weight.shape[0], self.CHUNK_ROWS):
            rows = weight[start:start + self.CHUNK_ROWS]
            copy[start:start + self.CHUNK_ROWS] = rows
            if not torch.equal(copy[start:start + self.CHUNK_ROWS].float(), rows):
                return  # a value bfloat16 cannot hold: a float32 checkpoint
        keep.append(copy)
        proj.bf16 = copy.data_ptr()
        self.made, self.bytes = self.made + 1, self.bytes + size


def _default_bf16_budget(library: ctypes.CDLL) -> int:
    if not library.decode_layer_reads_bf16():
        return 0
    available = mem_available_bytes()
    return 0 if available is None else int(available * SECOND_COPY_SHARE)


def _tiled_pack(projection) -> _KernelPack | None:
    """The tiled kernel form behind a ``QuantizedLinear`` (int8, int4, MXFP4 or bf16 where the tiled kernels
    run)."""
    pack = getattr(projection, "_pack", None)
    return pack if isinstance(pack, _KernelPack) else None


def _proj_args(projection, keep: list, bf16: Bfloat16Copies | None = None) -> Proj | None:
    """The C view of a projection the fused layer can read (plain float32, int8 with group scales, or a
    tiled form), with a bfloat16 copy where ``bf16`` makes one; the tensors it points into are appended to
    ``keep``."""
    if (pack := _tiled_pack(projection)) is not None:
        keep.append(pack)
        return Proj(tiled=pack.tiled(projection.split))
    if isinstance(projection, StackedLinear):  # every part tiled, each pointing to the next
        parts = [_proj_args(part, keep) for part in projection.parts]
        if any(part is None or not part.tiled.values for part in parts):
            return None
        keep.extend(parts)
        for part, following, source in zip(parts, parts[1:], projection.parts):
            part.next, part.rows = ctypes.pointer(following), source.out_features
        return parts[0]
    if isinstance(projection, Linear) and projection.plain and projection.weight.dtype == torch.float32:
        proj = _dense_proj(projection.weight, keep)
        if bf16 is not None:
            bf16.add(proj, projection.weight, keep)
        return proj
    source = _int8_source(projection)
    if source is None:
        return None
    proj = _int8_proj(source, keep)
    copy = projection._pack.linear  # the dequantized copy the torch path multiplies
    if copy.plain and copy.weight.dtype == torch.float32:
        proj.dense = _dense_proj(copy.weight, keep).dense  # for the GEMMs of large batches
    return proj


def _parts(proj: Proj) -> list[Proj]:
    """A projection's parts: itself, and those ``next`` links to."""
    parts = [proj]
    while parts[-1].next:
        parts.append(parts[-1].next.contents)
    return parts


def _experts_args(moe: SparseMoE, keep: list, bf16: Bfloat16Copies | None) -> int | None:
    """The address of a C ``Experts`` for a layer's routed experts (kept alive in ``keep``), or None if a
    projection is one the C layer cannot read, or an expert has a gate/up bias (moe.py builds none)."""
    if moe.tp.world_size != 1 or any(getattr(p, "bias", None) is not None for p in moe.gate_ups):
        return None
    gate_ups = [_proj_args(p, keep, bf16) for p in moe.gate_ups]
    downs = [_proj_args(p, keep, bf16) for p in moe.downs]
    if any(p is None for p in gate_ups + downs):
        return None
    router = moe.router.float().contiguous()
    gate_ups, downs = (Proj * moe.num_experts)(*gate_ups), (Proj * moe.num_experts)(*downs)
    experts = Experts(router=router.data_ptr(), gate_ups=ctypes.addressof(gate_ups), downs=ctypes.addressof(downs),
                      num_experts=moe.num_experts, top_k=moe.top_k, renormalize=int(moe.renormalize),
                      intermediate=moe.intermediate)
    keep += [router, gate_ups, downs, experts]
    return ctypes.addressof(experts)


def _runs_on(device: torch.device, world_size: int, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and world_size == 1 and dtype == torch.float32


def fused_decode_applies(device: torch.device, world_size: int, dtype: torch.dtype, quantize: str | None,
                         attention_backend: str = "auto") -> bool:
    """Whether a native model loaded so will decode through the fused layer (then its projections keep a
    plain copy): decided before the weights are read."""
    backend = attention_backend_class(attention_backend, device)  # make_attention_backend's choice
    return (_runs_on(device, world_size, dtype) and quantize in (None, "int8", *tiled_forms())
            and backend.gives_kernel_rows and bindings.library() is not None)


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecodeLayers:
    """The layer loop of ``LlamaForCausalLM`` (and its final norm and LM head) for the steps it takes, one C
    call for all layers."""

    def __init__(self, model, library: ctypes.CDLL, layers: list[LayerArgs], weights: list,
                 bf16: Bfloat16Copies | None = None):
        """``layers``: each layer's C arguments (``_layer_args``), pointing into ``weights``; ``bf16``: where
        the head gets a bfloat16 copy too."""
        self._function = library.decode_layers_f32
        self._panel_floats = library.decode_layer_panel_floats
        self._head_function = library.lm_head_f32
        self._model = model
        self._layers = (LayerArgs * len(layers))(*layers)
        self._weights = weights  # kept alive: the structures hold raw pointers to them
        # The LM head as a plain [vocab, hidden] float32 weight (a tied embedding) or int8 rows (a tied int8
        # embedding computing through a dense copy); None: the model's own head.
        if model.plain_head_weight is not None:
            self._head = _dense_proj(model.plain_head_weight, weights)
            self._head_shape = tuple(model.plain_head_weight.shape)
            if bf16 is not None:
                bf16.add(self._head, model.plain_head_weight, weights)
        elif (head_pack := _tiled_pack(model.lm_head)) is not None:
            self._head, self._head_shape = _proj_args(model.lm_head, weights), (head_pack.n, head_pack.k)
        elif (head_int8 := _int8_source(model.lm_head)) is not None:
            self._head, self._head_shape = _int8_proj(head_int8, weights), head_int8.shape
        else:
            self._head = None
        config = model.config
        self._experts = [Experts.from_address(layer.experts) for layer in layers if layer.experts]
        self._hidden = config.hidden_size
        self._intermediate = max([config.intermediate_size] + [e.intermediate for e in self._experts])
        first = model.layers[0].attention
        self._num_heads, self._num_kv_heads, self._head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self._eps, self._scale = config.rms_norm_eps, first.scale
        self._scratch: dict[str, torch.Tensor] = {}
        projections = [p for layer in layers
                       for p in (layer.qkv, layer.o_proj) + (() if layer.experts else (layer.gate_up, layer.down))]
        for experts in self._experts:
            for array in (experts.gate_ups, experts.downs):
                projections += (Proj * experts.num_experts).from_address(array)
        # Tiled projections: every step through the same per-row arithmetic, any batch (what makes a row's
        # result independent of its batch); the widest input they prepare as bf16 pairs.
        self._tiled = all(p.tiled.values for p in projections)
        self._widest_tiled = max([part.tiled.k_padded for p in projections for part in _parts(p) if p.tiled.values]
                                 + ([self._head.tiled.k_padded] if self._head is not None else [0]))
        # decode_layer.c's GEMMs (panels exist only where gemm.c runs) for float32 batches past MAX_ROWS
        self._gemm_batches = (not self._tiled and not self._experts and all(p.dense for p in projections)
                              and library.decode_layer_panel_floats(MAX_ROWS + 1, 16) > 0)
        # Batches past MAX_ROWS and prompts: tiled projections, or float32 ones through gemm.c where it runs.
        # decode_layer.c can also run float32 ones as GEMVs in passes of MAX_ROWS rows, each row's sums the
        # same whatever the batch, but at batch 64 that measured 1.62x slower than oneDNN's GEMMs (design
        # notes, "Batch-invariant numerics on CPU"): float32 on AVX-512 keeps the torch layers there.
        self._large_batches = self._tiled or self._gemm_batches
        self._lora: list | None = None  # attach_lora: each layer's LayerLora and what it points into
        self._lora_rank = 0  # the largest rank of any adapted projection

    def attach_lora(self, model) -> None:
        """Point each layer at its LoRA adapters (``workers/lora.py``, after ``attach_adapters``): every
        adapted projection's adapters stacked in float32, so a step with adapter rows runs here too, each
        row adding its own adapter's deltas and base rows computing exactly as without them."""
        from llmbus.workers.lora import stacked_for_native

        keep = []
        for layer, args in zip(model.layers, self._layers):
            sites = {}
            for name, block in (("qkv", layer.attention), ("o_proj", layer.attention), ("gate_up", layer.mlp),
                                ("down", layer.mlp)):
                stacked = stacked_for_native(getattr(block, f"{name}_lora", None))
                if stacked is not None:
                    keep += stacked
                    sites[name] = LoraSite(shrink=_ptr(stacked[0]), expand_t=_ptr(stacked[1]),
                                           rank=stacked[0].shape[1], out_first=_ptr(stacked[2]),
                                           out_last=_ptr(stacked[3]))
                    self._lora_rank = max(self._lora_rank, stacked[0].shape[1])
            if sites:
                lora = LayerLora(**sites)
                keep.append(lora)
                args.lora = ctypes.addressof(lora)
        self._lora = keep

    @staticmethod
    def _layer_args(model, weights: list, bf16: Bfloat16Copies | None = None) -> list[LayerArgs] | None:
        """Each layer's C arguments, pointing into tensors appended to ``weights``; None if a projection is
        one the C layer cannot read."""
        layers = []
        for index, layer in enumerate(model.layers):
            attention, mlp = layer.attention, layer.mlp
            projections = dict(qkv=attention.qkv, o_proj=attention.o_proj)
            experts = isinstance(mlp, SparseMoE)
            if not experts:
                projections |= dict(gate_up=mlp.gate_up, down=mlp.down)
            projections = {name: _proj_args(p, weights, bf16) for name, p in projections.items()}
            if any(p is None for p in projections.values()):
                return None
            if experts:
                projections["experts"] = _experts_args(mlp, weights, bf16)
                if projections["experts"] is None:
                    return None
            vectors = dict(input_norm=layer.input_norm.weight, qkv_bias=attention.qkv.bias, o_bias=attention.o_bias,
                           post_norm=layer.post_attention_norm.weight,
                           gate_up_bias=None if experts else mlp.gate_up.bias,
                           down_bias=None if experts else mlp.down_bias,
                           q_norm=getattr(attention.q_norm, "weight", None),
                           k_norm=getattr(attention.k_norm, "weight", None))
            vectors = {k: None if t is None else t.float().contiguous() for k, t in vectors.items()}
            weights += [t for t in vectors.values() if t is not None]
            layers.append(LayerArgs(**{k: _ptr(t) for k, t in vectors.items()}, **projections,
                                     window=model.attention_backend.window_index(index)))
        return layers

    @classmethod
    def for_model(cls, model, bf16_budget: int | None = None) -> "FusedDecodeLayers | None":
        """The fused path for ``model`` if it applies (see the module's docstring), else None.
        ``bf16_budget``: bytes for bfloat16 copies of weights (``Bfloat16Copies``); None: the default."""
        if (not _runs_on(model.device, model.tp.world_size, model.dtype)
                or not model.attention_backend.gives_kernel_rows
                or model.rotary.rotary_dim != model.config.head_dim  # decode_layer.c rotates whole heads
                or model.config.hidden_act != "silu"):  # and gates with SiLU
            return None
        library = bindings.library()
        if library is None:
            return None
        bf16 = Bfloat16Copies(_default_bf16_budget(library) if bf16_budget is None else bf16_budget)
        weights = []
        layers = cls._layer_args(model, weights, bf16)
        if layers is None:
            return None
        fused = cls(model, library, layers, weights, bf16)
        if bf16.made:
            log.info("small decode steps stream bfloat16 copies of float32 weights that are bfloat16 numbers",
                     projections=bf16.made, copies_mb=round(bf16.bytes / 2**20))
        return fused

    @property
    def invariance_gap(self) -> str | None:
        """Why a row's logits may depend on what shares its step (design notes, "Batch-invariant numerics on
        CPU"), or None: they do not."""
        if self._gemm_batches:
            return "float32 steps past 8 rows multiply through gemm.c's GEMMs (AVX2), others through the GEMV"
        if not self._large_batches:
            return "float32 prompts and steps past 8 rows run through oneDNN's GEMMs, decodes through the GEMV"
        if self._head is None:
            return "the LM head runs through torch"
        return None

    @property
    def takes_large_batches(self) -> bool:
        """Whether ``run`` takes steps of any number of rows (gemm.c's GEMMs inside the layer)."""
        return self._large_batches

    def _buffer(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[name] = torch.empty(numel, dtype=dtype)
        return buffer

    def _prepared(self, rows: int) -> tuple[int, int]:
        """Scratch for tiled projections' inputs (as bf16 hi/lo pairs) and their group sums."""
        numel = 2 * rows * self._widest_tiled
        return (self._buffer("prepared", numel, torch.bfloat16).data_ptr(),
                self._buffer("prepared_sums", numel).data_ptr())

    def logits(self, rows: torch.Tensor, norm) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the final ``norm`` (the model's RMSNorm) of ``rows [B, H]`` of a step
        ``run`` took: one C call for both where the head is one the C GEMV reads and the batch is small,
        the model's own norm and head otherwise (a large batch's head is a GEMM)."""
        head_takes = self._head is not None and (rows.shape[0] <= MAX_ROWS or self._head.tiled.values
                                                 or self._large_batches)
        if not head_takes or norm.weight.dtype != torch.float32:
            return self._model.lm_head(norm(rows))
        rows = rows.contiguous()
        vocab, width = self._head_shape
        logits = rows.new_empty(rows.shape[0], vocab)
        normed = self._buffer("head_normed", rows.numel())
        if self._head_function(ctypes.byref(self._head), norm.weight.data_ptr(), norm.eps, rows.data_ptr(), width,
                               vocab, rows.shape[0], normed.data_ptr(), logits.data_ptr(),
                               *self._prepared(rows.shape[0])) != 0:
            raise ValueError("the fused LM head cannot take this shape")
        return logits

    def _expert_scratch(self, step: StepArgs, batch: int) -> None:
        """``step``'s scratch for layers with routed experts (llmbus_kernels.h's StepArgs)."""
        most = max(e.num_experts for e in self._experts)
        choices = batch * max(e.top_k for e in self._experts)
        for name, numel in (("expert_probs", batch * most), ("expert_weights", 2 * choices),
                            ("expert_in", batch * self._hidden), ("expert_out", batch * self._hidden),
                            ("expert_sum", batch * self._hidden)):
            setattr(step, name, self._buffer(name, numel).data_ptr())
        step.expert_rows = self._buffer("expert_rows", 2 * choices + most + 1, torch.int64).data_ptr()

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache,
            meta: AttentionMetadata, adapters=None) -> bool:
        """Every layer over ``hidden [B, H]`` (float32, updated in place) if this step is one the fused
        path takes; False (nothing done) otherwise. ``adapters``: the step's LoRA rows (``lora.StepAdapters``),
        whose deltas it adds where ``attach_lora`` gave it the adapters."""
        group = meta.kernel_rows
        if (group is None or (hidden.shape[0] > MAX_ROWS and not self._large_batches)
                or kv_cache.key.dtype not in (torch.float32, torch.float16)
                or (adapters is not None and self._lora is None)):
            return False
        batch = hidden.shape[0]
        qkv_width = (self._num_heads + 2 * self._num_kv_heads) * self._head_dim
        scores_stride = -(-group.max_context // 16) * 16 + 16
        buffers = {"normed": batch * self._hidden, "qkv_out": batch * qkv_width,
                   "attended": batch * self._num_heads * self._head_dim, "act": batch * self._intermediate,
                   "scores": score_slots() * (self._num_heads // self._num_kv_heads)
                   * scores_stride}
        if self._tiled or self._experts:
            buffers["gate_up_out"] = batch * 2 * self._intermediate
        elif batch > MAX_ROWS:
            widest_input = max(self._hidden, self._num_heads * self._head_dim, self._intermediate)
            buffers |= {"gate_up_out": batch * 2 * self._intermediate,
                        "panels": self._panel_floats(batch, widest_input)}
        if adapters is not None:  # an adapted gate/up adds its delta before SiLU, in this buffer
            buffers["gate_up_out"] = batch * 2 * self._intermediate
        cos, sin = cos.reshape(batch, -1).contiguous(), sin.reshape(batch, -1).contiguous()
        step = StepArgs(batch=batch, hidden=self._hidden, intermediate=self._intermediate,
                         num_heads=self._num_heads, num_kv_heads=self._num_kv_heads, head_dim=self._head_dim,
                         pool_blocks=kv_cache.num_blocks + 1, block_size=kv_cache.block_size,
                         table_stride=group.block_index.stride(0), scores_stride=scores_stride,
                         eps=self._eps, scale=self._scale, cos=cos.data_ptr(), sin=sin.data_ptr(),
                         slots=meta.slot_mapping.data_ptr(), tables=group.block_index.data_ptr(),
                         lens=group.context_lens.data_ptr(),
                         # rows of one sequence (speculation) start in the same block
                         rows_share_sequences=int(batch > 1 and bool(
                             torch.unique(group.block_index[:, 0]).numel() < batch)),
                         **{name: self._buffer(name, n).data_ptr() for name, n in buffers.items()})
        starts = (ctypes.c_void_p * len(group.window_starts))(*[t.data_ptr() for t in group.window_starts])
        step.pool_key, step.pool_value = kv_cache.key.data_ptr(), kv_cache.value.data_ptr()
        step.pool_layer_stride, step.starts = kv_cache.key.stride(0), ctypes.cast(starts, ctypes.c_void_p)
        step.pool_f16 = int(kv_cache.key.dtype == torch.float16)
        step.prepared, step.prepared_sums = self._prepared(batch)
        if self._experts:
            self._expert_scratch(step, batch)
        if adapters is not None:
            step.adapter_slots = adapters.slots.data_ptr()
            step.lora_scratch = self._buffer("lora", batch * self._lora_rank).data_ptr()
        if self._function(ctypes.byref(step), self._layers, len(self._layers), hidden.data_ptr()) != 0:
            raise ValueError("the fused decode layer cannot take this shape")
        return True
