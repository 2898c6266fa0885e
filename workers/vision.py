"""The image rows of a step: which of the flat batch's rows are image placeholders, and their embeddings
(``ModelRunner._forward`` hands them to the decoder's ``forward`` as ``embeddings``).

A prompt's chunks may split an image's placeholders (chunked prefill, a prefix-cache hit that ends inside
one): the image is encoded at the first chunk that reaches it and its rows are kept, per request, until a
chunk reaches its last placeholder, so each image is encoded once however its prompt is cut. A request that
is dropped (finished, aborted, preempted) lets go of its rows; one computed again encodes its images again.

An image the ranks cannot read (the frontend decoded it, but the image processor may still refuse a mode or
size) fails its request, not the rank: every rank fails it alike (the same bytes, the same code), computes
the step with the placeholders' own embeddings so the collectives stay paired, and rank 0 reports it in the
step's errors, on which the scheduler fails the request.

A model's vision side is a ``VisionEncoder``: it says what an image's pixels become (``_features``), and
the encoder checks them against the placeholders the frontend counted.

Where a model's image placeholders attend each other both ways (Gemma 3), ``image_key_limits`` gives each row of
a step the last position it attends; the scheduler computes such an image's placeholders in one step
(``WorkerReady.images`` "whole"), so an image's later keys are in the step with its earlier queries.
"""

from __future__ import annotations

import io

import torch

from llmbus.bus.messages import ImageInput
from llmbus.workers.mrope import past_images
from llmbus.workers.seq_input import SeqInput


def blank_image():
    """A grey picture, what the warmup encodes."""
    from PIL import Image

    return Image.new("RGB", (64, 64), (127, 127, 127))


class VisionEncoder:
    """A vision-language model's image side (``model.vision``). A family implements ``_features``: an opened
    image's embeddings ``[placeholders, text hidden]`` in its placeholders' order, and their [rows, cols]
    where the model's positions follow them (``ImageInput.grid``), else None."""

    def _features(self, picture) -> tuple[torch.Tensor, list[int] | None]:
        raise NotImplementedError

    def encode(self, image: ImageInput) -> torch.Tensor:
        """``[image.num_tokens, text hidden]``: the embeddings of the image's placeholders. Raises
        ``ValueError`` where they are not the placeholders the frontend counted and laid out."""
        from PIL import Image

        with Image.open(io.BytesIO(image.data)) as picture:
            features, grid = self._features(picture)
        if features.shape[0] != image.num_tokens:
            raise ValueError(f"an image gave {features.shape[0]} embeddings for its {image.num_tokens} placeholders")
        if grid is not None and image.grid and grid != list(image.grid):
            raise ValueError(f"an image's placeholders lie in a {grid[0]}x{grid[1]} grid, not in {image.grid}")
        return features

    def warm(self) -> None:
        """Encode a blank image: the vision side's first run (and, on CUDA, its memory peak) happen at warmup,
        not in the first request's step."""
        self._features(blank_image())


class StepImages:
    """The encoded images of the requests in their prompt: ``embeddings`` per step, ``drop`` per request."""

    def __init__(self, vision, device: torch.device):
        self.vision = vision  # the model's VisionEncoder
        self.device = device
        self.encoded: dict[tuple[str, int], torch.Tensor] = {}  # (rid, image offset) -> its rows
        self.failed: dict[str, str] = {}  # rid -> why one of its images could not be read, until it is dropped
        self._new_failures: list[str] = []  # rids failed since take_failures

    def embeddings(self, seqs: list[SeqInput], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the flat batch, their embeddings) for every image placeholder this step computes; None when
        it computes none."""
        rows, values = [], []
        first_row = 0
        for seq, n in zip(seqs, query_lens):
            if past_images(seq):  # a decode row (a sequence carries its images at every step, for M-RoPE)
                first_row += n
                continue
            start, end = seq.num_computed, seq.num_computed + n
            for image in seq.images if seq.rid not in self.failed else ():
                image_end = image.offset + image.num_tokens
                lo, hi = max(start, image.offset), min(end, image_end)
                if lo >= hi:
                    continue
                key = (seq.rid, image.offset)
                encoded = self.encoded.get(key)
                if encoded is None:
                    try:
                        encoded = self.encoded[key] = self.vision.encode(image)
                    except Exception as e:  # noqa: BLE001 - whatever the image processor raises fails the request
                        self.failed[seq.rid] = f"invalid image content: {e}"
                        self._new_failures.append(seq.rid)
                        break
                rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
                values.append(encoded[lo - image.offset:hi - image.offset])
                if hi == image_end:  # the image's last placeholder is computed: its rows are not needed again
                    del self.encoded[key]
            first_row += n
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    def take_failures(self) -> list[list]:
        """``[[rid, "validation", why]]`` of the requests whose image failed since the last call (a step's
        errors)."""
        failures = [[rid, "validation", self.failed[rid]] for rid in self._new_failures if rid in self.failed]
        self._new_failures = []
        return failures

    def drop(self, rids: list[str]) -> None:
        gone = set(rids)
        for key in [key for key in self.encoded if key[0] in gone]:
            del self.encoded[key]
        for rid in gone:
            self.failed.pop(rid, None)

    def __len__(self) -> int:
        return len(self.encoded) + len(self.failed)


def image_key_limits(seqs: list[SeqInput], query_lens: list[int]) -> list[int] | None:
    """Per row of the flat batch, the last position it attends (``AttentionBackend.build_metadata``'s
    ``key_limits``) where an image's placeholders attend their whole image: an image's last placeholder for its
    rows, its own position for the others; None when the step computes no image's placeholders. Raises
    ``ValueError`` for a step that ends inside an image: its later placeholders would be missing from the keys."""
    spans = []  # (first row, end row, the image's last position)
    first_row = 0
    for seq, n in zip(seqs, query_lens):
        start, end = seq.num_computed, seq.num_computed + n
        for image in () if past_images(seq) else seq.images:
            last = image.offset + image.num_tokens - 1
            lo, hi = max(start, image.offset), min(end, last + 1)
            if lo >= hi:
                continue
            if last >= end:
                raise ValueError(f"{seq.rid}: a step ends inside an image whose placeholders attend each other "
                                 f"both ways (at {end}, the image ends at {last + 1})")
            spans.append((first_row + lo - start, first_row + hi - start, last))
        first_row += n
    if not spans:
        return None
    limits = [position for seq, n in zip(seqs, query_lens)
              for position in range(seq.num_computed, seq.num_computed + n)]
    for lo, hi, last in spans:
        limits[lo:hi] = [last] * (hi - lo)
    return limits
