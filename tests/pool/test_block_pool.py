"""Story-style tests of `BlockPool`: exact stats, copy-on-write block ids, growth in chunks, fixed sizes.

Caches are driven through the real `PagedCache.update` with fake K/V (`tests/fake_kv.py`: 1 layer, 1 KV head,
head_dim 2), where each token's K/V encodes a label and its position, so what a row reads back names its write.
"""

import gc
import math

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError
from tests.conftest import ids, tiny_model
from tests.fake_kv import BYTES_PER_TOKEN, kv, labels

pytestmark = pytest.mark.usefixtures("one_thread")


def test_story_stats_through_fork_copy_on_write_and_release():
    pool = BlockPool(block_size=4)
    # A new growable pool holds nothing until the first update.
    s = pool.stats()
    assert (s.num_blocks, s.blocks_in_use, s.blocks_free, s.tokens_stored, s.bytes_in_use, s.bytes_reserved,
            s.fragmentation) == (0, 0, 0, 0, 0, 0, 0.0)

    # Cache A prefills 10 tokens: blocks 0, 1 full and block 2 holding 2 tokens. The pool grew by the 3 blocks
    # needed plus a headroom of 16.
    a = PagedCache(pool=pool)
    a.update(*kv(1, 0, 10, label=100), layer_idx=0)
    assert a.block_tables() == [[0, 1, 2]]
    s = pool.stats()
    assert s.block_size == 4 and s.bytes_per_block == 4 * BYTES_PER_TOKEN == 64
    assert (s.num_blocks, s.blocks_in_use, s.blocks_free, s.tokens_stored, s.num_sequences) == (19, 3, 16, 10, 1)
    assert s.bytes_in_use == 3 * 64 and s.bytes_reserved == 19 * 64
    assert s.fragmentation == pytest.approx(1 - 10 / 12)  # 2 empty slots in 12 allocated
    assert s.usage == pytest.approx(3 / 19)
    pool.check_invariants()

    # B = A.fork(): shares every block; no block is allocated and shared tokens count once.
    b = a.fork()
    assert b.block_tables() == [[0, 1, 2]]
    assert [pool.groups[0].allocator.refcount(x) for x in (0, 1, 2)] == [2, 2, 2]
    s = pool.stats()
    assert (s.blocks_in_use, s.tokens_stored, s.num_sequences) == (3, 10, 2)
    pool.check_invariants()

    # B appends 1 token: its last block (2) is shared, so B copies it into the lowest free block (3) first.
    b.update(*kv(1, 10, 1, label=200), layer_idx=0)
    assert a.block_tables() == [[0, 1, 2]] and b.block_tables() == [[0, 1, 3]]
    assert [pool.groups[0].allocator.refcount(x) for x in (0, 1, 2, 3)] == [2, 2, 1, 1]
    s = pool.stats()
    assert (s.blocks_in_use, s.tokens_stored) == (4, 4 + 4 + 2 + 3)
    assert s.fragmentation == pytest.approx(1 - 13 / 16)
    assert labels(b) == [[100] * 10 + [200]]
    pool.check_invariants()

    # A appends 3 tokens: its block 2 is no longer shared (written in place), then one new block; 3 is taken, so
    # the lowest free id (4) follows.
    a.update(*kv(1, 10, 3, label=300), layer_idx=0)
    assert a.block_tables() == [[0, 1, 2, 4]]
    s = pool.stats()
    assert (s.blocks_in_use, s.blocks_free, s.tokens_stored) == (5, 14, 4 + 4 + 4 + 3 + 1)
    assert s.fragmentation == pytest.approx(1 - 16 / 20)
    assert labels(a) == [[100] * 10 + [300] * 3]
    assert labels(b) == [[100] * 10 + [200]]  # B did not see A's writes
    pool.check_invariants()

    # A is released: its own blocks 2 and 4 are freed, the shared 0 and 1 stay with B.
    a.release()
    assert [pool.groups[0].allocator.refcount(x) for x in range(5)] == [1, 1, 0, 1, 0]
    s = pool.stats()
    assert (s.blocks_in_use, s.tokens_stored, s.num_sequences) == (3, 11, 1)
    pool.check_invariants()

    # B is released: nothing is in use, but the storage stays reserved for reuse.
    b.release()
    s = pool.stats()
    assert (s.num_blocks, s.blocks_in_use, s.blocks_free, s.tokens_stored, s.num_sequences) == (19, 0, 19, 0, 0)
    assert (s.bytes_in_use, s.bytes_reserved, s.fragmentation) == (0, 19 * 64, 0.0)
    pool.check_invariants()


