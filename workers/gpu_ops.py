"""The decoder layer's small ops as one Triton kernel each, for CUDA: RMSNorm (and the residual add before
it), RoPE on queries and keys together, SiLU-and-multiply, and a projection's LoRA deltas (each row its own
adapter's, in two kernels whatever the mix of adapters); and the greedy choice with its log-probability, in
two kernels over chunks of the vocabulary.

In torch each of these is several kernels (RMSNorm alone: a cast, a square, a mean, an add and a reciprocal
root, a multiply, a cast and the weight's multiply), each reading and writing the whole activation: the H100
device check found a decode step's elementwise and reduction kernels at about a quarter of its GPU time once
CUDA graphs had removed the launch cost. Each kernel here reads its inputs once and writes once, computing in
float32 and rounding to the output's dtype at the end (torch rounds after every op in bfloat16, so bfloat16
results may differ from torch's in the last bit, towards the exact value; float32 results differ only by the
reduction order of the mean).

``available(tensor)``: the kernels run where the tensor is on CUDA and triton imports, or on any device under
``TRITON_INTERPRET=1`` (how CI tests them). Callers keep the torch path for everything else, but for RoPE:
``apply_rotary`` holds both here, where the attention backends find it without importing the models
(``AttentionBackend.forward_rotary`` rotates for the decoder). The Triton backend instead rotates the keys as
it writes them to the pool (``attention/triton_kernels.py``), with this module's kernel code for the
rotation, so both paths store the same bits.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``): on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton():
    try:
        return importlib.import_module("llmbus.workers._gpu_ops_kernels")
    except ImportError:
        return None


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``: on CUDA with triton installed, or anywhere under the interpreter."""
    return (tensor.is_cuda or interpreting()) and _triton() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * (x / rms(x))`` per row in ``weight``'s dtype, ``x [T, N]`` normalised in float32. With
    ``residual`` (float32, ``[T, N]``): ``residual += x`` first, in place, and the sum is normalised; returns
    (normalised, residual)."""
    kernels = _triton()
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=weight.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("the residual must have contiguous rows: it is updated in place")
    kernels.launch_rms_norm(x, residual, weight, out, eps)
    return out if residual is None else (out, residual)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE with ``signed_sin`` from ``RotaryEmbedding.cos_sin`` (the sign of rotate-half folded in); where
    ``cos`` is narrower than the head (partial rotation), the rest of the head passes through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1] and x.stride(-1) == 1 and available(x):
        return rotary(x, cos, signed_sin)  # one kernel instead of four
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as ``apply_rotary``'s torch path: ``x [T, H, D]``, ``cos``/``signed_sin [T, 1, D]`` (rotate-half's
    sign in the sine) -> ``[T, H, D]`` in ``x``'s dtype."""
    kernels = _triton()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kernels.launch_rotary(x, cos, signed_sin, out)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first, as the fused projection lays them out)."""
    kernels = _triton()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    kernels.launch_silu_and_mul(gate_up, out)
    return out


def lora_delta(x: torch.Tensor, y: torch.Tensor, shrink: torch.Tensor, expand: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """``y [T, out] += B_a (A_a x)`` in place, row by row, ``a = slots[t]`` (0: the base model's row, left as it
    is), with every adapter's ``A`` in ``shrink [adapters + 1, R, in]`` and ``B`` in ``expand [adapters + 1,
    out, R]`` (zero-padded to the largest rank R; slot 0 unused): one kernel shrinks every row to its rank
    (float32), one adds the expansion. Nothing depends on the host, so a CUDA graph may hold them with
    ``slots`` in its buffers."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("the projection's output must have contiguous rows: the delta is added in place")
    _triton().launch_lora(x, y, shrink, expand, slots)
    return y


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax (int64) and its log-softmax (float32), for ``logits [S, vocab]``, without the
    softmax ever written out: each chunk of a row keeps its maximum, first argmax and sum of exponentials, and
    one program per row combines them."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    ids = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _triton().launch_greedy(logits, ids, logprobs)
    return ids, logprobs


def unpack_decode_rows(staged: torch.Tensor, fed: torch.Tensor, small: torch.Tensor, tables: torch.Tensor,
                       slot_tables: torch.Tensor, batch: int, block_size: int) -> None:
    """A replayed decode step's inputs from its staged rows (``cuda_graphs.DecodeGraphs``' layout, int32), in one
    kernel inside the graph: each of the ``batch`` rows' id (or, where its pick is ``p > 0``, ``fed[p - 1]``:
    a token the step before sampled), position and adapter slot into ``small``'s columns, its blocks staged
    since its last step appended to its slot's row of ``slot_tables``, its table (as long as it is) into its
    row of ``tables``, and its KV slot (``small[2]``) from the table's block at its position."""
    _triton().launch_unpack_decode_rows(staged, fed, small, tables, slot_tables, batch, block_size)
