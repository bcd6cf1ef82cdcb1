"""`HostTier`: the block ids of one layer group's host-memory tier and who holds them. Pure Python, no tensors."""

from __future__ import annotations

from collections import Counter

from hf_pagedkv.pool.block_allocator import BlockAllocator


class HostTier:
    """Host block ids of one layer group: a fixed number of them, a free list, and the owner holding each one.

    Host ids are their own namespace (``0 .. num_blocks - 1``), apart from the device tier's: a block's K/V is in one
    tier at a time, named by a device id there or a host id here. An owner is a cache's token (`PagedCache.seq_id`);
    an offloaded cache holds each of its host blocks once (`held`), however many of its rows name it.

    Invariants (`check`): every host id is free or held (refcount 1), never both; `refcount[h]` equals the times
    `h` appears in `held`; free + held equals `num_blocks`.
    """

    def __init__(self) -> None:
        self.allocator = BlockAllocator()  # host ids, refcounts and the free list; changed by the methods below
        self.held: dict[int, list[int]] = {}  # owner token -> the host ids it holds; changed by allocate / release

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    def add_blocks(self, n: int) -> None:
        """The tier's capacity, set once when its storage is allocated."""
        assert self.allocator.num_blocks == 0, "a host tier is sized once"
        self.allocator.add_blocks(n)

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def allocate(self, owner: int, n: int) -> list[int] | None:
        """`n` free host ids for `owner` (added to what it holds), or `None` with nothing changed."""
        blocks = self.allocator.allocate(n)
        if blocks is not None:
            self.held.setdefault(owner, []).extend(blocks)
        return blocks

    def free(self, owner: int, blocks: list[int]) -> None:
        """Give back some of `owner`'s host ids (a copy into them failed)."""
        drop = set(blocks)
        self.held[owner] = [b for b in self.held.get(owner, []) if b not in drop]
        if not self.held[owner]:
            del self.held[owner]
        self.allocator.decref(blocks)

    def release(self, owner: int) -> list[int]:
        """Free every host id `owner` holds; return them."""
        blocks = self.held.pop(owner, [])
        return self.allocator.decref(blocks)

    def check(self) -> list[str]:
        """Problems (empty when fine)."""
        alloc, problems = self.allocator, []
        entries = Counter(b for blocks in self.held.values() for b in blocks)
        wrong = [b for b in range(alloc.num_blocks) if alloc.refcount(b) != entries.get(b, 0)]
        if wrong:
            problems.append(f"host blocks {wrong[:10]} have refcounts {[alloc.refcount(b) for b in wrong[:10]]} but "
                            f"{[entries.get(b, 0) for b in wrong[:10]]} holders")
        free = alloc.free_blocks()
        both = sorted(b for b in free if alloc.refcount(b))
        if both or alloc.num_idle_blocks or alloc.num_free_blocks + alloc.num_used_blocks != alloc.num_blocks:
            problems.append(f"free {alloc.num_free_blocks} + held {alloc.num_used_blocks} != {alloc.num_blocks} host "
                            f"blocks (held and free: {both[:10]})")
        unknown = sorted(b for b in entries if not 0 <= b < alloc.num_blocks)
        if unknown:
            problems.append(f"held host ids {unknown[:10]} out of range")
        return problems
