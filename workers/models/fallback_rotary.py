"""RoPE of a transformers-fallback model whose rotation depends on the sequence's length (dynamic NTK, LongRoPE).

transformers' rotary module picks its base (dynamic) or its factors (LongRoPE) by the longest position of the
call it is given, and a dynamic one keeps the longest it has seen. Its ``generate`` gives it one sequence: a
prompt's tokens all take the prompt's length (one prefill), each generated token its own position's. Here a
call holds a whole packed step of sequences, prompts in chunks and decodes side by side, so the module would
rotate a token by whatever shares its step. ``wrap_length_rotaries`` makes each such module compute every
token as ``generate`` would for its sequence alone: by the prompt's length for a prompt token (the runner gives
each sequence's prompt's last position, ``AttentionMetadata.sequence_horizons``), else by its own position;
tokens that share a length are computed in one call to the module, its state reset first.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

from llmbus.workers.models.rotary import sequence_of_row


class FallbackRotary:
    """What ``ModelRunner`` reads from a model's ``rotary`` (``rope_type``, ``original_max_positions``,
    ``per_sequence``, ``by_prompt_length``), for a fallback model whose rotary modules were wrapped."""

    per_sequence = False  # (the native LongRoPE's rule: by a sequence's last position in the step)
    by_prompt_length = True

    def __init__(self, rope_type: str, original_max_positions: int):
        self.rope_type, self.original_max_positions = rope_type, original_max_positions


def wrap_length_rotaries(model: torch.nn.Module, current_step: Callable[[], object]) -> FallbackRotary | None:
    """Wrap ``model``'s dynamic NTK and LongRoPE rotary modules (``current_step()``: the running step, whose
    ``meta`` holds the horizons; None or another object outside a step); what the runner should know of them,
    or None where the model has none."""
    found = None
    for module in model.modules():
        rule = _length_rule(module)
        if rule is None:
            continue
        module.forward = types.MethodType(_by_length(type(module).forward, *rule, current_step), module)
        found = FallbackRotary(*rule)
    return found


def _length_rule(module) -> tuple[str, int] | None:
    """(rope type, original length) of a transformers rotary module that picks by length; None for others
    (and for modules with a rope type per layer kind, which are left as they are)."""
    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, str) or not hasattr(module, "original_inv_freq"):
        return None
    if "dynamic" in rope_type and hasattr(module, "original_max_seq_len"):
        return "dynamic", int(module.original_max_seq_len)
    if rope_type == "longrope":
        return "longrope", int(module.config.rope_parameters["original_max_position_embeddings"])
    return None


def _by_length(forward, rope_type: str, original: int, current_step):
    def rotate(self, x, position_ids, *args, **kwargs):
        meta = getattr(current_step(), "meta", None)
        if position_ids.shape[0] != 1:  # not a packed step (no sequence is known)
            return forward(self, x, position_ids, *args, **kwargs)
        positions = position_ids[0]
        if meta is not None and meta.sequence_horizons is not None:
            positions = torch.maximum(positions, meta.sequence_horizons[sequence_of_row(meta.start_mask(len(positions)),
                                                                                        positions)])
        lengths = positions + 1
        # tokens the module rotates alike share a call: every length within the original is the original base
        # (dynamic) or the short factors (LongRoPE), and every LongRoPE length past it the long factors
        keys = (lengths.clamp(min=original) if rope_type == "dynamic"
                else torch.where(lengths > original, original + 1, original))
        outputs = None
        for key in keys.unique().tolist():
            rows = (keys == key).nonzero().flatten()
            if rope_type == "dynamic":  # back to the trained base; the call grows it to this length only
                self.register_buffer("inv_freq", self.original_inv_freq.to(x.device), persistent=False)
                self.max_seq_len_cached = self.original_max_seq_len
            # the module picks by the call's longest position: one more, at the length's last, is dropped
            ids = torch.cat((position_ids[0, rows], position_ids.new_tensor([key - 1])))[None]
            parts = forward(self, x, ids, *args, **kwargs)
            if outputs is None:
                outputs = [p.new_empty(p.shape[0], position_ids.shape[1], *p.shape[2:]) for p in parts]
            for out, part in zip(outputs, parts):
                out[:, rows] = part[:, :-1]
        return tuple(outputs)

    return rotate
