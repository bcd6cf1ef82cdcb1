"""Which live blocks a compaction moves, and where: pure Python (the pool applies the moves)."""

from __future__ import annotations

import bisect
from typing import Sequence

from hf_pagedkv.blocks.block_allocator import BlockAllocator


def plan_moves(allocator: BlockAllocator, max_blocks: int, rows: Sequence[Sequence[int]] = (),
               segment_blocks: Sequence[int] = ()) -> dict[int, int]:
    """Up to `max_blocks` moves ``src -> dst`` of live blocks to free ids, in two passes:

    1. **Rows** (each a block table's held blocks, in token order), highest first: a row moves whole to the lowest
       place where its blocks become consecutive ids inside one storage segment (what lets a single-row cache read
       a view instead of a gather), when that place lies lower than the row's highest block and every block
       moves down. Its own blocks that already sit where they belong stay; the others go to free ids. A scattered
       row moves as many blocks as the budget allows (a later call goes on); a consecutive one moves whole or
       waits (unless it is longer than `max_blocks`: then it goes in parts). A scattered row whose blocks no
       other row shares may also move up, whole in one call, when no lower place exists (blocks taken turns
       about, say). A row that shares a block with a row already moving waits for a later call; a scattered row
       with no place at all has its blocks packed as in pass 2.
    2. **Blocks no row names** (cached-idle prefix blocks), highest first, to the lowest free id below them::

        before:  [ 0 row A | 1 free | 2 free | 3 row A | 4 idle | 5 free ]
        moves:   3 -> 1 (row A becomes 0, 1: consecutive), 4 -> 2
        after:   [ 0 A | 1 A | 2 idle | 3 free | 4 free | 5 free ]   the tail is free: `BlockPool.shrink` returns it

    Repeated calls end: a move up makes an exclusive scattered row of at most `max_blocks` blocks consecutive for
    good (such rows, once consecutive, move whole, and no other row's move touches their blocks), and every other
    move goes down (the sum of live ids falls). Beams that share blocks but not their last ones cannot all be
    consecutive; they stay as they are once no move goes down. A destination is always free when planned and
    never a source (sources are live), so the moves can be applied at once.

    Args:
        segment_blocks: the blocks of each storage segment in id order (`PageStore.segment_blocks`); empty for one
            segment.

    Returns:
        `dict[int, int]`: live block -> free block, at most `max_blocks` entries (empty when nothing would gain).
    """
    free = allocator.free_blocks()
    if not free:
        return {}
    seg_start = [0]  # first block id of each segment
    for n in segment_blocks:
        seg_start.append(seg_start[-1] + n)
    moves: dict[int, int] = {}

    def segment_of(b: int) -> int:
        return bisect.bisect_right(seg_start, b) - 1

    def fits(ids: Sequence[int], start: int, up: bool) -> int | None:
        """Moves needed to put `ids` at ``start ..`` (None: a target is taken, crosses a segment, or, unless `up`,
        lies above the block it would take)."""
        end = start + len(ids) - 1
        if end >= allocator.num_blocks or (len(seg_start) > 1 and segment_of(start) != segment_of(end)):
            return None
        need = 0
        for k, b in enumerate(ids):
            target = start + k
            if target != b:
                if target not in free or (target > b and not up):
                    return None
                need += 1
        return need

    loose_rows: list[int] = []  # blocks of scattered rows with no place: packed one by one below
    named: set[int] = set()
    for ids in rows:
        named.update(ids)
    for ids in sorted((r for r in rows if r), key=max, reverse=True):
        if any(b in moves for b in ids):
            continue  # shares a block with a row already moving
        budget = max_blocks - len(moves)
        consecutive = fits(ids, ids[0], False) == 0
        exclusive = all(allocator.refcount(b) == 1 for b in ids)  # no other row names its blocks
        top = max(ids)
        best = None
        for start in sorted({ids[0], *(b for b in free if b < top)}):
            if start + len(ids) - 1 > top:
                break  # would not lie lower
            need = fits(ids, start, False)
            if need is not None and (not consecutive or need <= budget or len(ids) > max_blocks):
                best = (start, need)
                break
        if best is None and not consecutive and exclusive and len(ids) <= max_blocks:  # anywhere, whole, now
            best = next(((start, need) for start in sorted(free) if (need := fits(ids, start, True)) is not None
                         and need <= budget), None)
        if best is None:
            if not consecutive:
                loose_rows.extend(ids)  # scattered and nowhere to put it: at least pack its blocks
            continue
        for k, b in enumerate(ids):  # the first `budget` blocks now, the rest in later calls
            target = best[0] + k
            if target != b and budget > 0:
                moves[b] = target
                free.discard(target)
                budget -= 1
        if len(moves) >= max_blocks:
            return moves
    named.difference_update(loose_rows)
    planned = set(moves.values())  # destinations of the row moves: live after this call, not loose
    loose = [b for b in range(allocator.num_blocks - 1, -1, -1)
             if b not in named and b not in free and b not in moves and b not in planned]
    targets = sorted(free)
    for src, dst in zip(loose, targets):
        if dst > src or len(moves) >= max_blocks:
            break
        moves[src] = dst
    return moves


def num_trapped_free(allocator: BlockAllocator) -> int:
    """Free blocks below the highest live one: storage that `shrink` cannot return until a compaction."""
    free = allocator.free_blocks()
    top = next((b for b in range(allocator.num_blocks - 1, -1, -1) if b not in free), -1)
    return sum(1 for b in free if b < top)
