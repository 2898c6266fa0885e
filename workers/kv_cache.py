"""The paged KV block pool of one rank.

The scheduler owns block ids ``0 .. num_blocks - 1`` and hands them to requests; this module only holds
the memory. One K and one V tensor cover every layer, ``[num_layers, num_kv_heads_per_rank,
num_blocks + 1, block_size, head_dim]``, allocated once: blocks are overwritten in place, never
reallocated. Heads come before blocks so that gathering a batch's context by slot yields
``[heads, batch, context, head_dim]`` directly, the layout batched attention matmuls consume.
"""

from __future__ import annotations

import torch


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers, K and V together (``num_kv_heads`` of this rank)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_bytes(budget_bytes: int, *, num_layers: int, block_size: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype) -> int:
    """How many blocks fit in ``budget_bytes`` (the pool's extra padding block included)."""
    return blocks_within(budget_bytes, bytes_per_block(num_layers=num_layers, block_size=block_size,
                                                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype))


def blocks_within(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` a pool of ``budget_bytes`` holds besides its padding block."""
    return max(0, budget_bytes // block_bytes - 1)


class PagedKVCache:
    """Preallocated K/V storage addressed by (block id, offset in block), for every layer of one rank.

    Block ``num_blocks`` (one past the scheduler's range) is a private padding block that padded block
    tables point at. Attention gathers whole blocks, so it also reads the unwritten tail of a sequence's
    last block (masked, but a NaN bit pattern would survive masking, since 0 * NaN is NaN): the pool is
    zeroed once at allocation, after which every slot holds finite values. Zeroing also commits the
    memory at startup, so a pool the machine cannot back fails there rather than mid-generation.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 compute_dtype: torch.dtype | None = None):
        """``dtype``: what the pool stores; ``compute_dtype``: what attention computes in, the model's
        activations (default ``dtype``). A narrower pool (``--kv-cache-dtype``) rounds K/V as they are written
        and widens them as they are read."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype or dtype
        shape = (num_layers, num_kv_heads, num_blocks + 1, block_size, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        # Flat slot views per layer: slot = block_id * block_size + offset. Views share the storage.
        flat_shape = (num_layers, num_kv_heads, (num_blocks + 1) * block_size, head_dim)
        self.key_slots = self.key.view(flat_shape)
        self.value_slots = self.value.view(flat_shape)

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_kv_heads, num_blocks + 1, block_size, head_dim]`` K and V views of one layer."""
        return self.key[layer], self.value[layer]

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_kv_heads, (num_blocks + 1) * block_size, head_dim]`` K and V views of one layer."""
        return self.key_slots[layer], self.value_slots[layer]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """A step's new ``key``/``value [T, Hkv, D]`` into ``layer`` at ``slots [T]``, in the pool's dtype."""
        key_slots, value_slots = self.layer_slots(layer)  # [Hkv, slots, D]
        key_slots.index_copy_(1, slots, key.transpose(0, 1).to(key_slots.dtype))
        value_slots.index_copy_(1, slots, value.transpose(0, 1).to(value_slots.dtype))
