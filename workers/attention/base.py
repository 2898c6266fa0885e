"""The attention backend contract, and the per-step index work every backend shares.

A backend turns one step's scheduling (each sequence's new tokens, its tokens already in the KV cache and
its block table) into attention over the paged KV cache, in two calls:

- ``build_metadata``, once per step, on the host lists: whatever index tensors its kernels need (shared by
  every layer), plus each new token's position (RoPE's input) and KV slot, and, from a backend that
  ``gives_kernel_rows``, the step as ``KernelRows`` where it can be one: what a native layer that attends
  by itself (``fused_decode.py``) reads;
- ``forward``, once per layer: write the step's new K/V into their slots, then attend every query over
  its own sequence's context, causally, within the layer's sliding window if it has one;
  ``forward_rotary``, what the native decoder calls instead, takes the queries and keys before RoPE, so a
  backend may rotate them as it writes the keys (the Triton one does, in one kernel); by default it
  rotates, then calls ``forward``.

A backend owns how K/V sit inside a block (``PagedKVCache`` fixes only the pool's shape, ``[layers, Hkv,
blocks + 1, block_size, D]``): the CPU backend keeps bf16 blocks in its kernel's layout, so only the
backend that wrote a pool may read it. The scheduler and the prefix cache see block ids, never contents.

Sliding-window attention (Mistral, Qwen2's windowed layers) is given per layer when the backend is made:
a query at position ``q`` sees the keys ``k`` with ``q - window < k <= q``, transformers'
``sliding_window_overlay``. Keys outside the window stay in the cache (the scheduler frees a request's
blocks only when it ends); they are masked, or skipped.

Two more per-layer shapings of the scores are given the same way, as transformers' eager attention applies
them: a soft cap (Gemma 2: each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before the mask), and
sinks (gpt-oss: one learned logit per query head that joins each row's softmax and carries no value, so a
row's weights sum to less than one). Every backend computes both.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from llmbus.workers.gpu_ops import apply_rotary
from llmbus.workers.kv_cache import PagedKVCache
from llmbus.workers.launched_step import to_device


@dataclass(slots=True)
class KernelRows:
    """Rows attended as decode_attention.c attends them, each one query token over its sequence's keys up to
    itself: decoding sequences, or every token of a step (``AttentionBackend.prompt_rows``)."""

    token_index: torch.Tensor | None  # [B] rows of the step's flat token batch; None: all, in order
    block_index: torch.Tensor  # [B, n] each sequence's blocks, in order (rows may be strided)
    context_lens: torch.Tensor  # [B] int64 context length with this step's token
    window_starts: tuple[torch.Tensor, ...]  # per window of the backend: [B] each sequence's first visible key
    max_context: int


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors, built once and used by every layer."""

    positions: torch.Tensor  # [T] position of each new token in its sequence (RoPE input)
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to: block * block_size + offset
    groups: list[Any]  # the backend's own per-group index tensors
    # The whole step as kernel rows, every token in order, where the backend made it one (its only group);
    # None otherwise.
    kernel_rows: KernelRows | None = None
    # [N] first row of each sequence in the flat token batch; None: every row is a sequence of its own (a
    # decode-only step). LongRoPE chooses its factors per sequence.
    sequence_starts: torch.Tensor | None = None
    # [N] per sequence, the last position LongRoPE chooses its factors by, where that lies past its last row in
    # the step: a chunk of a prompt that goes on (transformers rotates a whole prompt alike). Set by the runner;
    # None: each sequence's last row.
    sequence_horizons: torch.Tensor | None = None

    def start_mask(self, num_rows: int) -> torch.Tensor | None:
        """[num_rows] bool, True at each sequence's first row; None where every row starts one."""
        if self.sequence_starts is None:
            return None
        return torch.zeros(num_rows, dtype=torch.bool, device=self.positions.device).index_fill_(
            0, self.sequence_starts, True)


@dataclass(slots=True)
class DecodeGraphInputs:
    """The device tensors a captured decode step reads (``workers/cuda_graphs.py``): up to ``max_batch`` rows
    of one token each, rewritten before every replay. A graph of ``batch`` rows reads the first ``batch`` of
    each: views, whose addresses the graph keeps."""

    positions: torch.Tensor  # [max_batch] int64 each row's position; also its tokens already in the cache
    slot_mapping: torch.Tensor  # [max_batch] int64 the KV slot its K/V is written to
    tables: torch.Tensor  # [max_batch, max_blocks] int64 its blocks, in order (unread past its context)


