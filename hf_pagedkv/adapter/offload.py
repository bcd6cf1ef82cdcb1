"""Swapping a whole `PagedCache` out to the pool's host tier and back (`cache.offload()` / `cache.prefetch()`).

This is the "swap" side of vLLM's recompute-versus-swap preemption: a server that must make room for another
request moves a long request's KV blocks to host memory instead of dropping them, and brings them back later;
generation then continues exactly where it stopped (the same K/V, bit for bit).

What moves is decided by refcounts. Every block the cache names is copied to the host tier, then the cache drops
its references: a block only this cache held is freed on the device, a block other caches share stays on the
device for them, and a published prefix block held by nobody else becomes cached-idle (still a prefix hit for
other requests). On `prefetch` the cache gets new device blocks holding the copies; blocks it shared before are its
own copies afterwards (the device tier holds them twice while the other holders live). The pad block (whole blocks
of left padding, `BlockPool.ensure_pad_block`) never moves: an offloaded row records its positions as `PAD` and
names the device's pad block again on `prefetch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.errors import PoolExhaustedError
from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.pool.block_table import BlockTable

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
    host tier and drop the cache's device references (see the module docstring). Returns what `prefetch_cache`
    needs.

    Raises:
        ValueError: the pool has no host tier.
        PoolExhaustedError: the host tier has too few free blocks (nothing changed).
    """
    if pool.host is None:
        raise ValueError("offload() needs a pool with a host tier: BlockPool(..., host_memory=\"8GiB\").")
    with pool.lock:
        plans = []
        for rt in groups:
            pad = pool.pad_block(rt.group)  # stays on the device
            unique = list(dict.fromkeys(b for row in rt.rows for b in row.blocks if b != pad))  # each once, in order
            plans.append((rt, unique))
        if not pool.host.can_hold({rt.group: len(unique) for rt, unique in plans}):
            need = {rt.group: len(unique) for rt, unique in plans}
            raise PoolExhaustedError(f"offload(): the host tier has too few free blocks for this cache ({need} "
                                     f"needed per layer group; {pool.host.stats()}); raise host_memory.")
        out = []
        for rt, unique in plans:
            alloc = pool.groups[rt.group].allocator
            host = pool.host.offload(owner, rt.group, unique) if unique else []
            to_host = dict(zip(unique, host))
            if pool.pad_block(rt.group) is not None:
                to_host[pool.pad_block(rt.group)] = PAD
            out.append(OffloadedGroup(
                group=rt.group, num_dropped=rt.num_dropped, num_tokens=rt.rows[0].num_tokens if rt.rows else 0,
                rows=tuple(tuple(to_host[b] for b in row.blocks) for row in rt.rows),
                fills={to_host[b]: alloc.fill(b) for b in unique}))
        for rt in groups:  # every copy succeeded: drop the device references
            pool.free([b for row in rt.rows for b in row.blocks], rt.group)
            rt.reset(0)
        return out


def prefetch_cache(pool, owner: int, groups: list[RowTables], offloaded: list[OffloadedGroup]) -> None:
    """Give a cache (`owner`, `groups` as for `offload_cache`) new device blocks holding its host copies, rebuild
    its block tables, free the host blocks.

    Raises:
        PoolExhaustedError: the device tier has too few free plus cached-idle blocks (nothing changed: the cache
            stays offloaded).
    """
    by_group = {rt.group: rt for rt in groups}
    with pool.lock:
        needs = {og.group: len(og.fills) + (pool.pad_block(og.group) is None and any(PAD in r for r in og.rows))
                 for og in offloaded}
        short = [g for g, n in needs.items() if not pool.can_reserve(n, g)]
        if short:
            g = short[0]
            raise PoolExhaustedError(f"prefetch(): {needs[g]} device blocks needed in layer group {g}, the pool has "
                                     "too few free plus cached-idle blocks; release or offload other caches first "
                                     "(this cache stays offloaded).")
        held: list[tuple[int, list[int]]] = []
        try:
            for og in offloaded:
                host = list(og.fills)
                if not host:
                    held.append((og.group, []))
                    continue
                dev = pool.allocate(len(host), group=og.group)
                held.append((og.group, dev))
                pool.groups[og.group].store.import_blocks(dev, pool.host.read(og.group, host))
                pool.mark_written(dev, [og.fills[h] for h in host], group=og.group)
        except BaseException:
            for g, dev in held:
                pool.free(dev, g)
            raise
        for og, (_, dev) in zip(offloaded, held):
            rt = by_group[og.group]
            to_dev, pad = dict(zip(og.fills, dev)), None
            if any(PAD in hosts for hosts in og.rows):  # one reference per entry naming the pad block
                to_dev[PAD] = pad = pool.ensure_pad_block(og.group)
                pool.incref([pad] * sum(hosts.count(PAD) for hosts in og.rows), og.group)
            rows = [[to_dev[h] for h in hosts] for hosts in og.rows]
            seen: set[int] = set()
            for blocks in rows:  # the allocation holds one reference per block; a block named again gets one more
                again = [b for b in blocks if b in seen and b != pad]
                seen.update(blocks)
                if again:
                    pool.incref(again, og.group)
            rt.reset(0)
            for blocks in rows:
                row = BlockTable(num_dropped=og.num_dropped)
                row.append(blocks)
                row.num_tokens = og.num_tokens
                rt.rows.append(row)
            rt.table = torch.zeros((len(rows), 0), dtype=torch.long)
            for r in range(len(rows)):
                rt.set_row(r, og.num_dropped)
        pool.host.release(owner)
