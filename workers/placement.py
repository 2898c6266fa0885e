"""Where and how a rank computes: its device, its dtype, its CPU threads, the KV block size its device takes,
the process group's backend, and whether a launch's ranks can each have a GPU of their own.

No torch at import: the launcher reads these (``gpu_shortage``, ``default_block_size``) before any rank
starts; each function imports torch where it needs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# Where a GPU driver shows itself: NVIDIA's kernel module and its control device, ROCm's (torch.cuda is HIP
# there), WSL's GPU paravirtualization. Where none is, torch.cuda cannot find a device either.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    return any(os.path.exists(path) for path in GPU_DRIVER_PATHS)


def gpu_shortage(device: str, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot each have a GPU of their own under ``device``, or None when they
    can (or run on CPU). Checked before any weights load: ranks sharing a GPU would only run out of
    memory later, and ``--device cuda`` without a GPU would fail in every rank at once."""
    if device == "cpu" or (device == "auto" and world_size == 1):
        return None  # auto with one rank: CUDA when there is one, CPU otherwise, never short
    if device == "auto" and not gpu_driver_present():
        # CPU ranks, known without importing torch: 2 s of the launcher's and the group's CPU at every
        # start (and restart) of `--gpus N` on a machine without a GPU
        return None
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


# On a machine this large, a CPU launch leaves cores to the scheduler and the frontend: with the overlap they work
# while the forward runs, and one that takes an OpenMP thread's core holds every other thread at the layer's next
# barrier. A memory-bound decode step has stopped gaining from more threads well before the last two cores
# (vLLM's CPU backend reserves cores for its API server likewise). Below it every core computes: on 2 cores two
# threads decode SmolLM2 in 6.7 ms a token against 10.9 ms on one (design notes, "How many threads a CPU rank").
RESERVE_FROM_CORES = 8
SERVING_CORES = 2


@dataclass(frozen=True)
class CpuBudget:
    """The CPU a launch may compute on: the CPUs in its affinity mask (taskset, a container's cpuset), the
    physical cores among them (SMT siblings share one core's caches and memory port: a second thread a core
    adds barrier waits to a memory-bound step, not bandwidth; torch and llama.cpp also default to one thread a
    core), and a cgroup CPU quota (``docker --cpus``) where one caps the process below that."""

    cpus: int
    cores: int
    quota: float | None = None

    @property
    def usable(self) -> int:
        """Cores the threads may keep busy at once: a quota of 3.5 CPUs throttles a fourth busy thread."""
        return max(1, min(self.cores, int(self.quota)) if self.quota is not None else self.cores)

    @property
    def reserved(self) -> int:
        return SERVING_CORES if self.usable >= RESERVE_FROM_CORES else 0

    def threads(self, world_size: int) -> int:
        """An equal share, for each of ``world_size`` ranks, of the usable cores less the serving ones."""
        return max(1, (self.usable - self.reserved) // world_size)

    def describe(self) -> str:
        quota = f", quota {self.quota:g} CPUs" if self.quota is not None else ""
        left = f", {self.reserved} left to serving" if self.reserved else ""
        return f"{self.cpus} CPUs, {self.cores} cores{quota}{left}"


def cpu_budget(sysfs: Path = Path("/sys/devices/system/cpu"), cgroup_root: Path = Path("/sys/fs/cgroup"),
               proc_cgroup: Path = Path("/proc/self/cgroup")) -> CpuBudget:
    """This process's ``CpuBudget``, read from Linux's CPU topology and cgroup files; a file that cannot be
    read counts each CPU as a core, or no quota."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = {_core_of(sysfs, cpu) for cpu in cpus}
    return CpuBudget(cpus=len(cpus), cores=len(cores), quota=cgroup_cpu_quota(cgroup_root, proc_cgroup))


def _core_of(sysfs: Path, cpu: int) -> tuple:
    topology = sysfs / f"cpu{cpu}" / "topology"
    try:
        return (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
    except (OSError, ValueError):
        return ("cpu", cpu)


def cgroup_cpu_quota(cgroup_root: Path, proc_cgroup: Path) -> float | None:
    """The tightest CPU quota, in CPUs, of this process's cgroup and its parents (cgroup v2's ``cpu.max``, v1's
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), or None where none is set."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2's unified hierarchy
            for folder in _ancestors(cgroup_root, path):
                limits.append(_v2_quota(folder / "cpu.max"))
        elif "cpu" in controllers.split(","):
            for mount in (cgroup_root / controllers, cgroup_root / "cpu"):
                for folder in _ancestors(mount, path):
                    limits.append(_v1_quota(folder))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under ``mount`` and each parent's up to the mount (a container sees its own cgroup
    as the root)."""
    parts = [part for part in path.strip("/").split("/") if part]
    return [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_threads(world_size: int, budget: CpuBudget | None = None) -> int:
    """Threads for one CPU rank: OMP_NUM_THREADS where the operator set it (as for any OpenMP program), else
    ``CpuBudget.threads``: ranks oversubscribing the cores make every rank slower (8 threads on 2 cores decode
    SmolLM2 2x slower than 2)."""
    try:
        wanted = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        wanted = 0
    if wanted > 0:
        return wanted
    return (budget or cpu_budget()).threads(world_size)


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
