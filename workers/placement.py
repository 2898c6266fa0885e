"""Where and how a rank computes: its device, its dtype, its CPU threads, the KV block size its device takes,
the process group's backend, and whether a launch's ranks can each have a GPU of their own.

No torch at import: the launcher reads these (``gpu_shortage``, ``default_block_size``) before any rank
starts; each function imports torch where it needs it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def gpu_shortage(device: str, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot each have a GPU of their own under ``device``, or None when they
    can (or run on CPU). Checked before any weights load: ranks sharing a GPU would only run out of
    memory later, and ``--device cuda`` without a GPU would fail in every rank at once."""
    if device == "cpu" or (device == "auto" and world_size == 1):
        return None  # auto with one rank: CUDA when there is one, CPU otherwise, never short
    import torch

    available = torch.cuda.is_available()
    if device == "auto" and not available:
        return None  # CPU ranks: `--gpus N` is N processes
    count = torch.cuda.device_count() if available else 0
    if world_size <= count:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    needs = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    return (f"`--gpus {world_size}` needs {needs}, one per tensor-parallel rank, but {count} "
            f"{'is' if count == 1 else 'are'} visible{where}. Lower `--gpus`, or use `--device cpu` to run "
            f"the ranks as CPU processes")


# On CPU, decode attention reads each block of one KV head as one run (block_size x head_dim values), and
# the blocks of requests that grow side by side interleave in the pool, and short scattered runs read at
# about half the rate of long ones: blocks of 64 serve large batches faster (design notes, "Large CPU
# blocks"). A GPU's paged kernels take 16 (vLLM's and TGI's default there).
DEFAULT_BLOCK_SIZE = {"cpu": 64, "cuda": 16}


def default_block_size(device: str) -> int:
    """The KV block size of ``device`` ("auto", "cpu" or "cuda") when --block-size is not given."""
    return DEFAULT_BLOCK_SIZE.get(resolve_device(device, 0).type, DEFAULT_BLOCK_SIZE["cpu"])


def resolve_device(device: str, rank: int) -> "torch.device":
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device(device)


def cpu_threads(world_size: int) -> int:
    """Threads for one CPU rank: OMP_NUM_THREADS where the operator set it (as for any OpenMP program),
    else an equal share of the cores this process may run on (its affinity mask: taskset, a container's
    cpuset), since ranks oversubscribing the cores make every rank slower."""
    try:
        wanted = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        wanted = 0
    if wanted > 0:
        return wanted
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def resolve_dtype(dtype: str, device) -> "torch.dtype":
    """float32/bfloat16/float16 by name; 'auto' picks bf16 where the hardware runs it fast."""
    import torch

    if dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from llmbus.workers.quant import auto_cpu_dtype

    # bf16 on CPU is bf16 weights computed in float32 through our tiled kernel (quant.compute_plan), where it
    # runs; without it bf16 would be torch's bf16 arithmetic (less accurate): float32 instead.
    return auto_cpu_dtype()[0]


def process_group_backend(device: "torch.device") -> str:
    """torch.distributed's backend for the ranks' all-reduces: NCCL between GPUs (gloo would copy every
    all-reduce through host memory), gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def cuda_float32_math(allow_tf32: bool) -> None:
    """Set how float32 matmuls and convolutions run on CUDA for this process. TF32 rounds their inputs to
    10 mantissa bits, which changes greedy tokens against transformers' float32; cuDNN allows it by
    default, so both are set, whatever torch's defaults are."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
