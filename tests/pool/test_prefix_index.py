"""Prefix index and cached-idle blocks, as stories on a bare pool (no model, milliseconds)."""

import gc
import threading

import pytest

from hf_pagedkv import BlockPool, PoolExhaustedError
from hf_pagedkv.errors import InvariantError
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.prefix_index import hash_blocks

B = 4
KEY = b"model-a"


def hold(pool: BlockPool, blocks: list[int], num_tokens: int) -> int:
    """Register a live block table naming `blocks` (what a cache does); return its owner token."""
    row = BlockTable()
    row.append(blocks)
    row.num_tokens = num_tokens
    fills = [min(B, num_tokens - j * B) for j in range(len(blocks))]
    pool.groups[0].mark_written(blocks, fills)  # as a cache's write does
    return pool._register_owner([row])


def release(pool: BlockPool, owner: int) -> None:
    pool.owners.release(owner)
    pool.check_invariants()  # also frees the queued owner


def refcounts(pool: BlockPool) -> list[int]:
    return [pool.groups[0].allocator.refcount(b) for b in range(pool.num_blocks)]


def snapshot(pool: BlockPool):
    """Everything a failed operation must leave unchanged."""
    index = pool.groups[0].prefix_index
    free = pool.groups[0].allocator.free_blocks()
    return (refcounts(pool), free, index.idle_blocks(), index.published(), pool.stats())


def test_story_publish_hit_idle_revive():
    pool = BlockPool(block_size=B, num_blocks=8, prefix_caching=True)
    prompt_a = list(range(10, 22))  # 12 tokens = 3 full blocks
    # request A computes its prompt into 3 fresh blocks and publishes them
    blocks_a = pool._allocate(3)
    assert blocks_a == [0, 1, 2]
    owner_a = hold(pool, blocks_a, 12)
    assert pool.groups[0].publish(hash_blocks(prompt_a, B, KEY), blocks_a) == 3
    pool.check_invariants()
    # request B shares A's first 2 blocks, then diverges inside block 2: it hits exactly blocks 0 and 1
    prompt_b = prompt_a[:9] + [90, 91, 92, 93]
    hit = pool._acquire_prefix(hash_blocks(prompt_b[:-1], B, KEY), len(prompt_b))
    assert hit == [0, 1]
    owner_b = hold(pool, hit + pool._allocate(2, after=1), 13)
    assert refcounts(pool)[:5] == [2, 2, 1, 1, 1]
    pool.check_invariants()
    # A finishes: blocks 0, 1 stay in use by B; block 2 is cached-idle (refcount 0, still published)
    release(pool, owner_a)
    assert refcounts(pool)[:5] == [1, 1, 0, 1, 1]
    assert pool.groups[0].prefix_index.idle_blocks() == [2]
    assert pool.groups[0].allocator.free_blocks() == {5, 6, 7}
    s = pool.stats()
    assert (s.blocks_in_use, s.blocks_cached, s.blocks_free) == (4, 1, 3)
    # request C repeats A's prompt plus one token: hits all 3 blocks, reviving the idle one
    hit = pool._acquire_prefix(hash_blocks(prompt_a, B, KEY), 13)
    assert hit == [0, 1, 2] and pool.groups[0].prefix_index.idle_blocks() == []
    owner_c = hold(pool, hit, 12)
    assert refcounts(pool)[:3] == [2, 2, 1]
    s = pool.stats()
    assert (s.lookups, s.lookup_tokens, s.hit_tokens) == (2, 26, 20)
    assert s.hit_rate == pytest.approx(20 / 26)
    release(pool, owner_b)
    release(pool, owner_c)
    # nothing in use; A's 3 blocks cached-idle with the tail first in eviction order; B's unpublished blocks free
    assert refcounts(pool) == [0] * 8
    assert pool.groups[0].prefix_index.idle_blocks() == [2, 1, 0]
    assert pool.stats().blocks_in_use == 0


def test_story_lru_eviction_clears_hashes_and_is_all_or_nothing():
    pool = BlockPool(block_size=B, num_blocks=6, prefix_caching=True)
    old, new = list(range(100, 108)), list(range(200, 208))  # two 2-block prompts
    for prompt in (old, new):  # each computed, published, then finished: 4 cached-idle blocks
        blocks = pool._allocate(2)
        owner = hold(pool, blocks, 8)
        pool.groups[0].publish(hash_blocks(prompt, B, KEY), blocks)
        release(pool, owner)
    assert pool.groups[0].prefix_index.idle_blocks() == [1, 0, 3, 2]  # old's tail, old's head, new's tail, new's head
    assert pool.groups[0].allocator.free_blocks() == {4, 5}
    # a request needing 7 blocks cannot be served (2 free + 4 idle): it fails and changes nothing
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match="7 blocks needed, 2 free and 4 cached-idle"):
        pool._allocate(7)
    assert snapshot(pool) == before
    # a request needing 3 blocks takes the 2 free ones and evicts the least recently released idle block
    owner = hold(pool, pool._allocate(3), 12)
    s = pool.stats()
    assert (s.evictions, s.blocks_cached, s.blocks_free) == (1, 3, 0)
    index = pool.groups[0].prefix_index
    assert index.idle_blocks() == [0, 3, 2] and 1 not in index  # hash cleared on reuse
    pool.check_invariants()
    # old's prompt now hits only its head block; new's prompt still hits both
    assert pool.groups[0].prefix_index.match(hash_blocks(old, B, KEY)) == [0]
    assert pool.groups[0].prefix_index.match(hash_blocks(new, B, KEY)) == [2, 3]
    release(pool, owner)
    assert pool.stats().blocks_in_use == 0


