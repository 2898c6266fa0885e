"""The image rows of a step: which of the flat batch's rows are image placeholders, and their embeddings
(``ModelRunner._forward`` hands them to the decoder's ``forward`` as ``embeddings``).

A prompt's chunks may split an image's placeholders (chunked prefill, a prefix-cache hit that ends inside
one): the image is encoded at the first chunk that reaches it and its rows are kept, per request, until a
chunk reaches its last placeholder, so each image is encoded once however its prompt is cut. A request that
is dropped (finished, aborted, preempted) lets go of its rows; one computed again encodes its images again.
"""

from __future__ import annotations

import torch

from llmbus.workers.seq_input import SeqInput


class StepImages:
    """The encoded images of the requests in their prompt: ``embeddings`` per step, ``drop`` per request."""

    def __init__(self, vision, device: torch.device):
        self.vision = vision  # a model's vision side: encode(ImageInput) -> [num_tokens, hidden]
        self.device = device
        self.encoded: dict[tuple[str, int], torch.Tensor] = {}  # (rid, image offset) -> its rows

    def embeddings(self, seqs: list[SeqInput], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the flat batch, their embeddings) for every image placeholder this step computes; None when
        it computes none."""
        rows, values = [], []
        first_row = 0
        for seq, n in zip(seqs, query_lens):
            start, end = seq.num_computed, seq.num_computed + n
            for image in seq.images:
                image_end = image.offset + image.num_tokens
                lo, hi = max(start, image.offset), min(end, image_end)
                if lo >= hi:
                    continue
                key = (seq.rid, image.offset)
                encoded = self.encoded.get(key)
                if encoded is None:
                    encoded = self.encoded[key] = self.vision.encode(image)
                rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
                values.append(encoded[lo - image.offset:hi - image.offset])
                if hi == image_end:  # the image's last placeholder is computed: its rows are not needed again
                    del self.encoded[key]
            first_row += n
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    def drop(self, rids: list[str]) -> None:
        gone = set(rids)
        for key in [key for key in self.encoded if key[0] in gone]:
            del self.encoded[key]

    def __len__(self) -> int:
        return len(self.encoded)
