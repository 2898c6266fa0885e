"""What a rank's memory is budgeted for, as pure arithmetic and texts: the KV pool's size on CUDA once the
largest step's activations, sampling's buffers and a draft model have their share, and the error a request
gets when a step still runs out of memory (``ModelRunner`` measures the inputs at warmup and applies them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmbus.bus.service import ServiceError
from llmbus.workers.kv_cache import blocks_within

if TYPE_CHECKING:
    from llmbus.workers.model_runner import SeqInput

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024  # when neither num_blocks nor kv_cache_bytes is given, off CUDA
# Of what the memory fraction leaves free after warmup, the KV pool takes this much: allocator
# fragmentation and the CUDA context grow a little after warmup (TGI keeps a similar margin).
CUDA_KV_HEADROOM = 0.95


class WarmupOutOfMemory(ServiceError):
    """The worst-case batch or the KV pool does not fit: a startup error, with TGI's wording."""


def cuda_kv_blocks(*, free_bytes: int, total_bytes: int, memory_fraction: float, activation_peak: int,
                   sampling_bytes: int, block_bytes: int, draft_block_bytes: int = 0) -> int:
    """The KV blocks a GPU rank's pool gets once its weights (and a draft model's) are loaded: of the
    memory free now, less what ``memory_fraction`` leaves to others and ``CUDA_KV_HEADROOM``, minus what
    steps need besides the pool: the largest step's measured ``activation_peak`` and sampling's buffers of
    the largest batch (``sampling_bytes``). A draft model's pool has the same block count as the target's
    (one block table addresses both), so each block costs ``block_bytes + draft_block_bytes``; each pool
    also holds one padding block."""
    usable = free_bytes - (1.0 - memory_fraction) * total_bytes
    budget = int(usable * CUDA_KV_HEADROOM) - activation_peak - sampling_bytes
    return blocks_within(budget, block_bytes + draft_block_bytes)


def out_of_memory_reason(error: BaseException, seqs: list[SeqInput]) -> str:
    """The text a request failed by a step that ran out of memory gets (after TGI's "Request failed during
    generation: "): the start of torch's own text, with the step's size and what to lower. Torch's goes on
    about the device's memory and the allocator's settings, for an operator rather than a client."""
    sentences = str(error).strip().splitlines()[0].split(". ") if str(error).strip() else [type(error).__name__]
    tokens = sum(len(s.token_ids) for s in seqs)
    return (f"Server error: out of memory computing a step of {tokens} tokens for {len(seqs)} request(s): "
            f"{'. '.join(sentences[:2]).rstrip('.')}. Lower `--max-batch-prefill-tokens` or "
            f"`--cuda-memory-fraction`")
