"""What a step computes for one sequence (``ModelRunner.launch``'s rows), as the worker builds it from the
scheduler's command."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmbus.bus.messages import Grammar, ImageInput, SamplingParams


@dataclass(slots=True)
class SeqInput:
    """One sequence's share of a step."""

    rid: str
    token_ids: list[int]  # new tokens to compute this step (whole prompt, a chunk, or 1 decode token)
    num_computed: int  # tokens of this sequence already in the KV cache; positions start here
    block_table: list[int]  # KV block ids of this sequence, in order (covers num_computed+len(token_ids) tokens)
    sample: bool  # sample a next token from the last position's logits
    sampling: SamplingParams
    prompt_len: int = 0  # tokens of the prompt; positions from here on hold generated tokens
    prompt_logprobs: bool = False  # return the log-probability of every prompt token after the first
    # Tokens at positions 0..len-1 whose K/V the request found already in its first blocks when it
    # (re)started (NewRequestData.cached_ids; its first step has num_computed == len(cached_ids)). Read
    # only when rank 0 starts the token history of a request with penalties.
    cached_ids: list[int] = field(default_factory=list)
    grammar: Grammar | None = None  # constrained decoding (rank 0 masks the sampled token's logits)
    # Of token_ids, the trailing guesses to verify (speculation): every one of the last 1 + num_spec
    # positions is sampled, and the guesses are kept up to the first one its position's sample disagrees
    # with, then that sample (scheduler/speculation.py).
    num_spec: int = 0
    adapter: str = ""  # the LoRA adapter this sequence runs with (a name of lora_names); "": the base model
    # the request's images (NewRequestData.images): the placeholders among token_ids read theirs; those in the
    # cached prefix, stubs without their files, still place the positions after them (M-RoPE, mrope.py)
    images: list[ImageInput] = field(default_factory=list)
