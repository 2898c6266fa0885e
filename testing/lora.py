"""LoRA adapters for tests: PEFT adapters of a local tiny checkpoint, PEFT's greedy reference, and requests of
``runner_driver`` put on adapters.

PEFT initialises ``lora_B`` to zero (an untrained adapter changes nothing), so ``save_lora_adapter`` draws it
from a normal wide enough that an adapter changes greedy output decisively: a delta dropped from one
projection, or one cut wrongly over ranks, shows as other tokens.
"""

from __future__ import annotations

import os

import torch
from llmbus.testing.runner_driver import MAX_NEW_TOKENS, MIN_MARGIN, Reference, Request

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


def on_adapters(requests: list[Request], adapter_of: dict[str, str]) -> list[Request]:
    """``requests`` with ``adapter_of[rid]``'s adapter set where it names one (the others on the base model),
    as the scheduler hands each request's adapter to the ranks."""
    for request in requests:
        request.adapter = adapter_of.get(request.rid, "")
    return requests
