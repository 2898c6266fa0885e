"""Whole-stack tests of other model families on the demo model's shape and tokenizer: a checkpoint of a
family with random wide weights (the demo's tokenizer beside it), transformers' greedy reference with
decisive margins, and the answers a server gives to the same prompts alone and three at once.

The prompts: two long ones sharing a prefix (the second finds the first's blocks in the prefix cache once the
first ran) and a short one, so a server taking prompts in chunks sees decode rows beside prompt chunks."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from llmbus.testing.greedy import MIN_MARGIN
from llmbus.testing.runner_driver import widen_weights
from llmbus.testing.tiny_prompts import generate, ids_of

LONG = ("Once upon a time, in a land far away, there lived a curious engineer who built small machines "
        "that counted the stars, sorted the rain and sang to the wind every single morning")
PROMPTS = [LONG, LONG + " until the day the wind sang back", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
              "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def family_folder(tiny_model_dir: Path, path: Path, class_name: str, extra: dict) -> Path:
    """A ``transformers.<class_name>`` checkpoint in ``path`` with the demo model's shape (``extra`` on top)
    and tokenizer, its weights drawn from seed 0 and widened."""
    import transformers

    demo = transformers.AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**{**{k: demo[k] for k in SHAPE_KEYS}, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    widen_weights(model)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_model_dir / name, path / name)
    return path


def greedy_reference(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuations of the prompts' token ids (as the server tokenized them), each
    step's top-1 margin decisive."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
        for scores in gen.scores:
            top2 = torch.topk(scores[0].float(), 2).values
            assert top2[0] - top2[1] > MIN_MARGIN, "reference margin not decisive: pick another seed"
        out.append(gen.sequences[0, ids.shape[1]:].tolist())
    return out


def alone_then_together(server, max_new: int) -> list[list[int]]:
    """The first prompt's answer alone (its blocks then stay in the prefix cache), then all three at once."""
    first = ids_of(generate(server, PROMPTS[0], max_new)[0])
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: ids_of(generate(server, p, max_new)[0]), PROMPTS))
    return [first, *together]


def assert_answers_match(answers: list[list[int]], expected: list[list[int]]) -> None:
    """``alone_then_together``'s answers against the references of ``PROMPTS``."""
    for got, want in zip(answers, [expected[0], *expected]):
        assert got == want[:len(got)] and got, (got, want)  # a shorter answer ended on EOS
