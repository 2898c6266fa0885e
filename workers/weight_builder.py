"""This rank's projections, built from a checkpoint reader: dense, quantized from float (``--quantize``),
or kept in a GGUF file's or a GPTQ/AWQ checkpoint's own quantized values.

A model names what it needs (fused column-parallel parts, a row-parallel column slice, a vocabulary
shard); the builder decides each one's form and counts what it did, so the startup log can say what was
kept and what was converted:

- a GGUF tensor stored as Q4_0/Q4_1 stays 4-bit and Q8_0 int8, both in groups of 32, Q4_K 4-bit in groups of 32
  and Q6_K int8 in groups of 16, all with exactly its values (``quant.from_gguf``), when the activations are
  bfloat16/float16 on CPU, and so does a GPTQ/AWQ projection (``prequantized_checkpoint.py``) and a gpt-oss
  MXFP4 expert (``models/gpt_oss.py``): the reader's ``read_quantized`` gives the form. In float32 (the
  reference precision) and on a GPU every tensor is dequantized, as transformers does.
- any other float or dequantized tensor is quantized when ``--quantize`` asks, else kept dense.
- the embedding and the LM head become int8 (never int4: the logits are the most sensitive product)
  when quantizing, or when the file stores them quantized; a tied pair shares the one int8 matrix.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
import torch.nn.functional as F

from llmbus.bus.procfs import mem_available_bytes
from llmbus.workers import quant
from llmbus.workers.linear import Linear, StackedLinear, onednn_packs

FLOAT_TYPES = ("F32", "F16", "BF16", "safetensors")  # how _stored names float tensors
QUANT_BLOCK = 32  # the smallest block of the GGUF types kept quantized (a K-quant's is 256: its reader says)
# With ``keep_plain``, the share of the host's available memory that second (oneDNN-packed) copies of dense
# projections may take, where oneDNN computes them (not float32 where gemm.c runs). Before gemm.c they made
# a 2-core AVX2 machine's GEMMs faster (design notes, "Dense projections on CPU"); a small model's copies
# cost little, but a model that fills the machine keeps one plain copy (MKL then packs it on every call).
SECOND_COPY_SHARE = 0.25


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (host memory, often a view of the checkpoint's memory map) on the GPU in ``dtype``. Through a
    pinned staging copy: the DMA engine reads page-locked memory directly, where a pageable source is
    copied into a driver buffer first, in small synchronous pieces; ``non_blocking`` lets the next tensor's
    read from disk overlap this one's transfer (the caching host allocator keeps the staging block until
    its copy is done). Cast on the GPU: the copy moves the checkpoint's bytes, not a widened float32."""
    if t.device.type != "cpu":
        return t.to(device=device, dtype=dtype).contiguous()
    staged = t.contiguous().pin_memory()
    return staged.to(device, non_blocking=True).to(dtype)


