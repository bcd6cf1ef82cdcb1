"""`BlockAllocator`: block ids, refcounts and the free queue of one pool. Pure Python, no tensors."""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable


class BlockAllocator:
    """Hands out block ids and counts who uses them (the bookkeeping half of `BlockPool`).

    Every id in ``range(num_blocks)`` is in exactly one state:

    - **free**: refcount 0, in the free set, may be handed out;
    - **in use**: refcount >= 1, named by that many live block-table entries;
    - **cached-idle**: refcount 0 but kept out of the free set because the prefix index still names it
      (`decref(..., keep=index)`); it returns to use by `revive` or to the free set by `add_free` (eviction).

    Invariants (checked by `BlockPool.check_invariants`): the free set names no block in use; a block with
    refcount 0 is free or cached-idle, never both; `refcount[b]` equals the number of live block-table entries
    naming `b`.

    Allocation is "ask, then do": `can_allocate` has no side effects, and `allocate` either hands out all the
    blocks asked for or returns `None` without changing anything. It prefers the id right after `after` (the
    last block of the row being extended) and otherwise the lowest free id, so a row usually gets consecutive
    ids, which `PageStore` can read as a view instead of a gather.
    """

    def __init__(self) -> None:
        self._refcount: list[int] = []  # refcount[b]: live block-table entries naming b; changed here only
        self._free: set[int] = set()  # the free blocks (the truth); changed here only
        self._free_heap: list[int] = []  # min-heap index over _free; may hold stale ids, skipped on pop
        self._num_idle = 0  # blocks with refcount 0 kept out of _free (cached-idle); changed here only
        self._fill: list[int] = []  # fill[b]: leading slots of b written (kept while idle, 0 once free)
        self.num_filled_slots = 0  # sum of fill over blocks in use; changed here only (O(1) per change)

    @property
    def num_blocks(self) -> int:
        """Blocks this allocator knows about (free + in use)."""
        return len(self._refcount)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount >= 1."""
        return len(self._refcount) - len(self._free) - self._num_idle

    @property
    def num_idle_blocks(self) -> int:
        """Blocks with refcount 0 that are not free (cached-idle)."""
        return self._num_idle

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def add_blocks(self, n: int) -> None:
        """Append `n` new free block ids (the pool grew)."""
        start = len(self._refcount)
        self._refcount.extend([0] * n)
        self._fill.extend([0] * n)
        self._free.update(range(start, start + n))
        for b in range(start, start + n):  # already ascending, so this keeps the heap property
            self._free_heap.append(b)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """Take `n` free blocks, each with refcount 1, or return `None` (nothing changed) if fewer are free.

        Args:
            n (`int`): number of blocks.
            after (`int`, *optional*): the block the new ones follow in a block table; `after + 1`,
                `after + 2`, ... are preferred while free.
        """
        if n > len(self._free):
            return None
        out: list[int] = []
        prev = after
        for _ in range(n):
            b = prev + 1 if prev is not None and prev + 1 in self._free else self._pop_lowest()
            self._free.remove(b)
            self._refcount[b] = 1
            out.append(b)
            prev = b
        if len(self._free_heap) > 2 * len(self._free) + 64:  # drop stale heap entries now and then
            self._free_heap = sorted(self._free)
        return out

    def free_run(self, length: int, ranges: Iterable[tuple[int, int]]) -> int | None:
        """The lowest id `s` that starts `length` consecutive free ids ``s .. s + length - 1`` inside one of
        `ranges` (`(lo, hi)` id ranges, e.g. the pool's storage segments), or `None`. No side effects."""
        for lo, hi in ranges:
            run, prev = 0, None
            for b in sorted(b for b in self._free if lo <= b < hi):
                run = run + 1 if prev is not None and b == prev + 1 else 1
                prev = b
                if run == length:
                    return b - length + 1
        return None

    def allocate_ids(self, ids: list[int]) -> None:
        """Take exactly the free blocks `ids` (refcount 1 each); all must be free (checked first: nothing changes
        otherwise)."""
        assert len(set(ids)) == len(ids) and all(b in self._free for b in ids), "allocate_ids of blocks not free"
        for b in ids:
            self._free.remove(b)
            self._refcount[b] = 1

    def fill(self, block: int) -> int:
        """Leading slots of `block` written so far (the most any holder wrote)."""
        return self._fill[block]

    def set_fill(self, block: int, slots: int) -> None:
        """`block` (in use) now has its first `slots` slots written: a write extended it, or its only holder
        cropped it."""
        assert self._refcount[block] > 0, f"set_fill of block {block}, which is not in use"
        self.num_filled_slots += slots - self._fill[block]
        self._fill[block] = slots

    def _pop_lowest(self) -> int:
        while True:
            b = heapq.heappop(self._free_heap)
            if b in self._free:
                return b

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a block-table entry now names it). Blocks must be in use."""
        rc = self._refcount
        for b in blocks:
            assert rc[b] > 0, f"incref of free block {b}"
            rc[b] += 1

    def decref(self, blocks: Iterable[int], keep: Container[int] = ()) -> list[int]:
        """Drop one reference from each block; return the blocks that became free, in order.

        Blocks in `keep` (the prefix index) that reach refcount 0 become cached-idle instead of free.
        """
        rc = self._refcount
        freed = []
        for b in blocks:
            assert rc[b] > 0, f"decref of free block {b} (double free)"
            rc[b] -= 1
            if rc[b] == 0:
                self.num_filled_slots -= self._fill[b]
                if b in keep:
                    self._num_idle += 1
                    continue
                self._fill[b] = 0
                self._free.add(b)
                heapq.heappush(self._free_heap, b)
                freed.append(b)
        return freed

    def revive(self, block: int) -> None:
        """A cached-idle block is in use again (refcount 0 -> 1): a prefix lookup hit it."""
        assert self._refcount[block] == 0 and block not in self._free, f"revive of block {block}: not idle"
        self._refcount[block] = 1
        self.num_filled_slots += self._fill[block]
        self._num_idle -= 1

    def add_free(self, blocks: Iterable[int]) -> None:
        """Cached-idle blocks become free (their hashes were evicted)."""
        for b in blocks:
            assert self._refcount[b] == 0 and b not in self._free, f"add_free of block {b}: not idle"
            self._fill[b] = 0
            self._free.add(b)
            heapq.heappush(self._free_heap, b)
            self._num_idle -= 1

    def move(self, src: int, dst: int) -> None:
        """Compaction: free block `dst` takes over live block `src` (its refcount and fill, in use or cached-idle);
        `src` becomes free. The caller renames every table entry and copies the storage."""
        assert dst in self._free and src not in self._free, f"move of block {src} to {dst}: not live -> free"
        self._free.remove(dst)
        self._refcount[dst], self._fill[dst] = self._refcount[src], self._fill[src]
        self._refcount[src], self._fill[src] = 0, 0
        self._free.add(src)
        heapq.heappush(self._free_heap, src)

    def remove_blocks(self, n: int) -> None:
        """Forget the last `n` block ids (the pool shrank); they must all be free."""
        start = len(self._refcount) - n
        assert all(b in self._free for b in range(start, len(self._refcount))), "remove_blocks of blocks not free"
        del self._refcount[start:], self._fill[start:]
        self._free.difference_update(range(start, start + n))
        self._free_heap = sorted(self._free)

    def free_blocks(self) -> set[int]:
        """A copy of the free set (for checks and tests)."""
        return set(self._free)
