"""`HostTiers`: a pool's host-memory tier, one `HostTier` (ids) and `HostStore` (tensors) per layer group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.errors import InvariantError, PoolExhaustedError, counted
from hf_pagedkv.blocks.host_tier import HostTier
from hf_pagedkv.storage.host_store import HostStore, select_blocks


@dataclass(frozen=True)
class HostStats:
    """Occupancy of the host tier, summed over layer groups (all 0 before its storage is allocated)."""

    num_blocks: int  # host blocks (capacity)
    blocks_in_use: int  # host blocks held by offloaded caches
    blocks_cached: int  # prefix blocks the device tier evicted, kept here for a hit
    blocks_free: int
    bytes_reserved: int  # host memory allocated
    blocks_offloaded: int  # device blocks copied to the host tier so far (`offload`)
    blocks_prefetched: int  # host blocks copied back so far (`prefetch`)
    blocks_demoted: int  # evicted device prefix blocks copied here so far
    blocks_promoted: int  # cached host blocks copied back for a prefix hit so far
    bytes_to_host: int = 0  # bytes copied device -> host so far (offloads, demotions and loaded overflow)
    bytes_from_host: int = 0  # bytes copied host -> device so far (prefetches and promotions)
    host_memory: int = 0  # the byte budget (`BlockPool(host_memory=...)`)

    @property
    def blocks_to_host(self) -> int:
        """Device blocks copied to the host tier so far (offloaded + demoted)."""
        return self.blocks_offloaded + self.blocks_demoted

    @property
    def blocks_from_host(self) -> int:
        """Host blocks copied back to the device so far (prefetched + promoted)."""
        return self.blocks_prefetched + self.blocks_promoted


class HostTiers:
    """The host tier of a `BlockPool(host_memory=...)`: where `PagedCache.offload()` puts a cache's blocks.

    Each layer group gets a `HostTier` and a `HostStore` of the same number of blocks, sized when the first cache is
    offloaded (the layers, hence the bytes of a block, are known then): ``host_memory // sum(bytes_per_block of every
    group)`` blocks each, as `max_memory` sizes the device tier. Every method is called with `pool.lock` held.

    Invariants (`check`, from `BlockPool.check_invariants`): each group's host ids are free or held, free + held
    equals the capacity, a cache holding host blocks holds no device block (its K/V are in one tier), and each
    host store's layout is whole (`HostStore.check`).

    Every operation is all or nothing: `offload` copies a cache's blocks of every group or holds none of them,
    `demote` and `load` cache every block they took a host id for or give the ids back, and `promote` copies a
    group's blocks back or leaves them cached on the host (an error or interrupt included).
    """

    def __init__(self, pool, host_memory: int) -> None:
        self.pool = pool  # the BlockPool this tier belongs to; fixed
        self.host_memory = host_memory  # byte budget of the host tier; fixed
        self.tiers: dict[int, tuple[HostTier, HostStore]] = {}  # group -> its ids and storage; created by `_tier`
        self.num_offloaded = 0  # device blocks copied out (counter)
        self.num_prefetched = 0  # host blocks copied back (counter)
        self.num_demoted = 0  # evicted device prefix blocks copied to the host (counter)
        self.num_promoted = 0  # cached host blocks copied back for a hit (counter)
        self.num_bytes_to_host = 0  # bytes of the exports copied into the host stores (counter)
        self.num_bytes_from_host = 0  # bytes of the exports copied back out of them (counter)

    def _tier(self, group: int) -> tuple[HostTier, HostStore]:
        """The group's host tier, created on first use.

        Raises:
            ValueError: `host_memory` holds no block of this model.
        """
        if group not in self.tiers:
            per_block = sum(g.store.bytes_per_block for g in self.pool.groups)
            n = self.host_memory // per_block if per_block else 0
            if n == 0:
                raise ValueError(f"host_memory={self.host_memory} bytes holds no block of this model ({per_block} "
                                 "bytes per block over all layer groups); raise host_memory.")
            device = next(iter(self.pool.groups[group].store.specs.values())).device
            tier = HostTier()
            tier.add_blocks(n)
            self.tiers[group] = (tier, HostStore(n, pin_memory=device.type == "cuda"))
        return self.tiers[group]

    def can_hold(self, needs: dict[int, int]) -> bool:
        """Whether every group `g` has room for `needs[g]` host blocks (free, or cached ones to drop). No side
        effects (beyond sizing the tier)."""
        return all(self._tier(g)[0].can_allocate(n) for g, n in needs.items() if n)

    def offload(self, owner: int, blocks: dict[int, list[int]]) -> dict[int, list[int]]:
        """Copy device blocks `blocks[g]` of each group `g` into new host blocks held by `owner` (which holds none
        yet); return their host ids, per group, in order. All or nothing: on any error `owner` holds no host block.
        The device blocks are not freed here (the caller drops its references).

        Raises:
            PoolExhaustedError: too few free host blocks (nothing changed).
        """
        assert not self.holds(owner), "an offload of a cache that holds host blocks already"
        hosts: dict[int, list[int]] = {}
        copied = nbytes = 0
        try:
            for group, todo in blocks.items():
                tier, store = self._tier(group)
                host = tier.allocate(owner, len(todo))
                if host is None:
                    raise PoolExhaustedError(
                        f"the host tier is full: {counted(len(todo), 'block')} needed, {tier.num_free_blocks} free of "
                        f"{tier.num_blocks} (host_memory={self.host_memory}); raise host_memory or prefetch/release "
                        "offloaded caches.")
                hosts[group] = host
                export = self.pool.groups[group].store.export_blocks(todo)
                store.write(host, export)
                copied, nbytes = copied + len(todo), nbytes + _nbytes(export)
        except BaseException:
            self.release(owner)  # the host blocks of the groups copied so far, and of the one that failed
            raise
        self.num_offloaded += copied
        self.num_bytes_to_host += nbytes
        return hosts

    def read(self, group: int, host_blocks: list[int]) -> dict:
        """The export of host blocks `host_blocks` of `group`, for the device store's `import_blocks`: on the
        group's CUDA device (copied on the host store's copy stream; the current stream waits for it), else CPU
        tensors."""
        export = self._tier(group)[1].read(host_blocks, self._copy_device(group))
        self.num_prefetched += len(host_blocks)
        self.num_bytes_from_host += _nbytes(export)
        return export

    # -- the host prefix cache: evicted device prefix blocks, and hits on them ------------------------------------
    def demote(self, group: int, blocks: list[int]) -> None:
        """Copy cached-idle device blocks the device tier is about to evict (oldest first) into cached host blocks,
        under their hashes, dropping older host-cached blocks for room. Called by `BlockGroup.evict` before the
        device blocks are freed (and possibly reused)."""
        index = self.pool.groups[group].prefix_index
        try:
            tier, store = self._tier(group)
        except ValueError:  # a host tier too small for one block keeps nothing (offload() says why)
            return
        todo = [(b, index.hash_of(b)) for b in blocks]
        todo = [(b, h) for b, h in todo if h is not None and tier.lookup(h) is None]
        host = tier.cache([h for _, h in todo])
        if not host:
            return
        try:
            export = self.pool.groups[group].store.export_blocks([b for b, _ in todo[: len(host)]])
            store.write(host, export)
        except BaseException:  # the ids go back; the eviction that called this does not happen
            self.unload(group, host)
            raise
        tier.park(host)
        self.num_demoted += len(host)
        self.num_bytes_to_host += _nbytes(export)

    def room_for_cached(self, group: int) -> int:
        """Host blocks of `group` that cached blocks may take (free, or cached ones to drop). No side effects
        (beyond sizing the tier).

        Raises:
            ValueError: `host_memory` holds no block of this model.
        """
        tier, _ = self._tier(group)
        return tier.num_free_blocks + tier.num_cached_blocks

    def load(self, group: int, hashes: list, export: dict) -> list[int]:
        """Put prefix blocks read from a file (`hashes[i]` names block `i` of `export`, CPU tensors) into `group`'s
        host tier as cached blocks, dropping older cached ones for room; hashes either tier holds already are
        skipped. Blocks are dropped later in the order given (the first first). Returns the host ids filled (undo
        with `unload`).

        Raises:
            ValueError: `export` is not of this tier's storage format (nothing changed).
        """
        tier, store = self._tier(group)
        index = self.pool.groups[group].prefix_index
        keep, seen = [], set()
        for i, h in enumerate(hashes):
            if h not in seen and index.block_of(h) is None and tier.lookup(h) is None:
                seen.add(h)
                keep.append(i)
        host = tier.cache([hashes[i] for i in keep])
        if not host:
            return []
        try:
            part = select_blocks(export, keep[: len(host)])
            store.write(host, part)
        except BaseException:
            self.unload(group, host)
            raise
        tier.park(host)
        self.num_bytes_to_host += _nbytes(part)
        return host

    def unload(self, group: int, host: list[int]) -> None:
        """Give back host blocks `load` or `demote` took for cached blocks (a later step failed): filled or not,
        parked or not, they are free again and their hashes forgotten."""
        tier, _ = self._tier(group)
        cached = set(tier.prefixes.idle_blocks())
        tier.park([b for b in host if b not in cached])
        for b in host:
            tier.take(b)

    def promote(self, hashes: list, groups: list[int]) -> None:
        """Copy the blocks of the prefix `hashes` that only the host tier holds back to the device, as cached-idle
        device prefix blocks (so the caller's lookup hits them), for each layer group in `groups`. A full-attention
        group stops at the first block neither tier holds (the rest cannot be hit); a sliding one goes on. Stops
        early, without error, when the device tier has no room. Called with `pool.lock` held."""
        pool = self.pool
        for g in groups:
            if g not in self.tiers:
                continue
            tier, store = self.tiers[g]
            full = pool.groups[g].window is None
            on_device = pool.groups[g].prefix_index
            back = []
            for h in hashes:
                if on_device.block_of(h) is not None:
                    continue
                host = tier.lookup(h)
                if host is None:
                    if full:
                        break
                    continue
                back.append((h, host))
            if not back:
                continue
            # hold the device blocks of the prefix, so making room for the copies does not evict them
            pinned = [b for h in hashes if on_device.block_of(h) is not None
                      for b in pool._acquire_prefix([h], 0, group=g, count=False)]
            try:
                alloc = pool.groups[g].allocator
                n = min(len(back), alloc.num_free_blocks + alloc.num_idle_blocks)
                if n == 0:
                    continue
                hosts = tier.pin([h for h, _ in back[:n]])  # not dropped by the demotions allocate may cause
                try:
                    dev = pool._allocate(n, group=g)  # may evict (and demote) other idle device blocks
                    try:
                        export = store.read(hosts, self._copy_device(g))
                        pool.groups[g].store.import_blocks(dev, export)
                    except BaseException:
                        pool._free(dev, g)
                        raise
                finally:
                    tier.unpin(hosts)
                for host in hosts:  # copied: the device holds them now, once
                    tier.take(host)
                pool.groups[g].mark_written(dev, [pool.block_size] * n)
                pool.groups[g].publish([h for h, _ in back[:n]], dev)
                pool._free(dev, g)  # cached-idle on the device now
                self.num_promoted += n
                self.num_bytes_from_host += _nbytes(export)
            finally:
                pool._free(pinned, g)

    def _copy_device(self, group: int) -> torch.device:
        """Where copies back of `group` land first: its layers' CUDA device when they share one (the host store
        copies there asynchronously), else the CPU (`import_blocks` then moves each layer's part to its device)."""
        devices = {spec.device for spec in self.pool.groups[group].store.specs.values()}
        device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        return device if device.type == "cuda" else torch.device("cpu")

    def release(self, owner: int) -> None:
        """Free every host block `owner` holds, in every group."""
        for tier, _ in self.tiers.values():
            tier.release(owner)

    def holds(self, owner: int) -> bool:
        return any(tier.held.get(owner) for tier, _ in self.tiers.values())

    def cached(self, group: int) -> tuple[list, dict]:
        """The prefix blocks cached in `group`'s host tier: their hashes and their export (CPU tensors), in the
        same order (for `save_prefix_cache`, which saves both tiers)."""
        if group not in self.tiers:
            return [], {}
        tier, store = self.tiers[group]
        published = tier.prefixes.published()  # host id -> hash
        hosts = sorted(published, key=lambda b: (published[b].num_tokens, published[b].digest))
        return [published[b] for b in hosts], (store.read(hosts) if hosts else {})

    def stats(self) -> HostStats:
        """A snapshot of the host tier's occupancy and copy counters (`HostStats`)."""
        with self.pool.lock:
            return self._stats()

    def _stats(self) -> HostStats:
        tiers = [t for t, _ in self.tiers.values()]
        return HostStats(
            num_blocks=sum(t.num_blocks for t in tiers),
            blocks_in_use=sum(t.num_used_blocks for t in tiers),
            blocks_cached=sum(t.num_cached_blocks for t in tiers),
            blocks_free=sum(t.num_free_blocks for t in tiers),
            bytes_reserved=sum(s.bytes_reserved for _, s in self.tiers.values()),
            blocks_offloaded=self.num_offloaded,
            blocks_prefetched=self.num_prefetched,
            blocks_demoted=self.num_demoted,
            blocks_promoted=self.num_promoted,
            bytes_to_host=self.num_bytes_to_host,
            bytes_from_host=self.num_bytes_from_host,
            host_memory=self.host_memory,
        )

    def check(self) -> None:
        """Raise `InvariantError` naming the broken host-tier invariant (numbered 9 after `pool/invariants.py`)."""
        for group, (tier, store) in self.tiers.items():
            problems = tier.check() + store.check(self.pool.groups[group].store.export_blocks([]))
            both = [o for o, held in tier.held.items() if held and any(
                row.blocks for row in self.pool.groups[group].tables.get(o, ()))]
            if both:
                problems.append(f"caches {both[:5]} hold blocks in both tiers")
            if problems:
                raise InvariantError(f"invariant 9 (host tier) broken in group {group}: {'; '.join(problems)}")


def _nbytes(export: dict) -> int:
    """Bytes of the K/V tensors of a block export (its `*_rows` index lists are bookkeeping, not counted)."""
    return sum(t.numel() * t.element_size() for name, t in export.items() if not name.endswith("_rows"))
