"""Which live blocks a compaction moves, and where: pure Python (the pool applies the moves)."""

from __future__ import annotations

from hf_pagedkv.pool.block_allocator import BlockAllocator


def plan_moves(allocator: BlockAllocator, max_blocks: int) -> dict[int, int]:
    """Up to `max_blocks` moves ``src -> dst`` that pack live blocks (in use or cached-idle) towards id 0: the
    highest live block goes to the lowest free id below it, then the next, until no free id lies below a live one::

        before:  [ 0 live | 1 free | 2 live | 3 free | 4 live | 5 live ]
        moves:   5 -> 1, 4 -> 3
        after:   [ 0 | 1 | 2 | 3 live | 4 free | 5 free ]      the tail is free: `BlockPool.shrink` can return it

    Returns:
        `dict[int, int]`: live block -> free block, at most `max_blocks` entries (empty when already packed).
    """
    free_set = allocator.free_blocks()
    free = sorted(free_set)
    live = [b for b in range(allocator.num_blocks - 1, -1, -1) if b not in free_set] if free else []
    moves: dict[int, int] = {}
    for src, dst in zip(live, free):
        if dst > src or len(moves) >= max_blocks:
            break
        moves[src] = dst
    return moves


def num_trapped_free(allocator: BlockAllocator) -> int:
    """Free blocks below the highest live one: storage that `shrink` cannot return until a compaction."""
    free = allocator.free_blocks()
    top = next((b for b in range(allocator.num_blocks - 1, -1, -1) if b not in free), -1)
    return sum(1 for b in free if b < top)
