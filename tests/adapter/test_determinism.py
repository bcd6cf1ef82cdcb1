"""What BlockPool's "Determinism" note promises and warns about (tensor parallel ranks must make the same choices)."""

from __future__ import annotations

import gc

from hf_pagedkv import BlockPool, PagedCache
from tests.conftest import ids, tiny_model


def test_a_dropped_cache_is_freed_at_del_not_when_the_garbage_collector_runs(one_thread):
    """What the docstring promises: the blocks of a cache dropped without release() come back when its last
    reference goes (no reference cycle), not at a cyclic collection whose timing differs between processes; so
    ranks stay in step either way, and release() frees them at once too."""
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    enabled = gc.isenabled()
    gc.disable()
    try:
        cache = PagedCache(pool=pool, config=model.config)
        model(ids(1, 9), past_key_values=cache)
        assert pool.stats().blocks_in_use == 3
        del cache
        assert pool.stats().blocks_in_use == 0  # freed with the last reference, cyclic GC off
        cache = PagedCache(pool=pool, config=model.config)
        model(ids(1, 9), past_key_values=cache)
        cache.release()
        assert pool.stats().blocks_in_use == 0  # explicit: deterministic
    finally:
        if enabled:
            gc.enable()
