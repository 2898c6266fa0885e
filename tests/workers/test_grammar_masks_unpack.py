"""How a grammar's allowed-token bitmask becomes the tokens to forbid (workers/grammar.forbidden_tokens): on
the CPU numpy unpacks the bits; for a GPU the device unpacks them (the bitmask goes over, 32 times smaller
than a bool per token, without waiting for the step). Both give the same tokens, up to a vocabulary that
ends mid-word."""

import numpy as np
import torch

from llmbus.workers.grammar import forbidden_tokens


def test_the_device_unpacks_the_bitmask_as_numpy_does():
    rng = np.random.default_rng(0)
    vocab = 32 * 5 + 7
    masks = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, size=(4, 6), dtype=np.int64).astype(np.int32)
    masks[1] = -1  # every token allowed (all bits set: a negative int32)
    masks[2] = 0  # none
    on_host = forbidden_tokens(masks, vocab, torch.device("cpu"), unpack_on_device=False)
    on_device = forbidden_tokens(masks, vocab, torch.device("cpu"), unpack_on_device=True)
    assert on_host.shape == on_device.shape == (4, vocab)
    assert torch.equal(on_host, on_device)
    assert not on_host[1].any() and on_host[2].all()
    token = 32 * 3 + 9  # bit 9 of word 3
    assert bool(on_host[0, token]) == (not (int(masks[0, 3]) >> 9) & 1)
