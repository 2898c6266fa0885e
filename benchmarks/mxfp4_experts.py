"""gpt-oss's MXFP4 experts kept as published against the same values expanded to bfloat16, on CPU, one run.

    python benchmarks/mxfp4_experts.py [--layers 2] [--batches 1,8] [--context 128] [--steps 12]
    python benchmarks/mxfp4_experts.py --llama-server # also served, beside llama.cpp's MXFP4 on the same file
    python benchmarks/mxfp4_experts.py --whole-20b [--llama-server]   # gpt-oss-20b's whole shape, kept only
    python benchmarks/mxfp4_experts.py --dry-run      # a tiny shape, to check the script runs

A random gpt-oss checkpoint of gpt-oss-20b's layer shape (hidden 2880, 64 query heads of 64 over 8 KV heads,
sinks, alternating sliding and full layers, 32 experts 2880 wide, 4 a token; ``--layers`` of them and a 32k
vocabulary, so the experts are most of what a step reads, as in the real model) is written twice: as gpt-oss
publishes it (experts in MXFP4 blocks, random codes at realistic scales) and with those experts' values
expanded to bfloat16. Both are loaded by ModelRunner with ``--dtype bfloat16`` (bf16 weights, float32
activations on a CPU with the tiled kernel): the first keeps its experts as MXFP4 (integer_products.c's integer
products), the second computes them as bf16 tiles; everything else is the same. Their decode steps are timed alternately
(``decode_step.LlmbusDecode``: a prefill of ``--context`` tokens a sequence, then the median of ``--steps``
whole steps; the best of ``--repeats`` rounds counts) and the script prints tokens/s, the ratio, and the bytes
the experts' computed forms hold, then what those bytes per weight make of gpt-oss-20b's and gpt-oss-120b's
experts.

``--llama-server`` first serves the MXFP4 checkpoint (with the demo model's tokenizer) through ``llmbus up
--dtype bfloat16`` and, converted by llama.cpp's own converter (which keeps the experts' MXFP4 blocks as
GGML's MXFP4 type, the rest bf16), through llama-server (``$LLAMA_CPP_DIR``, benchmarks/README.md; ``-t 2 -np 64
-c 32768 -no-kvu -cb``), one after the other: ``--prompt-tokens`` prompts, ``--new-tokens`` new tokens with EOS
ignored over the OpenAI completions route, c=1 (requests one at a time) and c=``--served-concurrency``;
tokens/s = completion tokens / wall time, and the ratio. Random weights: the text is noise, the work is not.

``--whole-20b`` writes gpt-oss-20b's whole shape instead (24 layers, its 201,088-token vocabulary; about 13 GB
on disk), MXFP4 only (expanded it would need about 42 GB): the load's seconds and the process's resident
memory after it, then its decode steps (and ``--llama-server``'s served comparison) as above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from _server import default_model_dir
from decode_step import LlmbusDecode, add_timing_options, best_medians, timing_of
from gguf_peers import add_served_options, served_beside_llama_server

from llmbus.bus.procfs import rss_bytes
from llmbus.workers import mxfp4
from llmbus.workers.models.moe import SparseMoE

SHAPE = dict(hidden_size=2880, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=32768,
             sliding_window=128, max_position_embeddings=131072, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
DRY_SHAPE = dict(SHAPE, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)  # the vocabulary: the tokenizer's
# (layers, experts) of the published models, each expert three 2880 x 2880 projections
PUBLISHED = {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}
SCALE_EXPONENT = -7  # 2^-7 times e2m1 values averaging ~2.5: weights of about 0.02, as a trained layer's
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_checkpoints(shape: dict, layers: int, mxfp4_dir: str, bf16_dir: str | None) -> None:
    """The random checkpoint in both forms: experts as ``X_blocks``/``X_scales`` in ``mxfp4_dir``, as bfloat16
    ``X`` holding the same values in ``bf16_dir`` (None: not written); every other tensor the same bfloat16 in
    both. One shard a layer (and one for the rest), made and written in turn, so a gpt-oss-20b-sized checkpoint
    never sits in memory whole."""
    import transformers
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    config = transformers.GptOssConfig(**{**shape, "num_hidden_layers": layers,
                                          "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
                                          + ["sliding_attention"] * (layers % 2),
                                          "architectures": ["GptOssForCausalLM"]})
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in transformers.AutoModelForCausalLM.from_config(config)
                  .state_dict().items()}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, []).append(name)
    folders = [(mxfp4_dir, {"quant_method": "mxfp4"})] + ([(bf16_dir, None)] if bf16_dir is not None else [])
    index: dict[str, dict[str, str]] = {folder: {} for folder, _ in folders}
    for shard, names in shards.items():
        packed, expanded = {}, {}
        for name in names:
            size = shapes[name]
            if name.endswith(EXPERT_TENSORS):  # [experts, inputs, outputs], stored [experts, outputs, inputs/32, 16]
                experts, inputs, outputs = size
                blocks = torch.randint(0, 256, (experts, outputs, inputs // mxfp4.BLOCK, mxfp4.BLOCK // 2),
                                       dtype=torch.uint8, generator=generator)
                scales = torch.full((experts, outputs, inputs // mxfp4.BLOCK), 127 + SCALE_EXPONENT,
                                    dtype=torch.uint8)
                packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
                if bf16_dir is not None:
                    expanded[name] = torch.stack([mxfp4.dequantize(b, s).T.to(torch.bfloat16)
                                                  for b, s in zip(blocks, scales)])
                continue
            if name.endswith("norm.weight"):
                tensor = torch.ones(size)
            elif name.endswith(("bias", "sinks")):
                tensor = torch.zeros(size)
            else:
                tensor = torch.randn(size, generator=generator) * 0.02
            packed[name] = expanded[name] = tensor.to(torch.bfloat16)
        file = f"model-{shard}.safetensors"
        for (folder, _), state in zip(folders, (packed, expanded)):
            os.makedirs(folder, exist_ok=True)
            save_file(state, os.path.join(folder, file), metadata={"format": "pt"})
            index[folder] |= dict.fromkeys(state, file)
        del packed, expanded
    for folder, quantization in folders:
        config.save_pretrained(folder)
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index[folder]}, f)
        if quantization is not None:
            with open(os.path.join(folder, "config.json")) as f:
                saved = json.load(f)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({**saved, "quantization_config": quantization}, f)


def expert_bytes(model) -> tuple[int, int]:
    """(bytes the experts' computed forms hold, weights in them) over every layer of ``model``."""
    held = weights = 0
    for layer in model.layers:
        if not isinstance(layer.mlp, SparseMoE):
            continue
        for projection in layer.mlp.gate_ups + layer.mlp.downs:
            pack = projection._pack
            held += sum(t.numel() * t.element_size() for t in (pack.values, pack.scale) if t is not None)
            weights += pack.n * pack.k
    return held, weights


def served(mxfp4_dir: str, scratch: str, a) -> None:
    """``--llama-server``: the MXFP4 checkpoint served by llmbus and, converted, by llama-server, c=1 and c=N."""
    from _smollm2 import gguf_from_hf

    tokenizer_dir = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(mxfp4_dir, name))
    gguf = f"{scratch}/gpt-oss-mxfp4.gguf"
    converted = gguf_from_hf(mxfp4_dir, gguf, "bf16", pre="gpt-2")
    if converted.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed:\n{converted.stderr[-3000:]}")
    served_beside_llama_server(gguf, mxfp4_dir, mxfp4_dir, a, tag=" mxfp4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    add_timing_options(p, "1,8", 12, "tiny shape, batches 1,2, 3 steps, one round")
    p.add_argument("--whole-20b", action="store_true", help="gpt-oss-20b's whole shape, MXFP4 kept only")
    add_served_options(p, "'s MXFP4")
    a = p.parse_args()
    shape = DRY_SHAPE if a.dry_run else dict(SHAPE, vocab_size=201088) if a.whole_20b else SHAPE
    layers = PUBLISHED["gpt-oss-20b"][0] if a.whole_20b else a.layers
    batches, steps, repeats, context = timing_of(a, [1, 2])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bfloat16, hidden {shape['hidden_size']}, "
          f"{layers} layers of {shape['num_local_experts']} experts (top {shape['num_experts_per_tok']}), "
          f"vocabulary {shape['vocab_size']}, context {context}, {steps} timed steps, best of {repeats}")
    with tempfile.TemporaryDirectory() as scratch:
        folders = {"mxfp4 kept": f"{scratch}/mxfp4", "bf16 expanded": f"{scratch}/bf16"}
        if a.whole_20b:
            del folders["bf16 expanded"]
        write_checkpoints(shape, layers, folders["mxfp4 kept"], folders.get("bf16 expanded"))
        if a.llama_server:  # first: the servers are processes of their own, and this one keeps what it frees
            served(folders["mxfp4 kept"], scratch, a)
        sides = {}
        for name, path in folders.items():
            started = time.perf_counter()
            sides[name] = LlmbusDecode(path, torch.bfloat16, max(batches), context, steps)
            print(f"{name}: loaded and warmed up in {time.perf_counter() - started:.0f} s; process resident "
                  f"{rss_bytes(os.getpid()) / 2**30:.2f} GiB", flush=True)
        summary = sides["mxfp4 kept"].runner.model.weight_summary
        if "mxfp4 (kept)" not in summary:
            raise SystemExit(f"the MXFP4 experts were not kept on this machine ({summary}): nothing to compare")
        best = best_medians(sides, batches, steps, repeats)
        for batch in batches:
            row = " ".join(f"  {name} {batch / best[name][batch]:8.2f} tok/s" for name in sides)
            if len(sides) == 2:
                row += f"   kept/expanded {best['bf16 expanded'][batch] / best['mxfp4 kept'][batch]:5.2f}x"
            print(f"c={batch:<3}{row}", flush=True)
        per_weight = {}
        for name, side in sides.items():
            held, weights = expert_bytes(side.runner.model)
            per_weight[name] = held / weights
            print(f"{name:>14}: experts hold {held / 2**20:8.1f} MiB, {per_weight[name]:.3f} bytes a weight")
    for model, (layers, experts) in PUBLISHED.items():
        weights = layers * experts * 3 * 2880 * 2880
        print(f"{model}: {weights / 1e9:.1f}B expert weights -> " + ", ".join(
            f"{name} {weights * b / 2**30:.1f} GiB" for name, b in per_weight.items()))


if __name__ == "__main__":
    main()
