"""Decode speed of the natively served model families against transformers' fallback, and MoE against dense.

    python benchmarks/families.py [--families llama,qwen3,phi3,gemma3,gemma2,mixtral,qwen3_moe,gpt_oss] [--batches 1,64]
    python benchmarks/families.py --dry-run      # a tiny shape, to check the script runs

Each family is a random checkpoint made with transformers' own config class at the same shape (hidden
1024, 8 layers, 16 heads over 8 KV heads, intermediate 2816; MoE: 8 experts, top-2, each expert 1408 wide),
saved in float32 and served through ModelRunner in ``--dtype``. For each family and batch size it times
decode steps (``decode_step.LlmbusDecode``: a prefill of ``--context`` tokens per sequence, then the median
of ``--steps`` whole steps, sampling included) twice in the same process, alternated over ``--repeats``
rounds (best median counts): the native model, and the same checkpoint through the transformers fallback
(``workers.loader.native_builders`` emptied while it loads). It prints tokens/s for each and their ratio
(issue #38: native must not be slower than the fallback on any shape), then:

- Qwen3's step against Llama's of the same width and depth (issue #38: within 10% on CPU);
- each MoE's step against a dense Llama whose MLP is as wide as the active experts (top-2 x 1408 = 2816),
  the same compute per token.

Nothing is written; the numbers depend on the machine, so run it on a quiet one.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import torch

from decode_step import LlmbusDecode, add_timing_options, best_medians, timing_of

from llmbus.testing.runner_driver import widen_weights
from llmbus.workers import loader

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
DRY_SHAPE = dict(SHAPE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512)
EXPERTS, TOP_K = 8, 2

# name -> (transformers config class, arguments on top of the shape); the MoE experts are as wide as half
# the dense intermediate size, so top-2 computes what the dense MLP does.
def family_configs(shape: dict) -> dict[str, tuple[str, dict]]:
    expert = shape["intermediate_size"] // TOP_K
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return {
        "llama": ("LlamaConfig", {}),
        "qwen3": ("Qwen3Config", dict(head_dim=head_dim)),
        "phi3": ("Phi3Config", {}),
        "gemma3": ("Gemma3TextConfig", dict(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512)),
        "gemma2": ("Gemma2Config", dict(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512)),
        "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                          intermediate_size=expert)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=head_dim, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                             moe_intermediate_size=expert, norm_topk_prob=True)),
        "gpt_oss": ("GptOssConfig", dict(head_dim=head_dim, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                         intermediate_size=expert, sliding_window=128)),
    }


def save_checkpoint(path: str, config_class: str, shape: dict, arguments: dict) -> None:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**shape, **arguments})
    model = transformers.AutoModelForCausalLM.from_config(config)
    widen_weights(model)
    model.save_pretrained(path)


@contextlib.contextmanager
def fallback_only():
    """Every model_type loads through the transformers fallback while inside."""
    saved = loader.native_builders
    loader.native_builders = dict
    try:
        yield
    finally:
        loader.native_builders = saved


def measure(path: str, dtype: torch.dtype, batches: list[int], context: int, steps: int, repeats: int,
            compare_fallback: bool) -> dict[str, dict[int, float]]:
    """{"native"/"fallback": {batch: best median seconds per step}}."""
    sides = {"native": LlmbusDecode(path, dtype, max(batches), context, steps)}
    if compare_fallback:
        with fallback_only():
            sides["fallback"] = LlmbusDecode(path, dtype, max(batches), context, steps)
    return best_medians(sides, batches, steps, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="llama,qwen3,phi3,gemma3,mixtral,qwen3_moe")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--no-fallback", action="store_true", help="time the native models only")
    add_timing_options(p, "1,64", 16, "tiny shape, batches 1,4, 3 steps, one round")
    a = p.parse_args()
    shape = DRY_SHAPE if a.dry_run else SHAPE
    batches, steps, repeats, context = timing_of(a, [1, 4])
    dtype = getattr(torch, a.dtype)
    configs = family_configs(shape)
    names = a.families.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype}, hidden {shape['hidden_size']}, "
          f"{shape['num_hidden_layers']} layers, context {context}, {steps} timed steps, best of {repeats}")
    results: dict[str, dict[str, dict[int, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names + (["dense_active"] if {"mixtral", "qwen3_moe"} & set(names) else []):
            config_class, arguments = configs.get(name, ("LlamaConfig", {}))  # dense_active: Llama, same MLP width
            path = f"{scratch}/{name}"
            save_checkpoint(path, config_class, shape, arguments)
            try:
                results[name] = measure(path, dtype, batches, context, steps, repeats,
                                        compare_fallback=not a.no_fallback and name != "dense_active")
            except Exception as e:  # noqa: BLE001 - one family failing leaves the others' rows
                print(f"{name}: failed: {type(e).__name__}: {e}")
                continue
            for batch in batches:
                native = results[name]["native"][batch]
                row = f"{name:>12} c={batch:<3} native {batch / native:9.1f} tok/s"
                if "fallback" in results[name]:
                    fallback = results[name]["fallback"][batch]
                    row += f"   fallback {batch / fallback:9.1f} tok/s   native/fallback {fallback / native:5.2f}x"
                print(row, flush=True)
    print()
    for batch in batches:
        if "llama" in results and "qwen3" in results:
            ratio = results["qwen3"]["native"][batch] / results["llama"]["native"][batch]
            print(f"qwen3 step / llama step, c={batch}: {ratio:.3f} (target <= 1.10)")
        for moe in ("mixtral", "qwen3_moe"):
            if moe in results and "dense_active" in results:
                ratio = results[moe]["native"][batch] / results["dense_active"]["native"][batch]
                print(f"{moe} step / dense step of the same active size, c={batch}: {ratio:.3f}")


if __name__ == "__main__":
    main()
