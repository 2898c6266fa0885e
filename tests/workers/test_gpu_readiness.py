"""What a GPU launch checks, checked without a GPU: torch's CUDA queries are patched where the answer
depends on them, and on this CPU-only machine `--device cuda` is refused before anything loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmbus.workers import placement
from llmbus.workers.kv_cache import bytes_per_block
from llmbus.workers.memory_budget import CUDA_KV_HEADROOM, WarmupOutOfMemory
from llmbus.workers.model_runner import ModelRunner
from llmbus.workers.placement import gpu_shortage


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): make torch see n CUDA devices (0: no CUDA at all), behind a GPU driver (none with 0)."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(placement, "gpu_driver_present", lambda: n > 0)
    return see


def test_gpu_shortage(gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpus(1)
    assert gpu_shortage("auto", 1) is None and gpu_shortage("cuda", 1) is None and gpu_shortage("cpu", 8) is None
    message = gpu_shortage("auto", 2)
    assert message == ("`--gpus 2` needs 2 GPUs, one per tensor-parallel rank, but 1 is visible "
                       "(CUDA_VISIBLE_DEVICES=0). Lower `--gpus`, or use `--device cpu` to run the ranks as CPU "
                       "processes")
    gpus(0)
    assert gpu_shortage("auto", 4) is None, "no CUDA: --gpus 4 is four CPU ranks"
    assert "needs 1 GPU, one per tensor-parallel rank, but 0 are visible" in gpu_shortage("cuda", 1)


@pytest.mark.skipif(placement.gpu_driver_present(), reason="checks a machine without a GPU driver")
def test_without_a_gpu_driver_auto_ranks_are_cpu_ranks_without_importing_torch():
    code = ("import sys; from llmbus.workers.placement import gpu_shortage; "
            "print(gpu_shortage('auto', 2), 'torch' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert said == ["None", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_up_and_workers_refuse_missing_gpus_before_loading(tiny_model_dir, tmp_path):
    up = subprocess.run([sys.executable, "-m", "llmbus.supervisor", "up", "--model-id", str(tiny_model_dir),
                         "--device", "cuda", "--gpus", "2"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 2, up.stderr
    assert "Invalid argument: `--gpus 2` needs 2 GPUs" in up.stderr and "Traceback" not in up.stderr
    workers = subprocess.run([sys.executable, "-m", "llmbus.supervisor", "workers", "--run-dir", str(tmp_path / "run"),
                              "--model-dir", str(tiny_model_dir), "--device", "cuda", "--gpus", "2"],
                             capture_output=True, text=True, timeout=120)
    assert workers.returncode == 2 and "`--gpus 2` needs 2 GPUs" in workers.stderr, workers.stderr
    assert "model loaded" not in workers.stderr


def test_kv_pool_from_free_gpu_memory(tiny_model_dir, monkeypatch):
    """warmup's sizing on a GPU, with the memory figures torch would report patched in."""
    runner = ModelRunner(str(tiny_model_dir), num_blocks=4)
    per_block = bytes_per_block(**runner._kv_layout)
    gib = 1 << 30
    state = {"peak": 3 * gib, "free": 20 * gib, "total": 80 * gib}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner.cuda_memory_fraction = 0.9
    # 1 GiB was allocated before warmup and its KV scratch took 0.5 GiB: the activations peaked at 1.5 GiB.
    activation_peak = 3 * gib - gib - gib // 2
    usable = 20 * gib - 0.1 * 80 * gib  # what the fraction leaves of the free memory
    budget = int(usable * CUDA_KV_HEADROOM) - activation_peak
    assert runner._blocks_for_free_gpu_memory(gib, gib // 2) == budget // per_block - 1 > 0  # - the padding block
    state["free"] = 8 * gib + gib  # the fraction's reserve and the activations take it all
    with pytest.raises(WarmupOutOfMemory, match="no GPU memory left for the KV cache"):
        runner._blocks_for_free_gpu_memory(gib, gib // 2)
