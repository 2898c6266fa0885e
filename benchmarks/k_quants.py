"""A Q4_K_M GGUF (llama.cpp's own quantizer) served by llmbus with its K-quants kept, against the same file with
them expanded to bfloat16, and beside llama-server on the file; on CPU, one run.

    python benchmarks/k_quants.py [--layers 8] [--batches 1,8] [--context 128] [--steps 16]
    python benchmarks/k_quants.py --llama-server   # also served, beside llama-server on the same file
    python benchmarks/k_quants.py --dry-run        # a tiny shape, to check the script runs

A random Llama (hidden 2048, intermediate 5632, 32 query heads over 4 KV heads, a 32k vocabulary: TinyLlama's
width; ``--layers`` of them) with the demo model's tokenizer is converted to a float32 GGUF by llama.cpp's
converter and quantized by ``llama-quantize ... Q4_K_M`` (``$LLAMA_CPP_DIR``, benchmarks/README.md): mostly
Q4_K, with Q6_K for some v and down projections and the LM head, as llama.cpp mixes them. llmbus loads it with
``--dtype bfloat16`` twice, alternately timed (``decode_step.LlmbusDecode``, the best of ``--repeats`` medians):
with Q4_K kept as int4 (and Q6_K as int8, what the weights line says), and with Q4_K expanded to bfloat16 as
before the K-quants were kept (``gguf_checkpoint.KEPT_TYPES`` without it). The script prints each one's
weights line, then tokens/s and the ratio.

``--llama-server`` then serves the file through ``llmbus up --dtype bfloat16`` and through llama-server (``-t
2 -np 64 -c 32768 -no-kvu -cb``), one after the other: ``--prompt-tokens`` prompts, ``--new-tokens`` new
tokens with EOS ignored over the OpenAI completions route, c=1 and c=``--served-concurrency``; tokens/s =
completion tokens / wall time, and the ratio. Random weights: the text is noise, the work is not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from _server import default_model_dir
from decode_step import LlmbusDecode, add_timing_options, best_medians, timing_of
from gguf_peers import add_served_options, served_beside_llama_server

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
DRY_SHAPE = dict(SHAPE, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=32000)


def write_q4_k_m(shape: dict, layers: int, scratch: Path) -> Path:
    """The random Llama as llama-quantize's Q4_K_M GGUF in ``scratch``; its path."""
    import transformers
    from _smollm2 import gguf_from_hf, llama_cpp_dir

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, num_hidden_layers=layers))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
    folder = scratch / "hf"
    model.save_pretrained(folder)
    tokenizer_dir = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), folder / name)
    floats, quantized = scratch / "f32.gguf", scratch / "q4_k_m.gguf"
    converted = gguf_from_hf(folder, floats, "f32", pre="gpt-2")
    if converted.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed:\n{converted.stderr[-3000:]}")
    quantize = subprocess.run([str(llama_cpp_dir() / "build" / "bin" / "llama-quantize"), str(floats),
                               str(quantized), "Q4_K_M"], capture_output=True, text=True)
    if quantize.returncode != 0:
        raise SystemExit(f"llama-quantize failed:\n{quantize.stderr[-3000:]}")
    floats.unlink()
    return quantized


def load(folder: str, batches: list[int], context: int, steps: int, keep_q4_k: bool) -> LlmbusDecode:
    """``LlmbusDecode`` of the file's folder in bfloat16, with Q4_K kept or expanded (KEPT_TYPES is read as
    the weights are built, so it is set back at once)."""
    from llmbus.workers import gguf_checkpoint

    kept = gguf_checkpoint.KEPT_TYPES
    if not keep_q4_k:
        gguf_checkpoint.KEPT_TYPES = tuple(t for t in kept if t != "Q4_K")
    try:
        return LlmbusDecode(folder, torch.bfloat16, max(batches), context, steps)
    finally:
        gguf_checkpoint.KEPT_TYPES = kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    add_timing_options(p, "1,8", 16, "tiny shape, 2 layers, batches 1,2, 3 steps, one round")
    add_served_options(p, " on the same file")
    a = p.parse_args()
    shape, layers = (DRY_SHAPE, 2) if a.dry_run else (SHAPE, a.layers)
    batches, steps, repeats, context = timing_of(a, [1, 2])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bfloat16, hidden {shape['hidden_size']}, "
          f"{layers} layers, vocabulary {shape['vocab_size']}, context {context}, {steps} timed steps, "
          f"best of {repeats}")
    from llmbus.supervisor.gguf_model import materialize

    with tempfile.TemporaryDirectory() as scratch:
        gguf = write_q4_k_m(shape, layers, Path(scratch))
        print(f"{gguf.name}: {gguf.stat().st_size / 2**20:.1f} MiB", flush=True)
        if a.llama_server:  # first: the servers are processes of their own, and this one keeps what it frees
            served_beside_llama_server(gguf, str(gguf), str(gguf.parent / "hf"), a)
        folder = str(materialize(gguf))
        sides = {}
        for name, keep in (("Q4_K kept", True), ("Q4_K expanded", False)):
            sides[name] = load(folder, batches, context, steps, keep)
            print(f"{name}: {sides[name].runner.model.weight_summary}", flush=True)
        best = best_medians(sides, batches, steps, repeats)
        for batch in batches:
            row = " ".join(f"  {name} {batch / best[name][batch]:8.2f} tok/s" for name in sides)
            ratio = best["Q4_K expanded"][batch] / best["Q4_K kept"][batch]
            print(f"c={batch:<3}{row}   kept/expanded {ratio:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
