"""--attention-backend and the other CUDA decisions of a rank (TF32, NCCL, pinned uploads), checked without
a GPU: torch's CUDA queries are patched where the answer depends on them, and the backends a name picks are
looked up through the registry (workers/attention/__init__.py) with stand-ins where a test needs one."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from llmbus.bus.settings import declared_setting
from llmbus.testing.server import free_port
from llmbus.workers import attention, weight_builder
from llmbus.workers.attention import (BACKEND_CLASSES, AttentionBackendUnavailable, CPUKernelBackend,
                                      TorchSDPABackend, attention_backend_class, make_attention_backend)
from llmbus.workers.placement import cuda_float32_math, process_group_backend, resolve_dtype
from llmbus.workers.process import ATTENTION_BACKENDS, WorkerConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_flag_offers_every_backend_by_its_class_name():
    assert ATTENTION_BACKENDS == ("auto", *BACKEND_CLASSES, *attention.TGI_ATTENTION_NAMES)
    d = declared_setting(WorkerConfig, "attention_backend")
    assert d.flag == "--attention-backend" and d.spec.env == "ATTENTION" and d.spec.choices == ATTENTION_BACKENDS
    assert d.default == "auto" and d.spec.user, "a user-facing flag: `llmbus up` offers it"
    assert declared_setting(WorkerConfig, "device").spec.choices == ("auto", "cpu", "cuda")
    for name in ("cpu_kernel", "torch_sdpa"):
        assert attention._import(name).name == name
    try:
        assert attention._import("triton").name == "triton"
    except AttentionBackendUnavailable:
        pass  # triton not installed here: the name still must be the class's


def test_the_environment_variable_is_tgis(monkeypatch):
    monkeypatch.setenv("ATTENTION", "torch_sdpa")
    cfg, _ = WorkerConfig.parse(["--run-dir", "/tmp/r", "--model-dir", "/m"], prog="llmbus workers")
    assert cfg.attention_backend == "torch_sdpa"


@pytest.mark.parametrize("tgi_name", ["flashinfer", "flashdecoding", "paged"])
def test_tgis_own_backend_names_mean_the_paged_default(monkeypatch, tgi_name):
    """A TGI user's ATTENTION (its default is flashinfer) keeps working: every backend here is paged."""
    monkeypatch.setenv("ATTENTION", tgi_name)
    cfg, _ = WorkerConfig.parse(["--run-dir", "/tmp/r", "--model-dir", "/m"], prog="llmbus workers")
    assert attention.attention_backend_class(cfg.attention_backend, CPU) is attention.attention_backend_class(
        "auto", CPU)


@pytest.fixture
def fake_triton(monkeypatch):
    """Register a stand-in under the triton backend's name; its ``up`` says whether it is available."""
    module = types.ModuleType("llmbus_test_fake_triton")

    class FakeTriton(TorchSDPABackend):
        name = "triton"
        up = True

        @classmethod
        def available(cls, device):
            return cls.up

    module.FakeTriton = FakeTriton
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(BACKEND_CLASSES, "triton", f"{module.__name__}:FakeTriton")
    return FakeTriton


def test_auto_keeps_the_cpu_choice_and_prefers_triton_on_cuda(fake_triton, monkeypatch):
    kernel = CPUKernelBackend.available(CPU)
    assert attention_backend_class("auto", CPU) is (CPUKernelBackend if kernel else TorchSDPABackend)
    assert make_attention_backend(torch.device("meta")).name == "torch_sdpa"
    assert attention_backend_class("auto", CUDA) is fake_triton
    fake_triton.up = False
    assert attention_backend_class("auto", CUDA) is TorchSDPABackend, "no Triton: the portable one"
    monkeypatch.setitem(BACKEND_CLASSES, "triton", "llmbus.workers.attention.no_such_module:X")
    assert attention_backend_class("auto", CUDA) is TorchSDPABackend


