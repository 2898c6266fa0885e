"""Prompt logprobs (TGI's ``decoder_input_details`` prefill details) against transformers' log-softmax.

ModelRunner level: whole prompts and prompts split into chunks (the last row of a chunk scores the
first token of the next), beside a request that does not ask for them. End to end: ``/generate`` with
``decoder_input_details`` on a server started with ``--enable-prefill-logprobs``, and ``prefill: []``
on one started without it, as TGI 3 does.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.workers.model_runner import ModelRunner, SeqInput

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=300, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    path = str(tmp_path_factory.mktemp("prompt-logprobs"))
    model.save_pretrained(path)
    return path


def _reference_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of each position that scores a prompt token: ``[len(prompt) - 1, vocab]``."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _scored(rows: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    return rows.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)


def _run(runner: ModelRunner, prompt: list[int], chunks: list[int], rid: str, blocks: list[int],
         neighbour: list[int] | None = None, top_n: int = 0) -> tuple[list[float], list]:
    """Feed ``prompt`` in ``chunks`` (token counts); a greedy neighbour without prompt logprobs decodes
    alongside. Returns the concatenated prompt logprobs reported for ``rid``, and their positions' top
    ``top_n`` tokens."""
    got: list[float] = []
    tops: list = []
    done = 0
    neighbour_tokens, neighbour_computed = list(neighbour or []), 0
    neighbour_blocks = list(range(100, 120))
    for n in chunks:
        seqs = [SeqInput(rid=rid, token_ids=prompt[done:done + n], num_computed=done, block_table=blocks,
                         sample=done + n == len(prompt), sampling=SamplingParams(top_n_tokens=top_n),
                         prompt_len=len(prompt), prompt_logprobs=True)]
        if neighbour is not None:
            new = neighbour_tokens if neighbour_computed == 0 else neighbour_tokens[-1:]
            seqs.insert(0, SeqInput(rid=f"{rid}-n", token_ids=new, num_computed=neighbour_computed,
                                    block_table=neighbour_blocks, sample=True, sampling=SamplingParams(),
                                    prompt_len=len(neighbour)))
            neighbour_computed += len(new)
        out = runner.step(seqs)
        for entry_rid, values, top in out.prompt_logprobs:
            assert entry_rid == rid, "a request that did not ask got prompt logprobs"
            got.extend(values)
            tops.extend(top)
        if neighbour is not None:
            neighbour_tokens.append(out.token_ids[out.rids.index(f"{rid}-n")])
        done += n
    runner.drop([rid, f"{rid}-n"])
    return got, tops


@pytest.mark.parametrize("chunks", [[23], [8, 8, 7], [1, 21, 1]], ids=["whole", "three-chunks", "edges"])
def test_prompt_logprobs_match_transformers(llama_dir, chunks):
    prompt = [random.Random(5).randrange(300) for _ in range(23)]
    expected = _reference_prompt_logprobs(llama_dir, prompt)
    runner = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=128, max_batch_prefill_tokens=64)
    got, tops = _run(runner, prompt, chunks, "p", list(range(40, 46)), neighbour=[7, 8, 9])
    assert len(got) == len(prompt) - 1 and tops == []
    torch.testing.assert_close(torch.tensor(got), _scored(expected, prompt), rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunks", [[23], [8, 8, 7], [1, 21, 1]], ids=["whole", "three-chunks", "edges"])
def test_prompt_top_tokens_match_transformers(llama_dir, chunks):
    """With ``top_n_tokens``, each scored prompt position also reports its most likely tokens (what OpenAI's
    completions echo with logprobs lists per prompt token, lm-eval's greedy check reads): transformers' top 3,
    in order, across chunk edges too; each position's token is among them exactly when it ranks that high."""
    prompt = [random.Random(5).randrange(300) for _ in range(23)]
    expected = _reference_prompt_logprobs(llama_dir, prompt)
    runner = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=128, max_batch_prefill_tokens=64)
    got, tops = _run(runner, prompt, chunks, "p", list(range(40, 46)), neighbour=[7, 8, 9], top_n=3)
    assert len(tops) == len(got) == len(prompt) - 1
    reference = expected.topk(3, dim=-1)
    assert [ids for ids, _ in tops] == reference.indices.tolist()
    torch.testing.assert_close(torch.tensor([lps for _, lps in tops]), reference.values, rtol=0, atol=1e-4)
    for position, (ids, lps) in enumerate(tops):
        if prompt[position + 1] in ids:
            assert lps[ids.index(prompt[position + 1])] == got[position]


def test_one_token_prompt_has_no_prompt_logprobs(llama_dir):
    runner = ModelRunner(llama_dir, block_size=BLOCK_SIZE, num_blocks=16, max_batch_prefill_tokens=64)
    assert _run(runner, [5], [1], "single", [0]) == ([], [])
