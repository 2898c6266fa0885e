"""The rotary positions of a step's rows for a model with M-RoPE (Qwen2-VL, Qwen2.5-VL): ``[3, T]``, each
row's temporal, row and column position, which the decoder rotates three sections of its pairs by.

A text token's three are equal: its place in the sequence, shifted by the images before it. An image's
placeholders all share its first position as their temporal one, and add their row and column in the
image's grid (``ImageInput.grid``, [rows, cols]) to it; the text after an image resumes max(rows, cols)
past the image's first position instead of one past its last placeholder, as transformers'
``get_rope_index`` lays a prompt out. So a row's positions depend on every image before it, those in the
cached prefix included (the scheduler sends them as stubs without their files), and generated tokens keep
the prompt's shift.

The K/V cache still holds a token at its place in the sequence (``AttentionMetadata.positions``); only the
rotation reads these.
"""

from __future__ import annotations

import numpy as np
import torch

from llmbus.bus.messages import ImageInput
from llmbus.workers.seq_input import SeqInput


def mrope_positions(seqs: list[SeqInput], query_lens: list[int], device: torch.device) -> torch.Tensor | None:
    """``[3, T]`` rotary positions of the step's rows; None when no sequence holds an image laid out in a
    grid (every row's is then its place in the sequence, as for plain RoPE)."""
    if not any(image.grid for seq in seqs for image in seq.images):
        return None
    out = np.empty((3, sum(query_lens)), dtype=np.int64)
    plain_rows, plain_positions = [], []  # rows past all their sequence's images: one shift, three equal
    row = 0
    for seq, n in zip(seqs, query_lens):
        if past_images(seq):
            shift = text_shift(seq.images)
            if n == 1:  # a decode row: kept off numpy's per-call cost, which a large batch would pay per row
                plain_rows.append(row)
                plain_positions.append(seq.num_computed + shift)
            else:
                out[:, row:row + n] = np.arange(seq.num_computed + shift, seq.num_computed + shift + n)
        else:
            out[:, row:row + n] = sequence_positions(seq.images, seq.num_computed, n)
        row += n
    if plain_rows:
        out[:, plain_rows] = plain_positions
    return torch.from_numpy(out).to(device)


def past_images(seq: SeqInput) -> bool:
    """Whether the sequence's rows this step are all past its images: their three positions are then equal, their
    place plus ``text_shift`` (what a replayed decode graph takes, ``cuda_graphs.py``)."""
    images = seq.images
    return not images or seq.num_computed >= images[-1].offset + images[-1].num_tokens


def text_shift(images: list[ImageInput]) -> int:
    """How far the rotary positions of the text after ``images`` are from its places."""
    return sum(max(image.grid or (1, image.num_tokens)) - image.num_tokens for image in images)


def sequence_positions(images: list[ImageInput], start: int, count: int) -> np.ndarray:
    """``[3, count]`` rotary positions of a sequence's tokens ``start .. start + count``, its ``images`` in
    prompt order."""
    index = np.arange(start, start + count, dtype=np.int64)
    out = np.broadcast_to(index, (3, count)).copy()
    shift = 0  # of the tokens after the images so far: their positions less their places
    for image in images:
        rows, cols = image.grid or (1, image.num_tokens)
        end = image.offset + image.num_tokens
        inside = (index >= image.offset) & (index < end)
        if inside.any():
            first = image.offset + shift
            local = index[inside] - image.offset
            out[0, inside] = first
            out[1, inside] = first + local // cols
            out[2, inside] = first + local % cols
        gap = max(rows, cols) - image.num_tokens
        out[:, index >= end] += gap
        shift += gap
    return out
