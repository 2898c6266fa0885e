"""A model runner that computes nothing: deterministic tokens with ModelRunner's interface.

For fast scheduler and bus tests, and for measuring the overhead of everything around the model
(`--runner fake`). The next token depends only on the request's own history (its last token and
position), so outputs do not depend on batch composition, on a prefix-cache hit (``num_computed > 0`` on
a first step) or on a preemption followed by recomputation — like a real model's with seeded sampling.

A step whose prompt tokens include ``OUT_OF_MEMORY_TOKEN`` raises ``torch.OutOfMemoryError``, which the
runner handles as ModelRunner does (``out_of_memory_step``), so tests reach the path of a step that ran out
of memory without a GPU. The fake has no collectives: every rank fails that step alike, at any group size.

A request with a grammar is constrained to ``len(grammar.source)`` tokens: its next sample is forced to
``GRAMMAR_END_TOKEN`` (as a real grammar that is complete allows only end-of-sequence), and a token fed
after that end is a grammar error (rank 0 reports it, as the real matcher reports a token it cannot take).
Rank 0 also checks that every token fed where it sampled one is that token (the token a step sent ahead
feeds forward, ``SAMPLED_LAST``): a mismatch is reported as the request's error.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from llmbus.workers.launched_step import DeviceFeed, LaunchedStep, fed_ids
from llmbus.workers.loader import read_config
from llmbus.workers.memory_budget import out_of_memory_reason
from llmbus.workers.model_runner import SeqInput, StepOutput, out_of_memory_step

# A prompt token that makes the fake's step run out of memory (only at prompt positions: a sampled token
# equal to it is an ordinary decode).
OUT_OF_MEMORY_TOKEN = 999
GRAMMAR_END_TOKEN = 998  # what a constrained request samples once its grammar is complete


class FakeRunner:
    def __init__(self, model_dir: str | None = None, *, rank: int = 0, world_size: int = 1, vocab_size: int = 1000,
                 block_size: int = 16, num_blocks: int | None = None, **_ignored):
        self.rank = rank
        # Served beside a real tokenizer (`llmbus up --runner fake`), the frontend takes only ids below the
        # vocabulary the ranks report: the model's own, or every prompt past the first ids is refused.
        self.vocab_size = max(vocab_size, _configured_vocab_size(model_dir))
        self.block_size = block_size
        self.num_blocks = num_blocks or 4096
        self.max_position_embeddings = 1 << 20
        self.steps = 0
        self.last_sampled: dict[str, tuple[int, int]] = {}  # rank 0: rid -> (position, token) sampled last

    def warmup(self) -> int:
        return 1

    def next_token(self, last_token: int, position: int) -> int:
        return (last_token * 31 + position * 7 + 3) % self.vocab_size

    def launch(self, seqs: list[SeqInput], feed: DeviceFeed | None = None) -> LaunchedStep:
        """``step`` at once, its sampled ids offered to the next step as a model runner's are (the worker's
        feed on the device, exercised here with tensors on the CPU)."""
        if feed is not None:
            ids, offset = fed_ids((s.token_ids for s in seqs), feed, torch.device("cpu")).tolist(), 0
            for s in seqs:
                s.token_ids, offset = ids[offset:offset + len(s.token_ids)], offset + len(s.token_ids)
        out = self.step(seqs)
        if self.rank != 0:  # as a model's rank: the ids rank 0 broadcast (placeholders: the fake needs none)
            sampled = [s.rid for s in seqs if s.sample and not s.num_spec]
            return LaunchedStep(lambda: None, None, torch.zeros(len(sampled), dtype=torch.long), sampled)
        if out.failed or out.num_tokens:
            return LaunchedStep.finished(out)
        return LaunchedStep(lambda: out, None, torch.tensor(out.token_ids, dtype=torch.long), out.rids)

    def step(self, seqs: list[SeqInput]) -> StepOutput | None:
        try:
            return self._step(seqs)
        except torch.OutOfMemoryError as e:
            reason = out_of_memory_reason(e, seqs)
        return out_of_memory_step(reason, self.rank)

    def _step(self, seqs: list[SeqInput]) -> StepOutput | None:
        self.steps += 1
        for s in seqs:
            prompt_part = s.token_ids[:max(0, s.prompt_len - s.num_computed)]
            if OUT_OF_MEMORY_TOKEN in prompt_part:
                raise torch.OutOfMemoryError(f"fake runner: prompt token {OUT_OF_MEMORY_TOKEN} of {s.rid}")
        t0 = time.perf_counter()
        sampled = [s for s in seqs if s.sample]
        if self.rank != 0:
            return None
        errors = self._check_fed(seqs)
        tokens, num_tokens = [], []
        for s in sampled:
            if s.grammar is not None and not s.num_spec:
                position = s.num_computed + len(s.token_ids)  # of the token sampled now
                generated = position - s.prompt_len
                if generated >= len(s.grammar.source):
                    tokens.append(GRAMMAR_END_TOKEN)
                else:
                    tokens.append(self.next_token(s.token_ids[-1], position))
                if generated > len(s.grammar.source):
                    errors.append([s.rid, "generation", f"token {s.token_ids[-1]} after the grammar's end"])
                num_tokens.append(1)
                self.last_sampled[s.rid] = (position, tokens[-1])
                continue
            # each guessed position verified as the real runner does: kept while the next token agrees
            first = len(s.token_ids) - 1 - s.num_spec
            kept = 0
            while True:
                token = self.next_token(s.token_ids[first + kept], s.num_computed + first + kept + 1)
                tokens.append(token)
                kept += 1
                if kept > s.num_spec or token != s.token_ids[first + kept]:
                    break
            num_tokens.append(kept)
            self.last_sampled[s.rid] = (s.num_computed + first + kept, token)
        return StepOutput(rids=[s.rid for s in sampled], token_ids=tokens, logprobs=[-1.0] * len(tokens),
                          forward_time=time.perf_counter() - t0, sample_time=0.0, errors=errors,
                          num_tokens=num_tokens if any(s.num_spec for s in sampled) else [])

    def _check_fed(self, seqs: list[SeqInput]) -> list[list]:
        """Errors for requests fed a token other than the one sampled at its position."""
        errors = []
        for s in seqs:
            position, token = self.last_sampled.get(s.rid, (-1, 0))
            offset = position - s.num_computed
            if 0 <= offset < len(s.token_ids) and s.token_ids[offset] != token:
                errors.append([s.rid, "generation",
                               f"fed {s.token_ids[offset]} at position {position}, where {token} was sampled"])
        return errors

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.last_sampled.pop(rid, None)


def _configured_vocab_size(model_dir: str | None) -> int:
    if not (Path(model_dir or "none") / "config.json").is_file():
        return 0
    settings = read_config(model_dir)
    return int(settings.get("vocab_size") or settings.get("text_config", {}).get("vocab_size") or 0)
