"""`HostTier`: the block ids of one layer group's host-memory tier and who holds them. Pure Python, no tensors."""

from __future__ import annotations

from collections import Counter

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.prefix_index import BlockHash, PrefixIndex


class HostTier:
    """Host block ids of one layer group: a fixed number of them, a free list, who holds each, and a prefix cache.

    Host ids are their own namespace (``0 .. num_blocks - 1``), apart from the device tier's: a block's K/V is in one
    tier at a time, named by a device id there or a host id here. Each host id is in one state:

    - **free**;
    - **held** (refcount 1) by an offloaded cache (`held`: owner token -> its host ids; an offloaded cache holds each
      of its host blocks once, however many of its rows name it);
    - **cached**: a published prefix block the device tier evicted (`prefixes`, its own `PrefixIndex` with an LRU),
      waiting for a hit that copies it back, or to be dropped (oldest first) when the tier needs room.

    Invariants (`check`): every host id is in exactly one state; `refcount[h]` equals the times `h` appears in
    `held`; free + held + cached equals `num_blocks`; the prefix index is consistent.
    """

    def __init__(self) -> None:
        self.allocator = BlockAllocator()  # host ids, refcounts and the free list; changed by the methods below
        self.held: dict[int, list[int]] = {}  # owner token -> the host ids it holds; changed by allocate / release
        self.prefixes = PrefixIndex()  # hashes of cached host blocks, least recently demoted first

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

    @property
    def num_cached_blocks(self) -> int:
        return self.allocator.num_idle_blocks

    def can_allocate(self, n: int) -> bool:
        """Whether `n` host ids can be had (free, or cached ones dropped). No side effects."""
        return n <= self.allocator.num_free_blocks + self.allocator.num_idle_blocks

    def _make_room(self, n: int) -> list[int]:
        """Drop the oldest cached blocks until `n` ids are free (as many as there are); return the dropped ids."""
        short = min(n - self.allocator.num_free_blocks, self.allocator.num_idle_blocks)
        return self.prefixes.evict(short, self.allocator) if short > 0 else []

    def allocate(self, owner: int, n: int) -> list[int] | None:
        """`n` host ids for `owner` (added to what it holds), dropping cached blocks if needed; or `None` with
        nothing changed when even that is not enough."""
        if not self.can_allocate(n):
            return None
        self._make_room(n)
        blocks = self.allocator.allocate(n)
        assert blocks is not None
        self.held.setdefault(owner, []).extend(blocks)
        return blocks

    def cache(self, hashes: list[BlockHash]) -> list[int]:
        """Host ids for prefix blocks named `hashes` (oldest first), dropping older cached blocks for room; fewer
        (a prefix of `hashes`) when offloaded caches hold the rest of the tier. The caller fills them and then
        calls `park`."""
        n = min(len(hashes), self.allocator.num_free_blocks + self.allocator.num_idle_blocks)
        self._make_room(n)
        blocks = self.allocator.allocate(n) or []
        for h, b in zip(hashes, blocks):
            self.prefixes.publish(h, b)
        return blocks

    def park(self, blocks: list[int]) -> None:
        """Blocks from `cache`, now filled, become cached (the first of `blocks` is dropped first)."""
        self.prefixes.release(list(reversed(blocks)), self.allocator)

    def lookup(self, h: BlockHash) -> int | None:
        """The cached host block holding `h`, or None."""
        return self.prefixes.block_of(h)

    def pin(self, hashes: list[BlockHash]) -> list[int]:
        """Keep the cached blocks named `hashes` from being dropped while they are copied out (refcount 1, held by
        no owner until `unpin`); returns their ids."""
        return [b for h in hashes for b in self.prefixes.acquire([h], self.allocator, 0, count=False)]

    def unpin(self, blocks: list[int]) -> None:
        """Pinned blocks are cached again."""
        self.prefixes.release(blocks, self.allocator)

    def take(self, block: int) -> None:
        """A cached block was copied back to the device: free its host id."""
        self.prefixes.forget(block, self.allocator)

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
        free, cached = alloc.free_blocks(), set(self.prefixes.idle_blocks())
        odd = sorted(b for b in range(alloc.num_blocks) if (b in free) + (b in cached) + (alloc.refcount(b) > 0) != 1)
        if odd or len(cached) != alloc.num_idle_blocks or self.prefixes.num_published_blocks != len(cached):
            problems.append(f"free {alloc.num_free_blocks} + held {alloc.num_used_blocks} + cached {len(cached)} != "
                            f"{alloc.num_blocks} host blocks (in no or two states: {odd[:10]})")
        problems += self.prefixes.check(free, alloc.num_blocks)
        unknown = sorted(b for b in entries if not 0 <= b < alloc.num_blocks)
        if unknown:
            problems.append(f"held host ids {unknown[:10]} out of range")
        return problems