def test_story_a_new_cache_reuses_freed_blocks_lowest_first():
    pool = BlockPool(block_size=2)
    a, b = PagedCache(pool=pool), PagedCache(pool=pool)
    # A takes blocks 0..2 (5 tokens), B takes 3..4 (4 tokens).
    a.update(*kv(1, 0, 5, label=1), layer_idx=0)
    b.update(*kv(1, 0, 4, label=2), layer_idx=0)
    assert a.block_tables() == [[0, 1, 2]] and b.block_tables() == [[3, 4]]
    # A is released; C (3 blocks) gets A's old ids back, lowest first and consecutive.
    a.release()
    c = PagedCache(pool=pool)
    c.update(*kv(1, 0, 6, label=3), layer_idx=0)
    assert c.block_tables() == [[0, 1, 2]]
    # B grows by one block: 5 follows its last block 4.
    b.update(*kv(1, 4, 1, label=4), layer_idx=0)
    assert b.block_tables() == [[3, 4, 5]]
    assert labels(c) == [[3] * 6] and labels(b) == [[2] * 4 + [4]]
    pool.check_invariants()
    b.release(), c.release()
    assert pool.stats().blocks_in_use == 0


def test_story_batch_rows_and_exact_multiples():
    pool = BlockPool(block_size=4)
    cache = PagedCache(pool=pool)
    # A batch of 2 different rows prefills exactly 2 blocks each: 2 blocks per row, never a third. The rows are
    # laid out evenly, each followed by free room of its own length (for its decode steps), so the batch is read
    # as one strided view of the pool.
    cache.update(*kv(2, 0, 8, label=10), layer_idx=0)
    assert cache.block_tables() == [[0, 1], [4, 5]]
    assert pool.stats().tokens_stored == 16 and pool.stats().fragmentation == 0.0
    # One more token each: each row takes one new block, right after its own last block when free.
    cache.update(*kv(2, 8, 1, label=20), layer_idx=0)
    assert cache.block_tables() == [[0, 1, 2], [4, 5, 6]]
    assert labels(cache) == [[10] * 8 + [20], [11] * 8 + [21]]
    # Beam-style reorder: both rows become copies of row 1; row 0's blocks are freed, row 1's are shared.
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.block_tables() == [[4, 5, 6], [4, 5, 6]]
    assert [pool.groups[0].allocator.refcount(x) for x in range(7)] == [0, 0, 0, 0, 2, 2, 2]
    assert pool.groups[0].allocator.free_blocks() >= {0, 1, 2, 3}
    pool.check_invariants()
    # Crop 5 tokens (9 -> 4): exactly one block per row remains.
    cache.crop(-5)
    assert cache.block_tables() == [[4], [4]] and cache.get_seq_length() == 4
    assert pool.stats().blocks_in_use == 1
    pool.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_a_cache_that_is_never_released_frees_its_blocks_when_collected():
    pool = BlockPool(block_size=4, debug=True)
    cache = PagedCache(pool=pool)
    cache.update(*kv(2, 0, 9, label=1), layer_idx=0)
    other = cache.fork()
    assert pool.stats().blocks_in_use == 6
    # The first cache is dropped without release(): its references go, the fork keeps the blocks alive.
    del cache
    gc.collect()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 6 and pool.stats().num_sequences == 2
    assert labels(other) == [[1] * 9, [2] * 9]
    # The fork is dropped too: nothing leaks.
    del other
    gc.collect()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().num_sequences == 0