def test_growable_pool_grows_rather_than_evicting_within_the_prefix_budget():
    """Evicting idle blocks before every growth would keep no prefix across requests. Within the prefix cache's
    budget (1 GiB by default) a growable pool grows instead, and the cached prefix still hits."""
    pool = BlockPool(block_size=B, prefix_caching=True)
    pool._reserve(1)
    n = pool.num_blocks
    blocks = pool._allocate(n)
    owner = hold(pool, blocks, n * B)
    pool.groups[0].publish(hash_blocks(list(range(n * B)), B, KEY), blocks)
    release(pool, owner)
    assert pool.stats().blocks_cached == n
    owner = hold(pool, pool._allocate(n), n * B)  # served by growing, not by evicting
    assert pool.num_blocks > n and pool.stats().evictions == 0 and pool.stats().blocks_cached == n
    assert pool.groups[0].prefix_index.match(hash_blocks(list(range(n * B)), B, KEY)) == blocks
    pool.check_invariants()
    release(pool, owner)


def test_publish_rules():
    pool = BlockPool(block_size=B, num_blocks=8, prefix_caching=True)
    prompt = list(range(8))
    a = pool._allocate(2)
    owner_a = hold(pool, a, 8)
    b = pool._allocate(2)
    owner_b = hold(pool, b, 8)
    assert pool.groups[0].publish(hash_blocks(prompt, B, KEY), a) == 2
    # the same content computed twice: the first block published keeps the name, the copy stays unpublished
    assert pool.groups[0].publish(hash_blocks(prompt, B, KEY), b) == 0
    assert pool.groups[0].publish(hash_blocks(prompt, B, KEY), a) == 0  # idempotent
    with pytest.raises(ValueError, match="already published for other tokens"):
        pool.groups[0].publish(hash_blocks([7] * 8, B, KEY), a)
    release(pool, owner_a)
    release(pool, owner_b)
    assert sorted(pool.groups[0].prefix_index.idle_blocks()) == a and set(b) <= pool.groups[0].allocator.free_blocks()


def test_invariants_catch_a_broken_idle_state():
    pool = BlockPool(block_size=B, num_blocks=4, prefix_caching=True)
    blocks = pool._allocate(1)
    owner = hold(pool, blocks, B)
    pool.groups[0].publish(hash_blocks(list(range(B)), B, KEY), blocks)
    release(pool, owner)
    pool.groups[0].allocator._free.add(blocks[0])  # the block is now both cached-idle and free
    with pytest.raises(InvariantError, match="free xor in use xor cached-idle"):
        pool.check_invariants()


def test_garbage_collected_owner_is_freed_at_the_next_pool_operation():
    from hf_pagedkv import PagedCache

    pool = BlockPool(block_size=B, num_blocks=4, prefix_caching=True)
    cache = PagedCache(pool=pool)
    with pool.lock:
        cache.rows.attach(2, {0: (0, pool._allocate(2))})  # a cache holding 2 blocks, never released
    pool.lock.acquire()  # as if this thread were in the middle of a pool operation when the GC runs
    try:
        del cache
        gc.collect()
        assert refcounts(pool)[:2] == [1, 1]  # queued, not freed in the middle of the operation
    finally:
        pool.lock.release()
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()


def test_threads_hammering_one_pool_keep_the_invariants():
    pool = BlockPool(block_size=B, num_blocks=48, prefix_caching=True)
    prompts = [[p] * 4 + list(range(q, q + 8)) for p in range(3) for q in range(3)]  # shared first blocks
    errors = []

    def worker(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        try:
            for _ in range(300):
                prompt = rnd.choice(prompts)
                hashes = hash_blocks(prompt, B, KEY)
                with pool.lock:
                    hit = pool._acquire_prefix(hashes, len(prompt))
                    rest = pool._allocate(len(hashes) - len(hit))
                    owner = hold(pool, hit + rest, len(prompt))
                pool.groups[0].publish(hashes, hit + rest)
                if rnd.random() < 0.2:
                    pool.check_invariants()
                pool.owners.release(owner)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check_invariants()
    s = pool.stats()
    assert s.blocks_in_use == 0 and s.lookups == 1200 and s.hit_tokens > 0
