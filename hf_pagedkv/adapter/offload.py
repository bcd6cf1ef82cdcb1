"""Swapping a whole `PagedCache` out to the pool's host tier and back (`cache.offload()` / `cache.prefetch()`).

This is the "swap" side of vLLM's recompute-versus-swap preemption: a server that must make room for another
request moves a long request's KV blocks to host memory instead of dropping them, and brings them back later;
generation then continues exactly where it stopped (the same K/V, bit for bit).

What moves is decided by refcounts. Every block the cache names is copied to the host tier, then the cache drops
its references: a block only this cache held is freed on the device, a block other caches share stays on the
device for them, and a published prefix block held by nobody else becomes cached-idle (still a prefix hit for
other requests). On `prefetch` the cache gets new device blocks holding the copies; blocks it shared before are its
own copies afterwards (the device tier holds them twice while the other holders live). The pad block (whole blocks
of left padding, `BlockGroup.set_pad_block`) never moves: an offloaded row records its positions as `PAD` and
names the device's pad block again on `prefetch`.

Both moves are all or nothing, an error or interrupt included: `offload_cache` copies every group or holds no host
block, and changes no device block or table; `drop_device_blocks` then only does bookkeeping before its first call
that may fail (the storage of freed blocks is released last). `prefetch_cache` makes every copy and every new table
before it changes any, and frees the device blocks it took when a step fails. The caller (`PagedCache`) runs each
under the pool's lock, with its own check of whether the cache is offloaded, so that two threads offloading one
cache (its owner and another request's swap) make one decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.blocks.block_table import BlockTable

PAD = -1  # an offloaded row's position that names the device's pad block (left padding): not copied to the host


@dataclass(frozen=True)
class OffloadedGroup:
    """What an offloaded cache holds in one layer group, named by host block ids."""

    group: int  # the pool's layer group
    num_dropped: int  # leading block positions no row holds (sliding window); the same in every row
    num_tokens: int  # tokens of every row
    rows: tuple[tuple[int, ...], ...]  # per row, the host block of each held position (`PAD`: the pad block)
    fills: dict[int, int]  # host block -> leading slots written (the device allocator's fill, restored on prefetch)


def offload_cache(pool, owner: int, groups: list[RowTables]) -> list[OffloadedGroup]:
    """Copy every block of a cache (its `owner` token in `pool`, its tables `groups`, one per layer group) to the
    host tier; return what `prefetch_cache` needs. The cache still holds its device blocks: the caller records the
    result, then calls `drop_device_blocks`. Call with `pool.lock` held.

    Raises:
        ValueError: the pool has no host tier.
        PoolExhaustedError: the host tier has too few free blocks (nothing changed).
    """
    if pool.host is None:
        raise ValueError("offload() needs a pool with a host tier: BlockPool(..., host_memory=\"8GiB\").")
    plans = []
    for rt in groups:
        pad = pool.groups[rt.group].pad_block  # stays on the device
        unique = list(dict.fromkeys(b for row in rt.rows for b in row.blocks if b != pad))  # each once, in order
        plans.append((rt, unique))
    need = {rt.group: len(unique) for rt, unique in plans}
    if not pool.host.can_hold(need):
        raise PoolExhaustedError(f"offload(): the host tier has too few free blocks for this cache ({need} "
                                 f"needed per layer group; {pool.host.stats()}); raise host_memory.")
    hosts = pool.host.offload(owner, {rt.group: unique for rt, unique in plans if unique})  # all or nothing
    out = []
    for rt, unique in plans:
        group = pool.groups[rt.group]
        to_host = dict(zip(unique, hosts.get(rt.group, [])))
        if pool.groups[rt.group].pad_block is not None:
            to_host[pool.groups[rt.group].pad_block] = PAD
        out.append(OffloadedGroup(
            group=rt.group, num_dropped=rt.num_dropped, num_tokens=rt.rows[0].num_tokens if rt.rows else 0,
            rows=tuple(tuple(to_host[b] for b in row.blocks) for row in rt.rows),
            fills={to_host[b]: group.fill(b) for b in unique}))
    return out


def drop_device_blocks(pool, groups: list[RowTables]) -> None:
    """Empty a cache's tables `groups` and drop the device references they held (after `offload_cache`). Every
    table and reference is dropped before the first call that may fail (releasing freed blocks' storage). Call with
    `pool.lock` held."""
    held = {rt.group: [b for row in rt.rows for b in row.blocks] for rt in groups}
    for rt in groups:
        rt.reset(0)  # plain Python
    pool._free_groups(held)


def prefetch_cache(pool, owner: int, groups: list[RowTables], offloaded: list[OffloadedGroup]) -> None:
    """Give a cache (`owner`, `groups` as for `offload_cache`) new device blocks holding its host copies, rebuild
    its block tables, free the host blocks. All or nothing. Call with `pool.lock` held.

    Raises:
        PoolExhaustedError: the device tier has too few free plus cached-idle blocks (nothing changed: the cache
            stays offloaded).
    """
    by_group = {rt.group: rt for rt in groups}
    needs = {og.group: len(og.fills) + (pool.groups[og.group].pad_block is None and any(PAD in r for r in og.rows))
             for og in offloaded}
    short = [g for g, n in needs.items() if not pool.groups[g].can_reserve(n)]
    if short:
        g = short[0]
        raise PoolExhaustedError(f"prefetch(): {counted(needs[g], 'device block')} needed in layer group {g}, the pool "
                                 "has too few free plus cached-idle blocks; release or offload other caches first "
                                 "(this cache stays offloaded).")
    dev: dict[int, list[int]] = {}  # group -> the device blocks taken for its copies, in the order of `og.fills`
    tables = []  # (group's offload, its new rows, their mirror, the pad block or None), for every group
    try:
        for og in offloaded:
            host = list(og.fills)
            if host:
                dev[og.group] = pool._allocate(len(host), group=og.group)
                pool.groups[og.group].import_blocks(dev[og.group], pool.host.read(og.group, host))
                pool.groups[og.group].mark_written(dev[og.group], [og.fills[h] for h in host])
            pad = pool._ensure_pad_block(og.group) if any(PAD in hosts for hosts in og.rows) else None
            rows = _rows_on_device(og, dict(zip(host, dev.get(og.group, []))), pad)
            tables.append((og, rows, RowTables.mirror_of(rows), pad))
    except BaseException:
        pool._free_groups(dev)
        raise
    # every copy and every table is made: plain Python from here on, nothing can fail half-way
    for og, rows, table, pad in tables:
        num_pad = sum(hosts.count(PAD) for hosts in og.rows)
        if num_pad:  # one reference per entry naming the pad block
            pool.groups[og.group].incref([pad] * num_pad)
        seen: set[int] = set()
        for row in rows:  # the allocation holds one reference per block; a block named again gets one more
            again = [b for b in row.blocks if b in seen and b != pad]
            seen.update(row.blocks)
            if again:
                pool.groups[og.group].incref(again)
        by_group[og.group].restore(rows, table)
    pool.host.release(owner)


def _rows_on_device(og: OffloadedGroup, to_dev: dict[int, int], pad: int | None) -> list[BlockTable]:
    """The block tables of `og`'s rows naming device blocks: `to_dev[h]` for host block `h`, `pad` for `PAD`."""
    if pad is not None:
        to_dev = {**to_dev, PAD: pad}
    rows = []
    for hosts in og.rows:
        row = BlockTable(num_dropped=og.num_dropped)
        row.append([to_dev[h] for h in hosts])
        row.num_tokens = og.num_tokens
        rows.append(row)
    return rows