@dataclass(slots=True)
class StepIndex:
    """The step's sequences and tokens as device tensors: views of one copy from the host (``step_index``)."""

    query_lens: torch.Tensor  # [N]
    num_computed: torch.Tensor  # [N] tokens already in the cache
    query_starts: torch.Tensor  # [N] first row of each sequence in the flat token batch
    tables: torch.Tensor  # [N, max_blocks] block tables, padded with the pool's spare block
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    # [2, P] int32, where a query tile was given: each tile's sequence and first row of the flat token batch
    programs: torch.Tensor | None = None


def exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


@dataclass(slots=True)
class _HostIndex:
    """A step's index fields as numpy int64 arrays, from the host lists (``host_index``)."""

    lens: np.ndarray  # [N]
    computed: np.ndarray  # [N]
    starts: np.ndarray  # [N]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    flat_blocks: np.ndarray  # every sequence's blocks, one table after the other
    table_index: np.ndarray  # each of flat_blocks' place in an [N, width] table
    width: int
    program_seq: np.ndarray | None  # with a query tile: each tile's sequence
    program_rows: np.ndarray | None  # ... and its first row of the flat token batch


def host_index(query_lens: list[int], num_computed: list[int], block_tables: list[list[int]], block_size: int,
               query_tile: int | None = None, width: int | None = None) -> _HostIndex:
    """What ``step_index`` (and ``MixedGraphIndex.stage``) send, computed with numpy over the lists: each
    block's place in a table ``width`` wide (default: the longest table's)."""
    lens = np.asarray(query_lens, dtype=np.int64)
    computed = np.asarray(num_computed, dtype=np.int64)
    widths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    flat_blocks = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(widths.sum()))
    width = int(widths.max()) if width is None else width
    first_block = np.cumsum(widths) - widths
    table_index = np.arange(flat_blocks.size) - np.repeat(first_block - np.arange(len(widths)) * width, widths)
    starts = np.cumsum(lens) - lens
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(int(lens.sum())) - starts[seq_of_token] + computed[seq_of_token]
    slots = flat_blocks[first_block[seq_of_token] + positions // block_size] * block_size + positions % block_size
    program_seq = program_rows = None
    if query_tile is not None:
        tiles = -(-lens // query_tile)
        program_seq = np.repeat(np.arange(len(lens)), tiles)
        first_tile = np.cumsum(tiles) - tiles
        program_rows = starts[program_seq] + (np.arange(program_seq.size) - first_tile[program_seq]) * query_tile
    return _HostIndex(lens, computed, starts, positions, slots, flat_blocks, table_index, width, program_seq,
                      program_rows)


def _pack(fields: list[np.ndarray], program_width: int, capacities: list[int] | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """One int64 array for one copy: first the program map's words (two int32 rows of ``program_width``, a
    multiple of 4), then each field from a 16-byte boundary, at its size or (``capacities``) at a fixed size
    that the fields of any step fit; and each field's offset."""
    per_line = 16 // 8  # int64s a 16-byte boundary
    sizes = capacities if capacities is not None else [f.size for f in fields]
    offsets = program_width + np.cumsum([0] + [-(-n // per_line) * per_line for n in sizes])
    packed = np.zeros(int(offsets[-1]), dtype=np.int64)
    for field, offset in zip(fields, offsets):
        packed[offset:offset + field.size] = field
    return packed, offsets


def _program_width(programs: int) -> int:
    """The program map's row length for ``programs``: two int32 rows (sequences, first rows) of a multiple of 4
    values, so that each starts on a 16-byte boundary; their 2 x width int32s fill width int64s."""
    return -(-programs // 4) * 4


def _write_program_map(packed: np.ndarray, program_width: int, host: _HostIndex,
                       padding_seq: int | None = None) -> None:
    """``host``'s query tiles into the [2, program_width] int32 view of ``packed``'s first words (``_pack``); the
    programs past them on ``padding_seq`` where given."""
    program_map = packed[:program_width].view(np.int32).reshape(2, program_width)
    if padding_seq is not None:
        program_map[0].fill(padding_seq)
    program_map[0, :host.program_seq.size] = host.program_seq
    program_map[1, :host.program_seq.size] = host.program_rows


def step_index(query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
               kv_cache: PagedKVCache, device: torch.device, query_tile: int | None = None) -> StepIndex:
    """Block tables, positions and slots of one step, computed on the host (numpy over the lists) and sent in
    one copy that does not wait (``to_device``): on a GPU each torch op here was a launch of its own, and in a
    served c=64 wave this function was a third of an eager step's host time beside its layers (run 9's
    py-spy). Each field is a view of that copy, starting on a 16-byte boundary (Triton compiles a kernel again
    for each pattern of its pointers' alignment, so a new batch size would otherwise cost a compile
    mid-serving). Where the padded table is no larger than the blocks and their places in it (contexts of
    similar lengths, as a served batch's are), the host builds it and it goes over as it is; else (one long
    context beside short ones, which would send every row padded to its length) the blocks go over as they are
    and are placed into the padded table on the device, two more launches. With ``query_tile``, each
    sequence's queries in tiles of that many tokens: for each tile, its sequence and first row (a kernel's
    program map: the Triton backend's), in the same copy."""
    host = host_index(query_lens, num_computed, block_tables, kv_cache.block_size, query_tile)
    count, width = len(query_lens), host.width
    padded_on_host = count * width <= 2 * host.flat_blocks.size
    fields = [host.lens, host.computed, host.starts, host.positions, host.slots]
    if padded_on_host:
        table = np.full(count * width, kv_cache.num_blocks, dtype=np.int64)  # the pool's spare block
        table[host.table_index] = host.flat_blocks
        fields.append(table)
    else:
        fields += [host.flat_blocks, host.table_index]
    program_width = 0 if host.program_seq is None else _program_width(host.program_seq.size)
    packed, offsets = _pack(fields, program_width)
    if program_width:
        _write_program_map(packed, program_width, host)
    sent = to_device(torch.from_numpy(packed), torch.long, device)
    lens_t, computed_t, starts_t, positions_t, slots_t, *blocks = (
        sent[offset:offset + field.size] for field, offset in zip(fields, offsets))
    if padded_on_host:
        tables = blocks[0]
    else:  # the pool's spare block past each sequence's own
        tables = torch.full((count * width,), kv_cache.num_blocks, dtype=torch.long, device=device)
        tables = tables.scatter_(0, blocks[1], blocks[0])
    programs = (sent[:program_width].view(torch.int32).view(2, program_width)[:, :host.program_seq.size]
                if program_width else None)
    return StepIndex(lens_t, computed_t, starts_t, tables.view(count, width), positions_t, slots_t, programs)


class MixedGraphIndex:
    """A step's index at fixed device addresses, for graphs that hold the attention too
    (``PiecewiseGraphs.attend_in_graphs``): sequences' lengths, cached tokens and first rows, each token's
    position and slot, the program map of query tiles of ``query_tile`` tokens, and the block tables, for
    steps of up to ``max_tokens`` tokens (so up to as many sequences). A graph captured over them replays any
    such step once ``stage`` has rewritten them.

    What stays fixed for a graph: the tables are ``[max_tokens + 1, max_blocks]`` (each sequence's row keeps
    what earlier steps left past its own blocks, never read: a query reads only keys up to its position), and
    a bucket of ``size`` tokens launches ``programs_for(size)`` programs, enough for any step of that many
    tokens; those past the step's own point at the last sequence row, ``padding_seq``, of no tokens and no
    context, which attend nothing and write nothing."""

    def __init__(self, max_tokens: int, max_blocks: int, block_size: int, query_tile: int, device: torch.device,
                 spare_block: int):
        """``spare_block``: the pool's padding block, whose first slot the padding rows' keys go to where they
        are written (a pool of another dtype has the whole bucket written before the attention)."""
        self.max_tokens, self.block_size, self.query_tile = max_tokens, block_size, query_tile
        self.spare_slot = spare_block * block_size
        self.padding_seq = max_tokens
        self.program_width = _program_width(self.programs_for(max_tokens))
        seq_rows = max_tokens + 1
        self.capacities = [seq_rows, seq_rows, seq_rows, max_tokens, max_tokens]
        _, offsets = _pack([], self.program_width, self.capacities)
        self.fixed_words, self.slots_at = int(offsets[-1]), int(offsets[4])
        self.buffer = torch.zeros(self.fixed_words, dtype=torch.long, device=device)
        self.tables = torch.zeros((seq_rows, max_blocks), dtype=torch.long, device=device)
        self.query_lens, self.num_computed, self.query_starts, self.positions, self.slot_mapping = (
            self.buffer[int(offset):int(offset) + n] for offset, n in zip(offsets, self.capacities))
        self.slot_mapping.fill_(self.spare_slot)
        self.programs = self.buffer[:self.program_width].view(torch.int32).view(2, self.program_width)
        self.programs[0].fill_(self.padding_seq)

    @staticmethod
    def nbytes_at_most(max_tokens: int, max_blocks: int) -> int:
        """What the buffers of an index of ``max_tokens`` and ``max_blocks`` take on the device, or a little more
        (a pool sized before it exists leaves this much)."""
        return 8 * ((max_tokens + 1) * max_blocks + 8 * (max_tokens + 1) + 16)

    def programs_for(self, size: int) -> int:
        """The programs a bucket of ``size`` tokens launches: its sequences' query tiles are at most one per
        ``query_tile`` tokens plus one per sequence."""
        return -(-size // self.query_tile) + size

    def stage(self, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]]) -> None:
        """Rewrite the index for a step (of at most ``max_tokens`` tokens): one copy from the host, its fixed
        part copied into place and its blocks scattered into their sequences' rows of ``tables``."""
        host = host_index(query_lens, num_computed, block_tables, self.block_size, self.query_tile,
                          width=self.tables.shape[1])
        fields = [host.lens, host.computed, host.starts, host.positions, host.slots]
        packed, _ = _pack(fields, self.program_width, self.capacities)
        packed[self.slots_at + host.slots.size:self.slots_at + self.max_tokens] = self.spare_slot
        _write_program_map(packed, self.program_width, host, padding_seq=self.padding_seq)
        sent = to_device(torch.from_numpy(np.concatenate((packed, host.flat_blocks, host.table_index))),
                         torch.long, self.buffer.device)
        blocks = host.flat_blocks.size
        self.buffer.copy_(sent[:self.fixed_words])
        self.tables.view(-1).index_copy_(0, sent[self.fixed_words + blocks:], sent[self.fixed_words:][:blocks])


def group_token_index(index: StepIndex, members: list[int], query_lens: list[int],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``members`` (sequence numbers, in the group's order) as a tensor, and the rows of the flat token
    batch that belong to them, in that order; None for the rows when they are every row, in order."""
    members_t = to_device(members, torch.long, device)
    if members == list(range(len(query_lens))):
        return members_t, None
    lens = index.query_lens[members_t]
    group_tokens = sum(query_lens[i] for i in members)
    rows = (torch.arange(group_tokens, device=device)
            + torch.repeat_interleave(index.query_starts[members_t] - exclusive_cumsum(lens), lens,
                                      output_size=group_tokens))
    return members_t, rows


class AttentionBackend(ABC):
    """Paged attention for one model: ``build_metadata`` per step, ``forward`` per layer."""

    name: ClassVar[str]
    # Whether build_metadata gives decode-only steps (and with ``prompt_rows`` steps with prompts) as
    # ``AttentionMetadata.kernel_rows``, over a pool whose float32 and float16 blocks are torch's layout.
    gives_kernel_rows: ClassVar[bool] = False

    def __init__(self, sliding_windows: list[int | None] | tuple[int | None, ...] = (), *,
                 prompt_rows: bool = False, softcaps: list[float | None] | tuple[float | None, ...] = (),
                 sinks: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...] = ()):
        """``sliding_windows[layer]``: that layer's window in tokens, None for full attention (layers not
        listed attend fully). ``prompt_rows``: give steps with prompts as kernel rows too, every token a row
        of its own, where the backend can (``gives_kernel_rows``): for a native layer that takes steps of
        any size; the torch layers would gain nothing. ``softcaps[layer]``: that layer's soft cap of the
        scaled scores, None for none; ``sinks[layer]``: its ``[Hq]`` sink logits (this rank's query heads, on
        the device), None for none (layers not listed have neither)."""
        self.prompt_rows = prompt_rows
        windows = list(dict.fromkeys(sliding_windows)) or [None]
        self.windows: tuple[int | None, ...] = tuple(windows)
        self.window_of_layer: tuple[int, ...] = tuple(windows.index(w) for w in sliding_windows)
        if any(cap is not None and not cap > 0 for cap in softcaps):
            raise ValueError(f"attention soft caps must be positive, not {list(softcaps)}")
        self.softcaps: tuple[float | None, ...] = tuple(None if cap is None else float(cap) for cap in softcaps)
        self.sinks: tuple[torch.Tensor | None, ...] = tuple(
            None if s is None else s.detach().to(torch.float32).contiguous() for s in sinks)

    def window_index(self, layer: int) -> int:
        """Which of ``windows`` the layer attends with."""
        return self.window_of_layer[layer] if len(self.windows) > 1 else 0

    def layer_softcap(self, layer: int) -> float | None:
        """The layer's soft cap of its scaled scores (``cap * tanh(score / cap)``), None for none."""
        return self.softcaps[layer] if layer < len(self.softcaps) else None

    def layer_sinks(self, layer: int) -> torch.Tensor | None:
        """The layer's float32 ``[Hq]`` sink logits, None for none."""
        return self.sinks[layer] if layer < len(self.sinks) else None

    @property
    def shapes_scores(self) -> bool:
        """Whether any layer caps its scores or has sinks."""
        return any(cap is not None for cap in self.softcaps) or any(s is not None for s in self.sinks)

    @classmethod
    def available(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device`` here (its kernels built, its library installed)."""
        return True

    @abstractmethod
    def build_metadata(self, *, query_lens: list[int], num_computed: list[int], block_tables: list[list[int]],
                       kv_cache: PagedKVCache, device: torch.device,
                       key_limits: list[int] | None = None) -> AttentionMetadata:
        """Index tensors for one step: sequence ``i`` brings ``query_lens[i]`` new tokens after
        ``num_computed[i]`` cached ones, in the blocks ``block_tables[i]``; the flat token batch holds the
        sequences' tokens one after the other, in this order.

        ``key_limits`` (None: every token is causal): per token of the flat batch, the last position of its
        sequence it attends; its own position for a causal token, the image's last placeholder for an image's
        (Gemma 3's placeholders attend their whole image both ways, transformers' ``blockwise_overlay``). A
        limit past a token's own position is a position of the same step (the scheduler computes such an image in
        one step: ``vision.image_key_limits``), and a sliding window still starts from the token's own position."""

    def decode_graph_metadata(self, inputs: DecodeGraphInputs, batch: int) -> AttentionMetadata | None:
        """Metadata of a decode step of ``batch`` rows (one new token each, every row sampled) that reads
        only ``inputs``' first ``batch`` rows and constants the metadata holds, so a CUDA graph captured over
        it replays any such step once ``inputs`` are rewritten. None (the default): this backend's steps
        take host-side shapes from their contexts and are not captured."""
        return None

    def mixed_graph_index(self, max_tokens: int, max_blocks: int, kv_cache: PagedKVCache) -> MixedGraphIndex | None:
        """The fixed-address index of steps of up to ``max_tokens`` tokens of any kind (``MixedGraphIndex``),
        over ``kv_cache``, for which a graph may hold this backend's attention (``mixed_graph_metadata``); None
        (the default):
        its launches take host-side shapes from the step, and steps with prompt rows launch it eagerly."""
        return None

    def mixed_graph_metadata(self, index: MixedGraphIndex, size: int) -> AttentionMetadata:
        """Metadata of any step of up to ``size`` tokens staged into ``index`` (``MixedGraphIndex.stage``), its
        tokens padded to ``size``, reading only ``index``'s buffers and constants of ``size``."""
        raise NotImplementedError(f"the {self.name} backend gives no mixed graph index")

    @abstractmethod
    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` of the step's new tokens -> ``[T, Hq, D]``,
        with ``key``/``value`` written into ``meta.slot_mapping`` of ``layer`` (the step's queries attend
        them). ``out`` as ``forward_rotary``'s (``into``)."""

    def forward_rotary(self, layer: int, qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                       signed_sin: torch.Tensor, num_heads: int, kv_cache: PagedKVCache, meta: AttentionMetadata,
                       scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` on queries and keys before RoPE: ``qk [T, num_heads + Hkv, D]`` (the queries, then the
        keys), rotated by ``cos``/``signed_sin`` (``RotaryEmbedding.cos_sin``). Here: side by side in one
        rotary application (``gpu_ops.apply_rotary``), then ``forward``; a backend that writes the keys
        itself may rotate them on the way. ``out`` (``[T, num_heads, D]``, the queries' dtype): where the
        heads go, and what is returned (a piecewise step's parts read them there); a backend whose kernel
        can write there saves a copy."""
        qk = apply_rotary(qk, cos, signed_sin)
        return self.forward(layer, qk[:, :num_heads], qk[:, num_heads:], value, kv_cache, meta, scale, out)


def into(out: torch.Tensor | None, heads: torch.Tensor) -> torch.Tensor:
    """``heads``, copied into ``out`` where one is given (``AttentionBackend.forward``'s ``out``)."""
    return heads if out is None else out.copy_(heads)