def test_a_named_backend_is_used_or_refused_with_the_reason(fake_triton, monkeypatch):
    assert attention_backend_class("torch_sdpa", CPU) is TorchSDPABackend
    assert make_attention_backend(CPU, [None, 4], name="triton").name == "triton"
    fake_triton.up = False
    with pytest.raises(AttentionBackendUnavailable, match=r"'triton' cannot run on cpu: it needs triton installed "
                                                          r".* TRITON_INTERPRET=1"):
        attention_backend_class("triton", CPU)
    with pytest.raises(AttentionBackendUnavailable, match="'cpu_kernel' cannot run on cuda:0: it needs a CPU device"):
        attention_backend_class("cpu_kernel", CUDA)
    with pytest.raises(AttentionBackendUnavailable, match="unknown attention backend 'flash': choose auto or one of "
                                                          "triton, cpu_kernel, torch_sdpa"):
        attention_backend_class("flash", CPU)
    monkeypatch.setitem(BACKEND_CLASSES, "triton", "llmbus.workers.attention.no_such_module:X")
    with pytest.raises(AttentionBackendUnavailable, match="not part of this llmbus"):
        attention_backend_class("triton", CUDA)


def test_a_backend_whose_library_is_missing_says_what_to_install(monkeypatch):
    def import_module(name):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(attention.importlib, "import_module", import_module)
    with pytest.raises(AttentionBackendUnavailable, match=r"'triton' cannot be imported .*: pip install triton"):
        attention_backend_class("triton", CUDA)


def test_the_model_and_the_fused_layer_take_the_named_backend(tiny_model_dir):
    from llmbus.workers.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model_dir), num_blocks=8, block_size=16, attention_backend="torch_sdpa")
    assert runner.compute_paths == {"attention": "torch_sdpa", "fused_decode": False, "cuda_graphs": []}


def test_cuda_math_is_float32_unless_tf32_is_asked(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    cuda_float32_math(False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    cuda_float32_math(True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert declared_setting(WorkerConfig, "allow_tf32").default is False


def test_cuda_dtype_and_process_group(monkeypatch):
    for bf16, expected in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, bf16=bf16, **k: bf16)
        assert resolve_dtype("auto", CUDA) == expected
    assert resolve_dtype("float32", CUDA) == torch.float32
    assert process_group_backend(CUDA) == "nccl" and process_group_backend(CPU) == "gloo"


def test_weights_reach_a_gpu_through_pinned_memory(monkeypatch):
    pinned = []

    def pin_memory(self):
        pinned.append(self.shape)
        return self.clone()

    moves = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        moves.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **{k: v for k, v in kwargs.items() if k != "non_blocking"})

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    placed = weight_builder.upload(source, CPU, torch.bfloat16)  # CPU stands in for the GPU
    assert pinned == [(2, 3)] and moves[0] is True, "the copy starts from pinned memory, without waiting"
    assert placed.dtype == torch.bfloat16 and placed.tolist() == source.tolist()
    builder = weight_builder.WeightBuilder.__new__(weight_builder.WeightBuilder)
    builder.device, builder.dtype = CUDA, torch.float16
    monkeypatch.setattr(weight_builder, "upload", lambda t, device, dtype: ("uploaded", device, dtype))
    assert builder.place(source) == ("uploaded", CUDA, torch.float16)
    builder.device = CPU
    pinned.clear()
    assert builder.place(source).dtype == torch.float16 and pinned == [], "no pinning on CPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_up_and_workers_stop_on_an_unavailable_backend_with_its_reason(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ATTENTION", raising=False)
    up = subprocess.run([sys.executable, "-m", "llmbus.supervisor", "up", "--model-id", str(tiny_model_dir),
                         "--attention-backend", "triton", "--port", str(free_port())],
                        capture_output=True, text=True, timeout=120)
    assert up.returncode != 0, up.stderr
    assert "attention backend 'triton'" in up.stderr and "Traceback" not in up.stderr, up.stderr
    assert "model loaded" not in up.stderr, "refused before the weights load"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    workers = subprocess.run([sys.executable, "-m", "llmbus.workers", "--run-dir", str(run_dir),
                              "--model-dir", str(tiny_model_dir), "--attention-backend", "triton"],
                             capture_output=True, text=True, timeout=120)
    assert workers.returncode == 1 and "AttentionBackendUnavailable: attention backend 'triton'" in workers.stderr
    assert "Traceback" not in workers.stderr, workers.stderr
    bad = subprocess.run([sys.executable, "-m", "llmbus.workers", "--run-dir", str(run_dir), "--model-dir",
                          str(tiny_model_dir), "--attention-backend", "flash"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'flash'" in bad.stderr.splitlines()[-1], bad.stderr
