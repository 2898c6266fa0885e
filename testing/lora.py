"""LoRA adapters for tests: PEFT adapters of a local tiny checkpoint, PEFT's greedy reference, and driving a
``ModelRunner`` (one rank or two) whose requests name adapters.

PEFT initialises ``lora_B`` to zero (an untrained adapter changes nothing), so ``save_lora_adapter`` draws it
from a normal wide enough that an adapter changes greedy output decisively: a delta dropped from one
projection, or one cut wrongly over ranks, shows as other tokens.
"""

from __future__ import annotations

import json
import os

import torch
from llmbus.testing import runner_driver
from llmbus.testing.runner_driver import MAX_NEW_TOKENS, MIN_MARGIN, Reference, Request
from llmbus.workers.model_runner import ModelRunner

LORA_B_STD = 0.5  # the base projections' outputs are about as wide (runner_driver.WEIGHT_STD, 64 inputs)


def save_lora_adapter(model_dir: str, out_dir: str, target_modules: list[str], *, r: int = 4, alpha: float = 8,
                      seed: int = 0, b_std: float = LORA_B_STD, **lora_config) -> str:
    """A PEFT LoRA adapter of the checkpoint in ``model_dir`` on ``target_modules`` (``lora_config``: more
    ``peft.LoraConfig`` fields, such as use_rslora or alpha_pattern), with ``lora_B`` drawn from
    N(0, ``b_std``) by ``seed``, saved in ``out_dir`` as ``save_pretrained`` saves it (safetensors)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), **lora_config)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    adapted.save_pretrained(out_dir)
    assert os.path.exists(os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


def lora_reference(model_dir: str, adapter_dir: str | None, prompts: list[list[int]]) -> Reference:
    """PEFT's float32 greedy ``generate`` of every prompt (``PeftModel.from_pretrained`` over transformers'
    model; the base model alone without ``adapter_dir``), with ``runner_driver.reference``'s margin check."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    tokens, logits = [], []
    for prompt in prompts:
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        step_logits = torch.stack(out.logits)[:, 0].float()
        top2 = step_logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "reference margins too thin to compare tokens"
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(step_logits)
    return Reference(tokens, logits)


class AdapterRequests:
    """A ``ModelRunner`` for ``runner_driver.drive`` whose sequences run with ``adapter_of[rid]`` (the
    scheduler's job: each request's adapter on every one of its rows)."""

    def __init__(self, runner: ModelRunner, adapter_of: dict[str, str]):
        self.runner, self.adapter_of = runner, adapter_of

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def launch(self, seqs, feed=None):
        for seq in seqs:
            seq.adapter = self.adapter_of.get(seq.rid, "")
        return self.runner.launch(seqs, feed)


def _runner_with_adapters(adapters: tuple[tuple[str, str], ...], adapter_of: dict[str, str]):
    def make(model_dir: str, **kwargs) -> AdapterRequests:
        return AdapterRequests(ModelRunner(model_dir, lora_adapters=adapters, **kwargs), adapter_of)
    return make


def _tp_worker_with_adapters(rank: int, adapters, adapter_of, *args) -> None:
    # The spawned rank builds its runner through runner_driver's module global: one tensor-parallel driver
    # serves every test, this one's runners loading the adapters and naming them on their rows.
    runner_driver.ModelRunner = _runner_with_adapters(adapters, adapter_of)
    runner_driver._tp_worker(rank, *args)


def drive_lora_tensor_parallel(model_dir: str, adapters: tuple[tuple[str, str], ...], adapter_of: dict[str, str],
                               requests: list[Request], work_dir: str,
                               world_size: int = 2) -> dict[str, tuple[list[int], list[float]]]:
    """``requests`` over ``world_size`` gloo ranks each loading ``adapters``, request ``rid`` running with
    ``adapter_of[rid]``: rank 0's {rid: (tokens, logprobs)}."""
    os.makedirs(work_dir, exist_ok=True)
    out_file, init_file = os.path.join(work_dir, "tp_out.json"), os.path.join(work_dir, "tp_init")
    torch.multiprocessing.spawn(_tp_worker_with_adapters, nprocs=world_size,
                                args=(adapters, adapter_of, world_size, model_dir, init_file, out_file,
                                      {"lora": requests}))
    with open(out_file) as f:
        return {rid: (tokens, logprobs) for rid, (tokens, logprobs) in json.load(f)["lora"].items()}
