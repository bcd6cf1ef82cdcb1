"""Batch reads (`PageStore.read_blocks`' token gather): every layer update of a many-row batch returns exactly what
`DynamicCache` returns, bit for bit and in its contiguous layout, while rows cross block boundaries, share blocks
(forks, beams) and lie in several storage segments of a growing pool.
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
            assert got_k.is_contiguous() and got_v.is_contiguous()  # DynamicCache's torch.cat layout
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
