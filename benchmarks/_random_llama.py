"""Llama models with random weights made on the device, for benchmarks that need an 8B shape without its
16 GB file: the weights (``random_weights``), a checkpoint reader over them (``RandomReader``), and
ModelRunner's loader pointed at them (``random_model_loader``).

Not a benchmark itself (the leading underscore); import it from a script in this folder.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from llmbus.workers import model_runner as model_runner_module


def meta_llama(config: dict):
    """``transformers.LlamaForCausalLM(config)`` without storage: its weights' names and shapes."""
    import transformers

    keys = {"dtype", "architectures", "model_type"}
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in config.items()
                                                                        if k not in keys}))


def llama_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The names and shapes of ``transformers.LlamaForCausalLM(config)``'s weights, worked out without
    transformers: for a script that needs only a checkpoint ModelRunner loads, importing it costs seconds."""
    hidden, intermediate, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layer = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
             "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
             "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
             "mlp.down_proj": (hidden, intermediate), "input_layernorm": (hidden,),
             "post_attention_layernorm": (hidden,)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):  # (LlamaConfig's default: untied)
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_random_llama(folder: str, config: dict, std: float = 0.02) -> str:
    """A Llama checkpoint folder of ``config`` (config.json's fields: the shapes and ``tie_word_embeddings``),
    N(0, std) float32 weights (norms 1), written without transformers (``llama_weight_shapes``)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "dtype": "float32", **config}
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * std
             for name, shape in llama_weight_shapes(config).items()}
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def random_weights(config: dict, device: torch.device, dtype: torch.dtype, std: float) -> dict[str, torch.Tensor]:
    """Every weight of ``transformers.LlamaForCausalLM(config)``, N(0, std) (norms 1), made on ``device``."""
    model = meta_llama(config)
    generator = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(t.shape, dtype=dtype, device=device)
        else:
            out[name] = torch.empty(t.shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
    return out


class RandomReader:
    """A checkpoint reader (the reads of ``loader.CheckpointReader``) over random weights made on the device, so
    an 8B-shaped model needs no 16 GB file."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.tensors.clear()

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]

    def read_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][:, start:stop]


@contextlib.contextmanager
def random_model_loader(device: torch.device):
    """ModelRunner's ``load_model`` builds the native Llama from ``RandomReader`` while the block runs."""
    from llmbus.workers.loader import read_config
    from llmbus.workers.models.llama import LlamaForCausalLM

    accepted = inspect.signature(LlamaForCausalLM.from_checkpoint).parameters

    def load(model_dir: str, *, rank: int = 0, world_size: int = 1, dtype=torch.float32, device=device, **options):
        config = read_config(model_dir)
        reader = RandomReader(random_weights(config, torch.device(device), dtype, 0.02))
        with reader:  # quantize, attention_backend: as ModelRunner passes them
            return LlamaForCausalLM.from_checkpoint(config, reader, rank=rank, world_size=world_size, dtype=dtype,
                                                    device=torch.device(device),
                                                    **{k: v for k, v in options.items() if k in accepted})

    original = model_runner_module.load_model
    model_runner_module.load_model = load
    try:
        yield
    finally:
        model_runner_module.load_model = original


LORA_MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_lora(path, config: dict, rank: int, std: float = 0.01) -> str:
    """A PEFT LoRA folder for ``LlamaForCausalLM(config)`` on every projection of every layer, rank ``rank``,
    N(0, std) matrices (what an adapter costs a step does not depend on its values), written without peft
    or the model's weights: ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT saves them."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    shapes = {name: tuple(t.shape) for name, t in meta_llama(config).state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in LORA_MODULES.items():
            for name in names:
                out_features, in_features = shapes[f"model.layers.{layer}.{block}.{name}.weight"]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in LORA_MODULES.values() for n in names]}))
    return str(folder)