class WeightBuilder:
    def __init__(self, reader, *, rank: int, world_size: int, dtype: torch.dtype, device: torch.device,
                 quantize: str | None = None, bf16_inputs: bool = False, keep_plain: bool = False):
        """``keep_plain`` keeps dense projections plain (see ``Linear``) for the fused decode layer, and
        also packed while the copies fit in ``SECOND_COPY_SHARE`` of the available host memory."""
        if quantize is not None and quantize not in quant.WEIGHT_FORMS:
            raise ValueError(f"unknown quantization {quantize!r} (known: {', '.join(quant.QUANTIZE_METHODS)})")
        if quantize is not None and device.type != "cpu":
            raise ValueError(f"--quantize {quantize} runs on CPU only (its kernels are torch's CPU ops)")
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.dtype, self.device, self.quantize = dtype, device, quantize
        self.keep_plain = keep_plain
        self.bf16_inputs = bf16_inputs  # for the quantized and bf16 projections (quant.compute_plan)
        available = mem_available_bytes() if keep_plain else None
        self.second_copy_budget = 0 if available is None else int(available * SECOND_COPY_SHARE)
        self.keep_quantized = (hasattr(reader, "read_quantized") and device.type == "cpu"
                               and (dtype in (torch.bfloat16, torch.float16) or quantize == "bf16"))
        self.report: Counter[str] = Counter()  # "Q4_1 -> int4 (kept)": count of tensors

    def place(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return upload(t, self.device, self.dtype)
        placed = t.to(device=self.device, dtype=self.dtype).contiguous()
        # A tensor read in the model's dtype can still be a view of the checkpoint's memory map; one
        # kept alive holds the whole mapped file resident (design notes, "Freed memory stays in the heap").
        return placed.clone() if placed.data_ptr() == t.data_ptr() else placed

    def _stored(self, name: str) -> str:
        """How the checkpoint stores ``name``: a GGUF type ("Q4_1"), or "safetensors"."""
        qtype = getattr(self.reader, "qtype", None)
        return qtype(name) if qtype is not None else "safetensors"

    def _count(self, names: list[str], form: str) -> None:
        for name in names:
            self.report[f"{self._stored(name)} -> {form}"] += 1

    def _linear(self, weight_names: list[str], kept: list | None, floats, bias) -> object:
        if kept is not None and (linear := self._kept_linear(weight_names, kept, bias)) is not None:
            return linear
        dense = floats()
        if self.quantize is not None:
            self._count(weight_names, _FORM_LABELS.get(self.quantize, self.quantize))
            return quant.QuantizedLinear(quant.quantize(dense, self.quantize), bias, self.dtype,
                                         bf16_inputs=self.bf16_inputs)
        self._count(weight_names, _dtype_label(self.dtype))
        return self._dense_linear(self.place(dense), bias)

    def _kept_linear(self, weight_names: list[str], kept: list, bias: torch.Tensor | None) -> object | None:
        """A projection of the kept parts: one weight, or, where their forms differ (llama.cpp's Q4_K_M puts a
        Q6_K v beside Q4_K q and k), each run of parts of one form fused and the runs stacked; None if a run's
        parts cannot be fused."""
        try:
            weights = [_cat(list(run)) for _, run in itertools.groupby(kept, key=lambda w: (type(w), w.group))]
        except ValueError:  # parts of one form whose inputs differ
            return None
        # a fused checkpoint tensor is one name for its parts, all of one form
        for name, weight in zip(weight_names, kept if len(weight_names) == len(kept) else weights):
            self._count([name], _KEPT_LABELS[type(weight)])
        if len(weights) == 1:
            return quant.QuantizedLinear(weights[0], bias, self.dtype, bf16_inputs=self.bf16_inputs)
        parts, first = [], 0
        for weight in weights:
            rows = weight.shape[0]
            share = None if bias is None else bias[first:first + rows]
            parts.append(quant.QuantizedLinear(weight, share, self.dtype, bf16_inputs=self.bf16_inputs))
            first += rows
        self.report["fused projections of parts kept in different forms"] += 1
        return StackedLinear(parts, bias)

    def _dense_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if not self.keep_plain or not onednn_packs(weight):  # gemm.c's projections are plain and unpacked
            return Linear(weight, bias)
        copy_bytes = weight.numel() * weight.element_size()
        pack = copy_bytes <= self.second_copy_budget
        self.second_copy_budget -= copy_bytes if pack else 0
        self.report["dense projections kept plain" + (" and packed" if pack else " only")] += 1
        return Linear(weight, bias, pack=pack, keep_plain=True)

    def column_parallel(self, parts: list[tuple]) -> object:
        """One projection fusing ``parts`` (``(prefix, rows_per_shard[, first_row[, ranks_per_shard]])``:
        ``prefix.weight`` and optional ``prefix.bias``, from row ``first_row`` on: one part of a tensor that is
        already fused in the checkpoint, as Phi-3's ``qkv_proj``), each cut to this rank's shard and stacked in
        order. A shard is one rank's unless ``ranks_per_shard`` ranks hold it alike: the key/value heads of a
        model with fewer of them than ranks (multi-query) are replicated, as vLLM does."""
        spans = self.row_spans(parts)
        names = [f"{p}.weight" for p, _, _ in spans]
        kept = None
        if self.keep_quantized:
            kept = [self.reader.read_quantized(n, rows=(a, b)) for n, (_, a, b) in zip(names, spans)]
            kept = kept if all(k is not None for k in kept) else None
        biases = [self.reader.read_rows(f"{p}.bias", a, b) if self.reader.has(f"{p}.bias") else None
                  for p, a, b in spans]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("a fused projection has biases on some of its parts only")
        bias = None if biases[0] is None else self.place(torch.cat(biases))
        return self._linear(list(dict.fromkeys(names)), kept,  # a fused checkpoint tensor is counted once
                            lambda: torch.cat([self.reader.read_rows(n, a, b) for n, (_, a, b) in zip(names, spans)]),
                            bias)

    def row_spans(self, parts: list[tuple]) -> list[tuple[str, int, int]]:
        """``(prefix, first row, stop row)`` of each of ``column_parallel``'s ``parts`` on this rank, in the order
        they are stacked (a LoRA adapter's B matrices are cut alike, workers/lora.py)."""
        return [(part[0], offset + shard * part[1], offset + (shard + 1) * part[1])
                for part in parts for offset, shard in [(part[2] if len(part) > 2 else 0,
                                                         self.rank // (part[3] if len(part) > 3 else 1))]]

    def column_span(self, prefix: str, per_rank: int) -> tuple[str, int, int]:
        """``(prefix, first column, stop column)`` of ``row_parallel``'s slice of ``prefix`` on this rank."""
        return prefix, self.rank * per_rank, (self.rank + 1) * per_rank

    def row_parallel(self, prefix: str, per_rank: int) -> tuple[object, torch.Tensor | None]:
        """(projection over this rank's input columns, the bias to add once after the all-reduce)."""
        _, start, stop = self.column_span(prefix, per_rank)
        name = f"{prefix}.weight"
        kept = None
        # A rank's columns that are not whole blocks of the file's quantization are expanded instead (the
        # tiny test model's 352-wide MLP over 2 ranks: 176 columns each, blocks of 32).
        if self.keep_quantized and start % QUANT_BLOCK == 0 and stop % QUANT_BLOCK == 0:
            raw = self.reader.read_quantized(name, cols=(start, stop))
            kept = [raw] if raw is not None else None
        bias = self.place(self.reader.read(f"{prefix}.bias")) if self.reader.has(f"{prefix}.bias") else None
        return self._linear([name], kept, lambda: self.reader.read_cols(name, start, stop), None), bias

    def vector(self, name: str) -> torch.Tensor:
        return self.place(self.reader.read(name))

    def vocab_shard(self, name: str, vocab_size: int, hidden: int) -> tuple[torch.Tensor | quant.Int8Weight, bool]:
        """(this rank's rows of a vocabulary matrix, padded with zero rows so every rank holds as many:
        a GGUF's Q8_0 rows as they are, else floats in the dtype they are read in (not widened: a bf16 head of
        201k x 2880 would take 2.3 GB more); whether it should be int8)."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        stop = min(start + per_rank, vocab_size)
        stored_quantized = self.keep_quantized and self._stored(name) not in FLOAT_TYPES
        if stored_quantized and self._stored(name) in ("Q8_0", "Q6_K"):  # int8 (groups of 32, 16): its own values
            kept = self.reader.read_quantized(name, rows=(start, stop))
            padding = per_rank - (stop - start)
            if padding:
                kept = quant.Int8Weight.cat([kept, quant.Int8Weight(
                    torch.zeros(padding, hidden, dtype=torch.int8), torch.zeros(padding, kept.scale.shape[1]),
                    kept.group)])
            return kept, True
        rows = self.reader.read_rows(name, start, stop)
        if stop - start == per_rank:
            return rows, self.quantize is not None or stored_quantized
        shard = rows.new_zeros(per_rank, hidden)
        shard[: stop - start] = rows
        return shard, self.quantize is not None or stored_quantized

    def embedding_and_head(self, vocab_size: int, hidden: int, tied: bool):
        """(embedding lookup, LM head projection, rows per rank) for the vocabulary-parallel pair."""
        embed, embed_int8 = self.vocab_shard("model.embed_tokens.weight", vocab_size, hidden)
        if tied:
            head, head_int8 = embed, embed_int8
        else:
            head, head_int8 = self.vocab_shard("lm_head.weight", vocab_size, hidden)
        if self.quantize == "bf16" and not isinstance(embed, quant.Int8Weight) and not isinstance(
                head, quant.Int8Weight):
            return self._bf16_embedding_and_head(embed, head, tied)
        if embed_int8:
            embed_q = embed if isinstance(embed, quant.Int8Weight) else quant.quantize_int8(embed)
            embedding = quant.QuantizedEmbedding(embed_q, self.dtype)
            self._count(["model.embed_tokens.weight"], "int8")
        else:
            embed_dense = self.place(embed)
            embedding = DenseEmbedding(embed_dense)
            self._count(["model.embed_tokens.weight"], _dtype_label(self.dtype))
        if head_int8:
            head_q = embed_q if tied else head if isinstance(head, quant.Int8Weight) else quant.quantize_int8(head)
            lm_head = quant.QuantizedLinear(head_q, None, self.dtype, bf16_inputs=self.bf16_inputs)
        else:
            lm_head = Linear(embed_dense if tied and not embed_int8 else self.place(head))
        if not tied:
            self._count(["lm_head.weight"], "int8" if head_int8 else _dtype_label(self.dtype))
        return embedding, lm_head, embed.shape[0]

    def _bf16_embedding_and_head(self, embed: torch.Tensor, head: torch.Tensor, tied: bool):
        """bfloat16 storage (``quant.compute_plan``): a tied pair shares one bf16 matrix in the kernel's layout,
        the head computing float32 logits."""
        embed_bf16 = quant.as_bf16(embed)
        head_bf16 = embed_bf16 if tied else quant.as_bf16(head)
        self._count(["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"]), _FORM_LABELS["bf16"])
        return (quant.QuantizedEmbedding(embed_bf16, self.dtype),
                quant.QuantizedLinear(head_bf16, None, self.dtype, bf16_inputs=self.bf16_inputs), embed.shape[0])

    def summary(self) -> str:
        """``"210 Q4_1 -> int4 (kept), 61 F32 -> bfloat16, ..."``, most frequent first."""
        return ", ".join(f"{n} {what}" for what, n in self.report.most_common())


def _cat(parts: list) -> quant.QuantizedWeight:
    """Parts of one form (``_kept_linear`` groups them) as one weight."""
    return parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)


_FORM_LABELS = {"bf16": "bfloat16"}
_KEPT_LABELS = {quant.Int4Weight: "int4 (kept)", quant.Int8Weight: "int8", quant.Mxfp4Weight: "mxfp4 (kept)"}


def _dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
