"""Dense projections: float32 on CPU through ``gemm.c`` where it runs, else with the weight prepacked for
oneDNN on CPU.

``torch.nn.functional.linear`` on CPU re-lays out nothing: MKL copies the weight into its panels on every
call, and for the few-row inputs of decode steps runs a GEMV that reads a bf16 weight at well under half
the memory bandwidth. oneDNN's linear with a weight reordered once at load time
(``mkldnn._reorder_linear_weight``, what inductor's freezing pass uses) gives the same results faster, at
few rows and at 64 (design notes, "Dense projections on CPU: the weight reordered once for oneDNN").
Elsewhere (CUDA, or a torch without oneDNN) it is F.linear.

On AVX2 machines without AVX-512, float32 goes through ``gemm.c`` instead, on the plain weight: faster
than the packed oneDNN GEMM at the row counts measured (design notes, "float32 GEMMs: our own register
tile on AVX2"), and one copy of the weight serves both it and the fused decode layer's GEMVs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmbus.workers.kernels import bindings

# The batch size the packed layout is tuned for: 64 is as fast as 1 at 1 row and faster from 4 rows on,
# where 1's layout makes oneDNN copy weight chunks on every call (design notes, "Dense projections on CPU").
PACK_BATCH_HINT = 64


@functools.cache
def float32_gemm():
    """``gemm.c``'s ``gemm_f32`` where it is built for this CPU (AVX2 + FMA, no AVX-512), else None."""
    library = bindings.library()
    if library is None or not library.gemm_f32_runs():
        return None
    return library.gemm_f32


def _gemm_for(weight: torch.Tensor):
    return float32_gemm() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether ``Linear`` would compute through a oneDNN-packed copy of ``weight``."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or _gemm_for(weight) is not None:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class StackedLinear:
    """Projections of one input whose outputs are stacked, in order (``Linear``'s call contract): a fused
    projection whose parts are kept in different forms, as llama.cpp's Q4_K_M puts a Q6_K v beside Q4_K q and
    k. ``bias`` is the whole projection's, for the fused decode layer; each part adds its own share."""

    __slots__ = ("parts", "bias", "out_features")

    def __init__(self, parts: list, bias: torch.Tensor | None = None):
        self.parts, self.bias = parts, bias
        self.out_features = sum(part.out_features for part in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x``, through gemm.c or the packed weight where there is one.

    ``weight`` is the dense ``[out, in]`` row-major tensor, kept where native code reads it (``plain``:
    ``gemm.c``, the fused decode layer); ``packed`` is oneDNN's reordered copy (None where it does not pack,
    or ``pack=False``)."""

    __slots__ = ("weight", "bias", "packed", "out_features", "gemm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True,
                 keep_plain: bool = False):
        """``keep_plain`` keeps ``weight`` beside the packed copy (twice the memory), for native code that
        reads it; ``pack=False`` keeps only ``weight``."""
        self.out_features = weight.shape[0]
        self.gemm = _gemm_for(weight)
        weight = weight.contiguous() if self.gemm is not None else weight
        self.bias = bias.contiguous() if self.gemm is not None and bias is not None else bias
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
                       if pack and onednn_packs(weight) else None)
        self.weight = weight if self.packed is None or keep_plain else None

    @property
    def plain(self) -> bool:
        """Whether ``weight``, the dense ``[out, in]`` tensor, is kept."""
        return self.weight is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None and x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] > 0:
            x = x.contiguous()
            y = x.new_empty(x.shape[0], self.out_features)
            bias = None if self.bias is None else self.bias.data_ptr()
            if self.gemm(x.data_ptr(), self.weight.data_ptr(), bias, x.shape[0], self.out_features, x.shape[1],
                         y.data_ptr()) == 0:
                return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
