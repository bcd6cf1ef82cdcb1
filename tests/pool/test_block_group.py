"""A `BlockGroup` on its own (no pool, no layers: pure bookkeeping, milliseconds), and the pool's owners
(`PoolOwners`): the operations the pool delegates to them, as stories with exact ids and refcounts."""

import pytest

from hf_pagedkv import BlockPool, PoolExhaustedError
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.prefix_index import hash_blocks
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.pool.block_group import BlockGroup

B = 4


def table(blocks: list[int], num_tokens: int) -> BlockTable:
    row = BlockTable()
    row.append(blocks)
    row.num_tokens = num_tokens
    return row


def test_story_a_fixed_group_reserves_by_evicting_its_idle_prefix_blocks():
    g = BlockGroup(0, None, B, QuantConfig.resolve(None), prefix_caching=True, growable=False)
    g.add_blocks(4)
    assert (g.num_blocks, g.name, g.is_quantized) == (4, "full", False)

    # a request takes 3 blocks, writes 10 tokens into them and publishes the 2 full ones
    g.reserve(3)
    blocks = g.allocate(3)
    assert blocks == [0, 1, 2]
    g.mark_written(blocks, [4, 4, 2])
    g.tables[7] = [table(blocks, 10)]
    assert g.publish(hash_blocks(list(range(10)), B, b"k"), blocks[:2]) == 2
    assert [g.refcount(b) for b in blocks] == [1, 1, 1] and g.fill(2) == 2
    g.check_invariants()

    # it ends: the published blocks stay cached-idle, the partial one is free again
    rows = g.tables.pop(7)
    assert g.free([b for row in rows for b in row.blocks]) == [2]
    assert (g.allocator.num_free_blocks, g.allocator.num_idle_blocks) == (2, 2)
    g.check_invariants()

    # a budget of one idle block evicts one: the prefix's tail (block 1) goes first, its head stays hittable
    g.trim_prefix_cache(1)
    assert g.is_published(0) and not g.is_published(1)
    assert (g.allocator.num_free_blocks, g.allocator.num_idle_blocks) == (3, 1)

    # 4 blocks are needed: the last idle block is evicted for them; 5 cannot be had (nothing changes)
    assert g.can_reserve(4) and not g.can_reserve(5)
    g.reserve(4)
    assert (g.allocator.num_free_blocks, g.allocator.num_idle_blocks) == (4, 0)
    with pytest.raises(PoolExhaustedError, match="5 blocks needed, 4 free and 0 cached-idle of 4"):
        g.reserve(5)
    assert g.allocate(4) == [0, 1, 2, 3]
    g.free([0, 1, 2, 3])
    g.check_invariants()


def test_story_a_growable_group_grows_by_a_headroom_and_lays_rows_out_evenly():
    g = BlockGroup(1, 8, B, QuantConfig.resolve(None))
    assert (g.num_blocks, g.name) == (0, "sliding8")
    g.reserve(2, rows=2, run=6)  # 2 blocks + a headroom of 16 (the minimum); the run of 6 fits in that segment
    assert g.num_blocks == 18
    assert g.allocate_rows(2, 2, 3) == [[0, 1], [3, 4]]  # rows 3 apart; ids 2 and 5 stay free for their next blocks
    assert g.free_run(3) == 5 and g.allocate(1, after=1) == [2]
    assert g.allocate_rows(2, 20, 20) is None  # no free run of 40 blocks: nothing changed
    assert g.allocator.num_used_blocks == 5


def test_owners_collected_without_release_are_freed_by_the_next_pool_operation():
    pool = BlockPool(block_size=B, num_blocks=6)
    blocks = pool._allocate(2)
    token = pool._register_owner([table(blocks, 8)])
    assert pool.idle_owners() == []  # no swap hook: never offered for swapping out
    pool.owners.release(token)  # what a cache's finalizer does: only queued
    assert pool.owners.num_pending == 1 and pool.num_used_blocks == 2
    assert pool.stats().blocks_in_use == 0  # the next operation drained it first
    assert pool.owners.num_pending == 0 and token not in pool.owners.registry.live
    pool.check_invariants()


def test_block_pool_takes_its_settings_by_keyword_after_block_size():
    assert BlockPool(8, num_blocks=3).num_blocks == 3
    with pytest.raises(TypeError):
        BlockPool(8, 3)