def test_growable_pool_grows_in_chunks():
    """A growable pool grows by what is missing plus a headroom of max(a quarter of its size, 16) blocks."""
    B = 2
    pool = BlockPool(block_size=B)
    cache = PagedCache(pool=pool)
    # The first token needs 1 block: the pool grows by 1 + 16 blocks, not by one block.
    cache.update(*kv(1, 0, 1, label=7), layer_idx=0)
    assert pool.num_blocks == 17 and pool.groups[0].store.keys[0].shape == (1, 17 * B, 2)
    # Filling all 17 blocks (34 tokens) does not grow the pool ...
    cache.update(*kv(1, 1, 33, label=7), layer_idx=0)
    assert pool.num_blocks == 17 and pool.stats().blocks_free == 0
    # ... the next token does: 1 missing + max(17 // 4, 16) = 17 blocks.
    cache.update(*kv(1, 34, 1, label=8), layer_idx=0)
    assert pool.num_blocks == 34 and pool.groups[0].store.keys[0].shape == (1, 34 * B, 2)
    # A request larger than the free blocks: 35 -> 434 tokens is 18 -> 217 blocks, 199 wanted, 16 free, so
    # 183 missing + max(34 // 4, 16) = 199 blocks: the pool is sized to the need, plus 16.
    cache.update(*kv(1, 35, 399, label=9), layer_idx=0)
    assert pool.num_blocks == 233 and pool.stats().blocks_free == 16
    # Filling the headroom (466 tokens = 233 blocks) does not grow; one more token grows by 1 + 233 // 4.
    cache.update(*kv(1, 434, 32, label=10), layer_idx=0)
    assert pool.num_blocks == 233 and pool.stats().blocks_free == 0
    cache.update(*kv(1, 466, 1, label=11), layer_idx=0)
    assert pool.num_blocks == 233 + 1 + 58
    # Growing kept the old content: every token reads back as written.
    assert labels(cache) == [[7] * 34 + [8] + [9] * 399 + [10] * 32 + [11]]
    assert pool.stats().tokens_stored == 467
    pool.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0 and pool.num_blocks == 292  # storage is kept for reuse


def test_fixed_pool_preallocates_once_and_never_grows():
    pool = BlockPool(block_size=4, num_blocks=5)
    assert pool.num_blocks == 5 and not pool.growable
    cache = PagedCache(pool=pool)
    cache.update(*kv(1, 0, 20, label=1), layer_idx=0)  # exactly 5 blocks
    assert cache.block_tables() == [[0, 1, 2, 3, 4]]
    assert pool.groups[0].store.keys[0].shape == (1, 20, 2)
    with pytest.raises(PoolExhaustedError, match="1 block needed, 0 free of 5"):
        cache.update(*kv(1, 20, 1, label=2), layer_idx=0)
    assert pool.num_blocks == 5 and pool.groups[0].store.keys[0].shape == (1, 20, 2)
    assert labels(cache) == [[1] * 20]
    pool.check_invariants()
    cache.release()
    assert pool.stats().blocks_free == 5


def test_max_memory_sizes_the_pool_from_the_model_config():
    model = tiny_model("llama")  # 3 layers, 2 KV heads, head_dim 16, fp32
    B = 16
    per_block = 3 * 2 * (16 + 16) * 4 * B  # layers x kv heads x (key_dim + value_dim) x bytes x tokens = 12288
    cache = PagedCache(block_size=B, config=model.config, max_memory="1MiB", debug=True)
    pool = cache.pool
    assert pool.max_memory == 2**20 and not pool.growable
    # Sized when the first layer's shapes are known (the first update), then never resized.
    x = ids(1, 40)
    out = model.generate(x, past_key_values=cache, max_new_tokens=5, do_sample=False)
    expected = 2**20 // per_block  # 85 blocks
    s = pool.stats()
    assert s.bytes_per_block == per_block
    assert s.num_blocks == expected and s.bytes_reserved == expected * per_block <= 2**20
    assert s.blocks_in_use == math.ceil(44 / B) and s.tokens_stored == 44
    assert torch.equal(out, model.generate(x, max_new_tokens=5, do_sample=False))
    # A prompt needing more than 85 blocks does not fit: it fails before anything changes.
    before = pool.stats()
    big = PagedCache(pool=pool, config=model.config)
    with pytest.raises(PoolExhaustedError, match=r"86 blocks needed, 82 free of 85.*max_memory"):
        model(ids(1, 85 * B + 1, seed=3), past_key_values=big)
    after = pool.stats()
    assert (after.num_blocks, after.blocks_in_use, after.blocks_free, after.tokens_stored) == (
        before.num_blocks, before.blocks_in_use, before.blocks_free, before.tokens_stored)
    pool.check_invariants()
    big.release()
    cache.release()
    assert pool.stats().blocks_in_use == 0 and pool.num_blocks == expected


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536),
                                           (4096, 4096)])
def test_max_memory_parses_sizes(text, expected):
    pool = BlockPool(max_memory=text)
    assert pool.max_memory == expected and pool.num_blocks == 0 and not pool.growable
