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
