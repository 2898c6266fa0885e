"""``step_index``: a step's block tables, positions and KV slots, computed on the host and sent in one copy (the
padded table in it where it is no larger than the blocks and their places, else filled from those on the
device). Checked against a per-token loop over the same lists, for any mix of prompt chunks and decodes, and
each field starting on a 16-byte boundary (Triton compiles a kernel again for each alignment of its pointers)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.workers.attention.base import MixedGraphIndex, step_index

BLOCK_SIZE = 4
SPARE = 1000


@st.composite
def steps(draw):
    """(query lens, tokens already computed, block tables) of 1-12 sequences, each table holding exactly the
    blocks its tokens need, from one pool, in any order."""
    n = draw(st.integers(1, 12))
    lens = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    computed = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    needed = [-(-(q + c) // BLOCK_SIZE) for q, c in zip(lens, computed)]
    pool = draw(st.permutations(range(sum(needed))))
    tables, at = [], 0
    for k in needed:
        tables.append(list(pool[at:at + k]))
        at += k
    return lens, computed, tables


@settings(max_examples=200, deadline=None)
@given(steps(), st.sampled_from([None, 1, 2, 4, 8, 16]))
def test_matches_a_per_token_loop(step, query_tile):
    """With a query tile, also the program map: for each tile of that many query tokens of each sequence,
    its sequence and first row, int32 rows in the same copy."""
    lens, computed, tables = step
    index = step_index(lens, computed, tables, SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=SPARE),
                       torch.device("cpu"), query_tile=query_tile)
    width = max(map(len, tables))
    positions, slots, starts = [], [], []
    for q, c, table in zip(lens, computed, tables):
        starts.append(len(positions))
        for position in range(c, c + q):
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    assert index.query_lens.tolist() == lens and index.num_computed.tolist() == computed
    assert index.query_starts.tolist() == starts
    assert index.tables.tolist() == [table + [SPARE] * (width - len(table)) for table in tables]
    assert index.positions.tolist() == positions and index.slot_mapping.tolist() == slots
    sent = (index.query_lens, index.num_computed, index.query_starts, index.positions, index.slot_mapping)
    assert all(f.dtype == torch.long and f.data_ptr() % 16 == 0 for f in (*sent, index.tables))
    if query_tile is None:
        assert index.programs is None
    else:
        tiles = [(seq, first) for seq, (q, start) in enumerate(zip(lens, starts))
                 for first in range(start, start + q, query_tile)]
        assert index.programs.dtype == torch.int32 and index.programs.tolist() == [list(t) for t in zip(*tiles)]
        assert all(row.data_ptr() % 16 == 0 for row in index.programs)
        sent += (index.programs,)
    assert len({f.untyped_storage().data_ptr() for f in sent}) == 1, "one copy, every field a view of it"


def test_a_table_of_similar_contexts_goes_over_padded_and_a_skewed_one_is_padded_on_the_device():
    pool = SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=SPARE)
    similar = step_index([1, 1, 3], [8, 9, 5], [[0, 1, 2], [3, 4, 5], [6, 7]], pool, torch.device("cpu"))
    skewed = step_index([1, 1, 1], [79, 0, 0], [list(range(20)), [20], [21]], pool, torch.device("cpu"))
    assert similar.tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, SPARE]]
    assert skewed.tables.tolist()[1:] == [[20] + [SPARE] * 19, [21] + [SPARE] * 19]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert storage(similar.tables) == storage(similar.positions)  # in the one copy
    assert storage(skewed.tables) != storage(skewed.positions)  # 3 x 20 places for 22 blocks: made there


@settings(max_examples=100, deadline=None)
@given(st.lists(steps(), min_size=2, max_size=3))
def test_a_mixed_graph_index_holds_each_step_where_the_graphs_read_it(series):
    """``MixedGraphIndex.stage``, steps one after another into the same buffers: each step's fields and tables
    as ``step_index`` gives them, every program past the step's own on the padding sequence (no tokens, no
    context: it attends nothing) and every padding row's slot in the spare block, whatever an earlier, larger step
    left; the buffers never move."""
    max_tokens, max_blocks, tile = 256, 16, 4
    index = MixedGraphIndex(max_tokens, max_blocks, BLOCK_SIZE, tile, torch.device("cpu"), SPARE)
    addresses = [t.data_ptr() for t in (index.buffer, index.tables, index.programs, index.positions)]
    # what the pool's sizing leaves for it (--full-graphs), at least what it takes
    assert index.buffer.nbytes + index.tables.nbytes <= MixedGraphIndex.nbytes_at_most(max_tokens, max_blocks)
    pool = SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=SPARE)
    for lens, computed, tables in series:
        index.stage(lens, computed, tables)
        expected = step_index(lens, computed, tables, pool, torch.device("cpu"), query_tile=tile)
        n, t, p = len(lens), sum(lens), expected.programs.shape[1]
        assert index.query_lens[:n].tolist() == lens and index.num_computed[:n].tolist() == computed
        assert index.query_starts[:n].tolist() == expected.query_starts.tolist()
        assert index.positions[:t].tolist() == expected.positions.tolist()
        assert index.slot_mapping[:t].tolist() == expected.slot_mapping.tolist()
        assert set(index.slot_mapping[t:].tolist()) <= {SPARE * BLOCK_SIZE}  # padding rows: the spare block
        assert [row[:len(table)] for row, table in zip(index.tables.tolist(), tables)] == tables
        assert index.programs[:, :p].tolist() == expected.programs.tolist()
        assert p <= index.programs_for(t)
        assert set(index.programs[0, p:].tolist()) == {index.padding_seq}
        padding = index.padding_seq
        assert (index.query_lens[padding], index.num_computed[padding], index.query_starts[padding]) == (0, 0, 0)
        assert [t.data_ptr() for t in (index.buffer, index.tables, index.programs, index.positions)] == addresses
    assert all(f.data_ptr() % 16 == 0 for f in (index.query_lens, index.num_computed, index.query_starts,
                                                 index.positions, index.slot_mapping, *index.programs))
