"""The prefix cache keeps what it caches: idle cached blocks live within `prefix_cache_memory`, a growable
pool grows rather than evicting within it, and the least recently used ones go beyond it."""

from __future__ import annotations

import pytest

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.blocks.prefix_budget import DEFAULT_GROWABLE_BYTES
from tests.conftest import ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}


def send_twice(pool: BlockPool, num_prompts: int = 12, length: int = 200) -> tuple[int, int]:
    """Send `num_prompts` distinct prompts, then each again; (full blocks hit on the repeat, full blocks asked)."""
    model = tiny_model("llama")
    prompts = [ids(1, length, seed=100 + i) for i in range(num_prompts)]
    for x in prompts:
        hf_pagedkv.generate(model, x, pool=pool, **GEN)
    before = pool.stats().hit_tokens
    for x in prompts:
        hf_pagedkv.generate(model, x, pool=pool, **GEN)
        pool.check_invariants()
    hit_blocks = (pool.stats().hit_tokens - before) // pool.block_size
    return hit_blocks, num_prompts * (length // pool.block_size)


def test_default_budget_keeps_12_prompts_sent_twice():
    """The docs' scenario (docs/sharing.md): 12 distinct 200-token prompts, each sent twice, on a default growable pool: the
    repeats hit (>= 90% of their full blocks; a prompt of k full blocks recomputes at least its last token)."""
    pool = BlockPool(block_size=16, prefix_caching=True)
    hit, asked = send_twice(pool)
    assert hit >= 0.9 * asked, (hit, asked)
    s = pool.stats()
    assert s.evictions == 0 and s.blocks_in_use == 0 and s.blocks_cached > 0
    assert s.bytes_cached == s.blocks_cached * s.bytes_per_block
    assert s.prefix_cache_budget == (DEFAULT_GROWABLE_BYTES // s.bytes_per_block) * s.bytes_per_block


def test_a_small_budget_evicts_least_recently_used_beyond_it():
    """A budget of 20 blocks' bytes: after each request the idle blocks are trimmed to 20, oldest first, so only the
    most recent prompts' blocks survive and the first prompts miss when they come back."""
    model = tiny_model("llama")
    probe = BlockPool(block_size=16)
    with PagedCache(pool=probe) as c:
        model(ids(1, 16), past_key_values=c)
    per_block = probe.stats().bytes_per_block
    pool = BlockPool(block_size=16, prefix_caching=True, prefix_cache_memory=20 * per_block)
    prompts = [ids(1, 100, seed=200 + i) for i in range(6)]  # 6 full blocks each (+ generated tokens)
    for x in prompts:
        hf_pagedkv.generate(model, x, pool=pool, **GEN)
        assert pool.stats().blocks_cached <= 20
        pool.check_invariants()
    s = pool.stats()
    assert s.blocks_cached == 20 and s.evictions > 0 and s.prefix_cache_budget == 20 * per_block
    idle = pool.groups[0].prefix_index.idle_blocks()  # eviction order: least recently released first
    # the newest prompt is still cached in full, the first one is gone
    before = pool.stats().hit_tokens
    hf_pagedkv.generate(model, prompts[-1], pool=pool, **GEN)
    assert pool.stats().hit_tokens - before == 96  # 6 full blocks, all hit
    before = pool.stats().hit_tokens
    hf_pagedkv.generate(model, prompts[0], pool=pool, **GEN)
    assert pool.stats().hit_tokens - before == 0
    assert len(idle) == 20
    pool.check_invariants()


def test_a_fraction_of_a_fixed_pool():
    """`prefix_cache_memory=0.25` of a 40-block fixed pool keeps at most 10 idle blocks."""
    model = tiny_model("llama")
    pool = BlockPool(block_size=16, num_blocks=40, prefix_caching=True, prefix_cache_memory=0.25)
    for i in range(4):
        hf_pagedkv.generate(model, ids(1, 100, seed=300 + i), pool=pool, **GEN)
        assert pool.stats().blocks_cached <= 10
    assert pool.stats().blocks_cached == 10 and pool.layers.max_idle_blocks(0) == 10
    pool.check_invariants()


def test_without_a_budget_a_fixed_pool_still_evicts_only_when_it_needs_the_space():
    model = tiny_model("llama")
    pool = BlockPool(block_size=16, num_blocks=20, prefix_caching=True)
    hf_pagedkv.generate(model, ids(1, 100, seed=1), pool=pool, **GEN)  # 6 full blocks + 1 partial (released)
    assert pool.stats().blocks_cached == 6 and pool.stats().evictions == 0
    with PagedCache(pool=pool) as c:  # needs 19 blocks: 14 free, so 5 idle ones are evicted, LRU first
        model(ids(1, 19 * 16 - 3, seed=2), past_key_values=c)
        assert pool.stats().evictions == 5 and pool.stats().blocks_cached == 1
    pool.check_invariants()


@pytest.mark.parametrize("bad, match", [
    (0.0, r"in \(0, 1\]"), (1.5, r"in \(0, 1\]"), ("lots", "prefix_cache_memory"), (-3, "prefix_cache_memory"),
])
def test_bad_budgets_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        BlockPool(prefix_caching=True, prefix_cache_memory=bad)


def test_a_budget_without_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="needs BlockPool\\(prefix_caching=True\\)"):
        BlockPool(prefix_cache_memory="1GiB")


def test_the_planner_adds_the_prefix_cache_to_the_pool_in_whole_blocks():
    from hf_pagedkv.tools.planning import ModelShape, plan_capacity

    shape = ModelShape.from_config(tiny_model("llama").config)
    base = plan_capacity(shape, max_seq_len=100, batch=2, block_size=16, dtype="float32")
    plan = plan_capacity(shape, max_seq_len=100, batch=2, block_size=16, dtype="float32", prefix_cache_memory="1MiB")
    block = int(base.bytes_per_token * 16)  # 3 layers x 2 heads x (16 + 16) x 4 B x 16 tokens = 12288
    assert block == 12288 and plan.prefix_cache_bytes == (2**20 // block) * block
    assert plan.pool_blocks == base.pool_blocks + 2**20 // block
    assert plan.pool_bytes == base.pool_bytes + plan.prefix_cache_bytes and base.prefix_cache_bytes == 0
    with pytest.raises(ValueError, match="prefix_cache_memory"):
        plan_capacity(shape, max_seq_len=100, batch=2, prefix_cache_memory="a lot")
