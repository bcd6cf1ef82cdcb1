"""A released `PagedCache` that held tokens: what raises `CacheReleasedError`, and what still answers."""

from __future__ import annotations

import pytest

from hf_pagedkv import BlockPool, CacheReleasedError, PagedCache
from tests.conftest import ids, tiny_model


def test_a_released_cache_refuses_its_length_and_checks_that_it_holds_nothing():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, debug=True)
    cache = PagedCache(pool=pool, config=model.config)
    model(ids(1, 9), past_key_values=cache)
    assert cache.get_seq_length() == 9 and pool.stats().blocks_in_use == 3  # 9 tokens, blocks of 4
    cache.check_invariants()
    layers = len(cache)
    cache.release()
    for call in (cache.get_seq_length, lambda: cache.get_seq_length(1)):
        with pytest.raises(CacheReleasedError, match="This PagedCache was released; create a new one"):
            call()
    with pytest.raises(CacheReleasedError, match="was released"):
        model.generate(ids(1, 5), past_key_values=cache, max_new_tokens=2)
    assert len(cache) == layers == model.config.num_hidden_layers  # the layer count, as DynamicCache's
    assert cache.block_tables() == [] and "released" in repr(cache)
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()
    cache.check_invariants()  # a released cache checks that it holds nothing
