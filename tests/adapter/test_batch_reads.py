"""Batch reads (`PageStore.read_blocks`' token gather, or one strided view of evenly laid out rows): every layer
update of a many-row batch returns exactly what `DynamicCache` returns, bit for bit, each (row, head) a contiguous
matrix, while rows cross block boundaries, share blocks (forks, beams) and lie in several storage segments of a
growing pool.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HEADS, DIM = 3, 2, 8


def step(caches, batch: int, q: int, g: torch.Generator) -> None:
    """One forward step of random K/V `[batch, HEADS, q, DIM]` per layer through every cache; the reads must agree."""
    for layer in range(LAYERS):
        k = torch.randn(batch, HEADS, q, DIM, generator=g)
        v = torch.randn(batch, HEADS, q, DIM, generator=g)
        (want_k, want_v), *rest = [c.update(k, v, layer) for c in caches]
        for got_k, got_v in rest:
            # DynamicCache's torch.cat layout, or a strided view of evenly laid out rows: either way every (row, head)
            # is a contiguous [tokens, head_dim] matrix, as attention reads it
            assert got_k.stride()[-2:] == (DIM, 1) and got_v.stride()[-2:] == (DIM, 1)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # the same copies: bit for bit


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_many_rows_across_boundaries_forks_and_beams_read_what_dynamic_cache_does(block_size):
    g = torch.Generator().manual_seed(block_size)
    pool = BlockPool(block_size)  # growable: each growth is a new storage segment
    dc, pc = DynamicCache(), PagedCache(pool=pool)
    with torch.inference_mode():
        step((dc, pc), 4, 2 * block_size - 1, g)  # a prefill ending one token before a boundary
        for cache in (dc, pc):
            cache.batch_repeat_interleave(3)  # 12 rows; each group of 3 shares its blocks (forks)
        for i in range(2 * block_size + 3):  # decode across two boundaries; copy-on-write of shared last blocks
            step((dc, pc), 12, 1, g)
            if i % 5 == 2:  # beams: rows reordered, some duplicated, so rows share blocks again
                beams = torch.tensor([0, 0, 1, 5, 4, 4, 11, 2, 3, 3, 7, 6])
                for cache in (dc, pc):
                    cache.reorder_cache(beams)
            pool.check_invariants()
        assert pool.stats().num_segments > 1  # reads crossed storage segments
        for layer in range(LAYERS):  # and the layers' own reads (`keys` / `values`) agree too
            assert torch.equal(pc.layers[layer].keys, dc.layers[layer].keys)
            assert torch.equal(pc.layers[layer].values, dc.layers[layer].values)
    pc.release()
    assert pool.stats().blocks_in_use == 0


def _is_view_of_pool(t: torch.Tensor, pool: BlockPool) -> bool:
    segments = pool.groups[0].store.keys[0].segments + pool.groups[0].store.values[0].segments
    return any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in segments)


def test_rows_prefilled_together_are_read_as_one_strided_view_until_they_outgrow_their_room():
    g = torch.Generator().manual_seed(5)
    pool = BlockPool(4)
    dc, pc = DynamicCache(), PagedCache(pool=pool)
    with torch.inference_mode():
        step((dc, pc), 4, 10, g)  # 3 blocks per row, and 3 free blocks of room after each
        assert pc.block_tables() == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]]
        assert pool.stats().blocks_in_use == 12
        views = []
        for _ in range(16):  # 10 -> 26 tokens: the room holds 24, then each row's 7th block comes from elsewhere
            step((dc, pc), 4, 1, g)
            pool.check_invariants()
            k, v = pc.update(torch.zeros(4, HEADS, 0, DIM), torch.zeros(4, HEADS, 0, DIM), 0)  # a read, no write
            assert torch.equal(k, dc.layers[0].keys) and torch.equal(v, dc.layers[0].values)
            views.append(_is_view_of_pool(k, pool) and _is_view_of_pool(v, pool))
        assert views == [True] * 14 + [False] * 2  # tokens 11..24 in the room; 25, 26 in a 7th block elsewhere
        assert [row[:6] for row in pc.block_tables()] == [list(range(6 * r, 6 * r + 6)) for r in range(4)]
    pc.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_strided_rows_whose_room_another_cache_takes_are_gathered_exactly():
    g = torch.Generator().manual_seed(6)
    pool = BlockPool(4)
    dc, pc, other = DynamicCache(), PagedCache(pool=pool), PagedCache(pool=pool)
    with torch.inference_mode():
        step((dc, pc), 3, 8, g)  # 2 blocks per row, room of 2 after each: blocks 2, 3, 6, 7, 10, 11 free
        other.update(torch.randn(1, HEADS, 4, DIM, generator=g), torch.randn(1, HEADS, 4, DIM, generator=g), 0)
        assert other.block_tables() == [[2]]  # the lowest free block: row 0's room
        for _ in range(6):
            step((dc, pc), 3, 1, g)
            pool.check_invariants()
        assert pc.block_tables()[0][2] != 2 and pc.block_tables()[1][2] == 6  # row 0 went elsewhere, row 1 did not
    other.release()
    pc.release()
    assert pool.stats().blocks_in_use == 0


def test_a_fixed_pool_without_room_for_even_rows_allocates_row_by_row():
    g = torch.Generator().manual_seed(7)
    pool = BlockPool(4, num_blocks=11)  # 3 rows of 3 blocks fit; 3 rows of 2 + room for 2 (12 blocks) do not
    dc, pc = DynamicCache(), PagedCache(pool=pool)
    with torch.inference_mode():
        step((dc, pc), 3, 8, g)
        assert pc.block_tables() == [[0, 1], [2, 3], [4, 5]]
        for _ in range(4):
            step((dc, pc), 3, 1, g)
            pool.check_invariants()
    pc.release()
    assert pool.stats().blocks_in_use == 0


def test_the_room_after_each_row_is_bounded():
    from hf_pagedkv.adapter.step_planner import ROW_HEADROOM_TOKENS

    pool = BlockPool(16)
    pc = PagedCache(pool=pool)
    n = 4 * ROW_HEADROOM_TOKENS  # tokens per row: 64 blocks; the room after each is ROW_HEADROOM_TOKENS // 16
    with torch.inference_mode():
        pc.update(torch.randn(2, HEADS, n, DIM), torch.randn(2, HEADS, n, DIM), 0)  # rows differ: no sharing
    stride = ROW_HEADROOM_TOKENS // 16 + n // 16
    assert [row[0] for row in pc.block_tables()] == [0, stride]
    assert pool.stats().blocks_in_use == 2 * n // 16
    pc.release()


def test_a_growable_pool_never_grows_only_to_lay_rows_out_evenly():
    g = torch.Generator().manual_seed(8)
    pool = BlockPool(4)
    singles = []
    while not singles or pool.groups[0].allocator.num_free_blocks:  # fill the pool with one-block caches
        c = PagedCache(pool=pool)
        c.update(torch.randn(1, HEADS, 4, DIM, generator=g), torch.randn(1, HEADS, 4, DIM, generator=g), 0)
        singles.append(c)
    for c in singles[::2]:  # every other block freed: free blocks, but no two of them consecutive
        c.release()
    size = pool.num_blocks
    dc, pc = DynamicCache(), PagedCache(pool=pool)
    with torch.inference_mode():
        step((dc, pc), 2, 4, g)  # 2 rows of 1 block fit in the free blocks; 2 rows with room for 1 do not
        assert pool.num_blocks == size  # no growth: the rows went where the free blocks are
        assert all(len(row) == 1 for row in pc.block_tables())
        step((dc, pc), 2, 1, g)
        pool.check_invariants()
    for c in (pc, *singles[1::2]):
        c.release()
    assert pool.stats().blocks_in_use == 0
