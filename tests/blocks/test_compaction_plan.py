"""`plan_moves`: the compaction planner alone, on a `BlockAllocator` (pure Python, no tensors). What a pool does
with the plan (moving storage, renaming tables) is tested in tests/pool/test_compaction.py."""

import random

import pytest

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.compaction import num_trapped_free, plan_moves

pytestmark = pytest.mark.bookkeeping


def test_plan_moves_packs_the_highest_live_blocks_into_the_lowest_holes():
    alloc = BlockAllocator()
    alloc.add_blocks(6)
    assert alloc.allocate(6) == [0, 1, 2, 3, 4, 5]
    alloc.decref([1, 3])  # [ 0 live | 1 free | 2 live | 3 free | 4 live | 5 live ]
    assert num_trapped_free(alloc) == 2
    assert plan_moves(alloc, 10) == {5: 1, 4: 3}
    assert plan_moves(alloc, 1) == {5: 1}  # bounded
    for s, d in plan_moves(alloc, 10).items():
        alloc.move(s, d)
    assert alloc.free_blocks() == {4, 5} and num_trapped_free(alloc) == 0 and plan_moves(alloc, 10) == {}
    assert [alloc.refcount(b) for b in range(6)] == [1, 1, 1, 1, 0, 0]


def test_plan_moves_makes_rows_consecutive_in_one_segment_before_packing_loose_blocks():
    alloc = BlockAllocator()
    alloc.add_blocks(8)
    assert alloc.allocate(8) == list(range(8))
    alloc.decref([1, 2, 5, 6])  # [ 0 A | 1 free | 2 free | 3 A | 4 idle | 5 free | 6 free | 7 B ]
    rows = [[0, 3], [7]]
    moves = plan_moves(alloc, 10, rows, segment_blocks=[4, 4])
    # highest row first: B down to the lowest hole, 1; A has no place reached by moves down, but no other row shares
    # its blocks: it moves whole, 0 up to 2 (3 stays); the loose 4 has no hole below it left
    assert moves == {7: 1, 0: 2}
    assert plan_moves(alloc, 1, rows, [4, 4]) == {7: 1}  # bounded: A's move would be one more than the budget
    # without B as a row, 7 is loose: A takes 0, 1 (its 0 stays), then 7 packs into the lowest hole left
    assert plan_moves(alloc, 10, [[0, 3]], segment_blocks=[2, 6]) == {3: 1, 7: 2}
    # a row never moves to a place that crosses a segment: with segments [2, 6], [3, 4] cannot go to 1, 2
    assert plan_moves(alloc, 10, [[3, 4]], segment_blocks=[2, 6]) == {7: 1}  # it stays; the loose 7 packs
    assert plan_moves(alloc, 10, [[3, 4]]) == {3: 1, 4: 2, 7: 5}  # one segment: it moves to 1, 2
    for s, d in moves.items():
        alloc.move(s, d)
    assert plan_moves(alloc, 10, [[2, 3], [1]], [4, 4]) == {1: 0}  # A stays; B packs down


@pytest.mark.parametrize("seed", range(40))
def test_repeated_compaction_plans_are_valid_and_end(seed):
    """Seeded fuzz of the planner alone: random live blocks, rows (some sharing blocks, as beams do), segments and
    budgets. Every plan moves live blocks to free ones, no destination is a source, and calling again until the
    plan is empty ends well within a bound."""
    rnd = random.Random(seed)
    n = rnd.randint(4, 40)
    alloc = BlockAllocator()
    alloc.add_blocks(n)
    alloc.allocate(n)
    live = set(rnd.sample(range(n), rnd.randint(1, n)))
    alloc.decref([b for b in range(n) if b not in live])
    rows, pool_live = [], sorted(live)
    while pool_live and rnd.random() < 0.8:
        row = rnd.sample(pool_live, rnd.randint(1, min(6, len(pool_live))))
        if rows and rnd.random() < 0.3:  # a beam: shares a prefix of an earlier row
            base = rnd.choice(rows)
            row = base[: rnd.randint(1, len(base))] + [b for b in row if b not in base]
        rows.append(row)
        for b in row:
            pool_live.remove(b) if b in pool_live and rnd.random() < 0.7 else None
    for row in rows:  # refcount = table entries (+1 for blocks no row names: cached-idle stand-ins)
        for b in row:
            alloc.incref([b])
    for b in live:
        if any(b in row for row in rows):
            alloc.decref([b])
    segments, left = [], n
    while left:
        segments.append(rnd.randint(1, left))
        left -= segments[-1]
    max_blocks = rnd.randint(1, 8)
    for _ in range(4 * n + 10):
        moves = plan_moves(alloc, max_blocks, rows, segments)
        if not moves:
            break
        free = alloc.free_blocks()
        assert len(moves) <= max_blocks and all(d in free and s not in free for s, d in moves.items())
        assert not set(moves) & set(moves.values())
        for s, d in moves.items():
            alloc.move(s, d)
        rows = [[moves.get(b, b) for b in row] for row in rows]
    else:
        pytest.fail("compaction did not end")
