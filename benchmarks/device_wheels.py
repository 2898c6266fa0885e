"""The wheels a lent GPU machine lacks to run llmbus, fetched here and installed there without a network.

    python benchmarks/device_wheels.py              # here: download into .whl/ (ignored by git)
    python3 benchmarks/device_wheels.py --install   # there: install .whl/ and llmbus (editable), offline

The device image (the workplace's 'cuda' image: Python 3.12, torch 2.11 with CUDA, Triton, transformers,
aiohttp, msgpack, click, numpy, safetensors, pytest and the packages in ``DEVICE_HAS``) reaches no package
registry. Download resolves llmbus's dependencies that the image lacks, with their whole closure, for
CPython 3.12 on manylinux x86-64, pinned by constraints.txt, then deletes every wheel the image already has:
two versions of one package stop an offline install, and the image's own torch stack must stay as it is.
What remains (pyzmq, structlog, llguidance, ...) travels with the `run` call's ``carry: [".whl"]``, which
must stay under 64 MiB with the working tree: the script prints the total.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
PYTHON_VERSION = "3.12"  # the device's python3 (/opt/torch/.venv/bin/python3)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
CARRY_LIMIT = 64 * 2**20
# Not llmbus's dependencies: what gpu_check uses there when present (py-spy: where a served step's host time goes).
CHECK_TOOLS = ["py-spy==0.4.3"]

# What the device image holds (the device docs' package list, read on such a machine on 2026-11-17).
DEVICE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())


def missing_requirements() -> list[str]:
    """llmbus's own dependencies (pyproject's, not the extras) that the device image lacks."""
    import tomllib  # Python 3.11+: only here, where the wheels are fetched, not on the device's side

    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if canonicalize_name(Requirement(d).name) not in DEVICE_HAS]


def wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def download() -> int:
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    wanted = missing_requirements() + CHECK_TOOLS
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p)), "--platform", "any",
           "-c", str(ROOT / "constraints.txt"), "-d", str(WHEELS), *wanted]
    print("downloading the closure of:", " ".join(wanted), flush=True)
    subprocess.run(cmd, check=True)
    kept, total = [], 0
    for wheel in sorted(WHEELS.glob("*.whl")):
        if wheel_name(wheel) in DEVICE_HAS:
            wheel.unlink()  # the image has it: one version of each package, the image's
        else:
            kept.append(wheel)
            total += wheel.stat().st_size
    for wheel in kept:
        print(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{len(kept)} wheels, {total / 2**20:.1f} MiB in {WHEELS.relative_to(ROOT)}/ "
          f"(carry limit with the working tree: {CARRY_LIMIT // 2**20} MiB)")
    return 0 if total < CARRY_LIMIT else 1


def install() -> int:
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {WHEELS}: run `python benchmarks/device_wheels.py` here first and carry .whl",
              file=sys.stderr)
        return 1
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check"]
    subprocess.run([*pip, "--find-links", str(WHEELS), *wheels], check=True)
    # No build isolation: it would fetch setuptools from a registry; the image's setuptools builds it.
    subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=True)
    print(f"installed {len(wheels)} wheels and llmbus (editable) into {sys.prefix}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="on the device: install .whl/ and llmbus, offline")
    parser.add_argument("--list", action="store_true", help="print the missing top-level requirements and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(missing_requirements()))
        return 0
    return install() if args.install else download()


if __name__ == "__main__":
    sys.exit(main())
