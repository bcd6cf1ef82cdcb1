"""Story-style tests of `BlockAllocator`: exact block ids, refcounts and the order freed blocks come back.

Pure Python, no tensors: each test is a short story whose steps are commented.
"""

import pytest

from hf_pagedkv.blocks.block_allocator import BlockAllocator

pytestmark = pytest.mark.bookkeeping


def refcounts(alloc: BlockAllocator) -> list[int]:
    return [alloc.refcount(b) for b in range(alloc.num_blocks)]


def test_story_two_sequences_share_then_free():
    alloc = BlockAllocator()
    # An empty allocator knows no block and can hand out nothing.
    assert (alloc.num_blocks, alloc.num_free_blocks, alloc.num_used_blocks) == (0, 0, 0)
    assert alloc.can_allocate(0) and not alloc.can_allocate(1)
    assert alloc.allocate(1) is None

    # The pool grows by 8 blocks: ids 0..7, all free.
    alloc.add_blocks(8)
    assert alloc.free_blocks() == set(range(8))
    assert refcounts(alloc) == [0] * 8

    # Sequence A prefills 3 blocks: it gets the lowest ids, in order, each with refcount 1.
    a = alloc.allocate(3)
    assert a == [0, 1, 2]
    assert refcounts(alloc) == [1, 1, 1, 0, 0, 0, 0, 0]

    # Sequence B prefills 2 blocks: the next lowest ids.
    b = alloc.allocate(2)
    assert b == [3, 4]

    # A forks into A' (beam search): A' names A's blocks, so each gets a second reference; nothing is allocated.
    alloc.incref(a)
    assert refcounts(alloc) == [2, 2, 2, 1, 1, 0, 0, 0]
    assert alloc.num_used_blocks == 5 and alloc.num_free_blocks == 3

    # A' writes into its (shared) last block: copy-on-write takes a fresh block and drops one reference of block 2.
    a_copy = alloc.allocate(1, after=1)  # 2 is in use, so the lowest free id is used
    assert a_copy == [5]
    assert alloc.decref([2]) == []  # A still holds block 2: nothing becomes free
    assert refcounts(alloc) == [2, 2, 1, 1, 1, 1, 0, 0]

    # A finishes: blocks 0 and 1 keep A's reference, block 2 becomes free. Freed blocks are reported in order.
    assert alloc.decref([0, 1, 2]) == [2]
    assert refcounts(alloc) == [1, 1, 0, 1, 1, 1, 0, 0]
    assert alloc.free_blocks() == {2, 6, 7}

    # B finishes, freeing its blocks in table order.
    assert alloc.decref(b) == [3, 4]
    # A' finishes last: every block is free again (no leak).
    assert alloc.decref([0, 1, 5]) == [0, 1, 5]
    assert alloc.num_used_blocks == 0 and alloc.free_blocks() == set(range(8))
    assert refcounts(alloc) == [0] * 8


def test_story_freed_blocks_come_back_lowest_first_unless_the_next_id_is_free():
    alloc = BlockAllocator()
    alloc.add_blocks(10)
    # Three sequences of 3, 2 and 3 blocks fill ids 0..7.
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    assert alloc.allocate(3) == [5, 6, 7]

    # The middle sequence is released; then block 1 of the first one (a crop that frees a middle block is
    # impossible, but the allocator does not care which block it is).
    assert alloc.decref([3, 4]) == [3, 4]
    assert alloc.decref([1]) == [1]
    assert alloc.free_blocks() == {1, 3, 4, 8, 9}

    # A new sequence of 2 blocks with no predecessor gets the lowest free ids, 1 then 3 (not consecutive).
    assert alloc.allocate(2) == [1, 3]

    # Sequence ending in block 7 grows by 2: ids right after 7 (8, 9) are preferred over the lower free id 4,
    # so the row stays contiguous and can be read as a view.
    assert alloc.allocate(2, after=7) == [8, 9]

    # Growing after block 9 (no id 10 exists) falls back to the lowest free id.
    assert alloc.allocate(1, after=9) == [4]
    assert alloc.num_free_blocks == 0
    assert refcounts(alloc) == [1] * 10

    # "Ask, then do": a request larger than the free set returns None and changes nothing.
    before = (refcounts(alloc), alloc.free_blocks())
    assert not alloc.can_allocate(1)
    assert alloc.allocate(1) is None
    assert (refcounts(alloc), alloc.free_blocks()) == before


def test_allocate_prefers_the_run_after_a_block_while_it_is_free():
    alloc = BlockAllocator()
    alloc.add_blocks(6)
    assert alloc.allocate(1) == [0]
    assert alloc.allocate(1) == [1]
    alloc.decref([0])  # free: {0, 2, 3, 4, 5}
    # After block 1: 2, 3 are consecutive and free; the run continues from the last handed-out id.
    assert alloc.allocate(3, after=1) == [2, 3, 4]
    # After block 4: 5 is free, then the run breaks and the lowest free id (0) follows.
    assert alloc.allocate(2, after=4) == [5, 0]
    assert alloc.num_free_blocks == 0


def test_growth_adds_free_ids_after_the_existing_ones():
    alloc = BlockAllocator()
    alloc.add_blocks(2)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(1) is None  # full
    alloc.add_blocks(3)  # the pool grew
    assert alloc.num_blocks == 5 and alloc.free_blocks() == {2, 3, 4}
    assert alloc.allocate(1, after=1) == [2]
    assert alloc.allocate(2) == [3, 4]


def test_can_allocate_has_no_side_effects():
    alloc = BlockAllocator()
    alloc.add_blocks(4)
    for n in range(6):
        assert alloc.can_allocate(n) == (n <= 4)
    assert alloc.free_blocks() == set(range(4)) and refcounts(alloc) == [0] * 4


def test_heap_compaction_keeps_lowest_first_order():
    # Many allocate/free cycles leave stale entries in the internal heap; handing out must stay lowest-first.
    alloc = BlockAllocator()
    alloc.add_blocks(200)
    held = alloc.allocate(200)
    assert held == list(range(200))
    for _ in range(3):
        alloc.decref(held[::2])  # free the even ids
        assert alloc.allocate(100) == list(range(0, 200, 2))
    alloc.decref(list(range(200)))
    assert alloc.allocate(5) == [0, 1, 2, 3, 4]


def test_double_free_and_incref_of_a_free_block_are_caught():
    alloc = BlockAllocator()
    alloc.add_blocks(2)
    (b,) = alloc.allocate(1)
    assert alloc.decref([b]) == [b]
    with pytest.raises(AssertionError, match="double free"):
        alloc.decref([b])
    with pytest.raises(AssertionError, match="incref of free block"):
        alloc.incref([b])
    assert alloc.free_blocks() == {0, 1} and refcounts(alloc) == [0, 0]
