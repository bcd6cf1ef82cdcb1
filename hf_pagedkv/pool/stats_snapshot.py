"""`snapshot_stats`: a `PoolStats` of a pool, summed over its layer groups and its host tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_pagedkv.observe.pool_stats import PoolStats

if TYPE_CHECKING:
    from hf_pagedkv.pool.block_pool import BlockPool


def snapshot_stats(pool: BlockPool) -> PoolStats:
    """Occupancy and prefix-cache counters of `pool` (see `PoolStats`), one `GroupStats` per layer group. Call with
    `pool.lock` held and released owners drained, so the numbers are consistent."""
    groups = pool.groups
    per_group = tuple(g.stats() for g in groups)
    indexes = [g.prefix_index for g in groups if g.prefix_index is not None]
    host = pool.host.stats() if pool.host is not None else None
    return PoolStats(
        block_size=pool.block_size,
        num_blocks=pool.num_blocks,
        blocks_in_use=pool.num_used_blocks,
        blocks_free=sum(g.allocator.num_free_blocks for g in groups),
        tokens_stored=sum(g.tokens_stored for g in per_group),
        bytes_per_block=sum(g.bytes_per_block for g in per_group),
        num_sequences=max(g.num_rows() for g in groups),
        bytes_in_use=sum(g.bytes_in_use for g in per_group),
        bytes_reserved=sum(g.bytes_reserved for g in per_group),
        blocks_cached=sum(g.allocator.num_idle_blocks for g in groups),
        bytes_cached=sum(g.allocator.num_idle_blocks * g.store.bytes_per_block for g in groups),
        prefix_cache_budget=_prefix_budget_bytes(pool),
        blocks_trapped=sum(g.num_trapped_blocks() for g in groups),
        num_segments=sum(len(g.store.segment_blocks) for g in groups),
        blocks_moved=pool.num_moved_blocks,
        bytes_returned=pool.bytes_returned,
        # NOTE: each request's lookup is counted by one group's index (its cache's first), so these add up
        lookups=sum(i.num_lookups for i in indexes),
        lookup_tokens=sum(i.num_lookup_tokens for i in indexes),
        hit_tokens=sum(i.num_hit_tokens for i in indexes),
        evictions=sum(i.num_evictions for i in indexes),
        cow_copies=sum(g.num_cow_copies for g in pool.groups),
        groups=per_group,
        **({} if host is None else dict(
            host_memory=host.host_memory, host_blocks=host.num_blocks,
            host_blocks_in_use=host.blocks_in_use, host_blocks_cached=host.blocks_cached,
            host_blocks_free=host.blocks_free, host_bytes_reserved=host.bytes_reserved,
            blocks_to_host=host.blocks_to_host, blocks_from_host=host.blocks_from_host,
            bytes_to_host=host.bytes_to_host, bytes_from_host=host.bytes_from_host)),
    )


def _prefix_budget_bytes(pool: BlockPool) -> int | None:
    """Bytes the cached-idle blocks may take, all groups (None without prefix caching or before a layer)."""
    limits = [pool.layers.max_idle_blocks(g.index) for g in pool.groups]
    if pool.prefix_budget is None or None in limits:
        return None
    return sum(n * g.store.bytes_per_block for n, g in zip(limits, pool.groups))
