"""`debug=True`: freed blocks are poisoned with NaN, invariants are checked after every step, and corrupted
bookkeeping or a stale read is caught at once instead of drifting silently."""

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.errors import InvariantError
from tests.conftest import ids, tiny_model
from tests.fake_kv import kv

pytestmark = pytest.mark.usefixtures("one_thread")


def block_content(pool: BlockPool, blocks: list[int]) -> list[torch.Tensor]:
    """Keys and values of every layer for the slots of `blocks`."""
    store = pool.groups[0].store
    slots = store.block_slots(blocks, torch.device("cpu"))
    out = []
    for layer in store.keys:
        out += [store.keys[layer].index_select(1, slots), store.values[layer].index_select(1, slots)]
    return out


def slot_content(pool: BlockPool, slots: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(slots)
    kv = (pool.groups[0].store.keys, pool.groups[0].store.values)
    return [t.index_select(1, idx) for store in kv for t in store.values()]


# -- poisoning ---------------------------------------------------------------------------------------------------------
def test_released_blocks_are_poisoned_with_nan():
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, debug=True)
    model.generate(ids(2, 9), past_key_values=cache, max_new_tokens=4, do_sample=False)
    blocks = sorted({b for row in cache.block_tables() for b in row})
    assert len(blocks) == 2 * 3  # 2 rows x ceil(12 / 4)
    assert all(torch.isfinite(t).all() for t in block_content(cache.pool, blocks))  # full blocks, real K/V
    cache.release()
    for t in block_content(cache.pool, blocks):
        assert t.numel() and torch.isnan(t).all()


def test_storage_never_written_is_nan_in_debug_mode():
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(1, 0, 5, label=1), layer_idx=0)  # blocks 0, 1; the pool grew to 64 blocks
    never_used = list(range(2, cache.pool.num_blocks))
    assert all(torch.isnan(t).all() for t in block_content(cache.pool, never_used))
    # The 3 empty slots of block 1 were never written either.
    assert all(torch.isnan(t).all() for t in slot_content(cache.pool, [5, 6, 7]))
    cache.release()


def test_without_debug_freed_blocks_keep_their_stale_content():
    # What debug mode guards against: outside it, a freed block still looks like valid K/V.
    model = tiny_model("llama")
    cache = PagedCache(block_size=4)
    model(ids(1, 8), past_key_values=cache)
    before = block_content(cache.pool, [0, 1])
    cache.release()
    after = block_content(cache.pool, [0, 1])
    assert all(torch.isfinite(t).all() for t in after)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_crop_poisons_dropped_blocks_and_the_tail_of_the_last_block():
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(1, 0, 10, label=1), layer_idx=0)  # blocks 0, 1, 2 (2 tokens in block 2)
    assert cache.block_tables() == [[0, 1, 2]]
    cache.crop(-3)  # 10 -> 7 tokens: block 2 is freed, slot 7 (the tail of block 1) is stale
    assert cache.block_tables() == [[0, 1]] and cache.get_seq_length() == 7
    assert all(torch.isnan(t).all() for t in block_content(cache.pool, [2]))
    assert all(torch.isnan(t).all() for t in slot_content(cache.pool, [7]))
    assert all(torch.isfinite(t).all() for t in slot_content(cache.pool, list(range(7))))
    cache.release()


def test_crop_keeps_a_shared_last_block_intact():
    # A fork still reads the cropped tail of a shared block, so it must not be poisoned.
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(1, 0, 8, label=1), layer_idx=0)
    other = cache.fork()
    cache.crop(-2)  # block 1 is shared with `other`: slots 6, 7 stay
    assert all(torch.isfinite(t).all() for t in slot_content(cache.pool, [6, 7]))
    assert other.layers[0].keys[0, 0, :, 0].tolist() == [1.0] * 8
    # The next write into the cropped cache copies block 1 first.
    cache.update(*kv(1, 6, 1, label=2), layer_idx=0)
    assert cache.block_tables() == [[0, 2]] and other.block_tables() == [[0, 1]]
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0] * 6 + [2.0]
    assert other.layers[0].keys[0, 0, :, 0].tolist() == [1.0] * 8
    cache.release(), other.release()
    assert cache.pool.stats().blocks_in_use == 0


# -- invariants after every step -----------------------------------------------------------------------------------
@pytest.mark.parametrize("debug", [True, False])
def test_invariants_are_checked_after_every_step_in_debug_mode(debug, monkeypatch):
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    calls = []
    real = pool.check_invariants
    monkeypatch.setattr(pool, "check_invariants", lambda: calls.append(1) or real())
    cache = PagedCache(pool=pool, debug=debug)
    steps = []
    handle = model.register_forward_hook(lambda *a: steps.append(len(calls)))
    try:
        model.generate(ids(1, 6), past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    finally:
        handle.remove()
    assert len(steps) == 5  # prefill + 4 decode steps
    if debug:
        assert steps == sorted(set(steps)) and steps[0] >= 1  # at least one check during every step
    else:
        assert calls == []
    cache.release()


# -- corrupted bookkeeping -----------------------------------------------------------------------------------------
@pytest.fixture
def two_caches():
    """Cache `a` (1 row: blocks 0, 1, 2) and its fork `b` sharing them, on a debug pool of block size 4."""
    pool = BlockPool(block_size=4, debug=True)
    a = PagedCache(pool=pool, debug=True)
    a.update(*kv(1, 0, 10, label=1), layer_idx=0)
    b = a.fork()
    pool.check_invariants()
    yield pool, a, b
    pool.check_invariants()  # each test undoes its corruption
    a.release(), b.release()
    assert pool.stats().blocks_in_use == 0


def test_corrupted_refcount_is_named(two_caches):
    pool = two_caches[0]
    pool.groups[0].allocator._refcount[1] += 1  # a third reference no table holds
    with pytest.raises(InvariantError, match=r"invariant 2 \(refcount == live table entries\).*1: refcount 3 vs 2"):
        pool.check_invariants()
    pool.groups[0].allocator._refcount[1] -= 1


def test_block_both_free_and_in_use_is_named(two_caches):
    pool = two_caches[0]
    pool.groups[0].allocator._free.add(2)  # a block in use put back on the free set
    with pytest.raises(InvariantError, match=r"invariant 1/5 \(free xor in use xor cached-idle\) broken: 2: refcount 2, free True"):
        pool.check_invariants()
    pool.groups[0].allocator._free.discard(2)


def test_free_block_with_refcount_is_named(two_caches):
    pool = two_caches[0]
    pool.groups[0].allocator._free.discard(5)  # a free block lost from the free set (refcount 0)
    with pytest.raises(InvariantError, match=r"invariant 1/5 .* 5: refcount 0, free False, idle False"):
        pool.check_invariants()
    pool.groups[0].allocator._free.add(5)


def test_table_with_an_extra_block_is_named(two_caches):
    pool, a, _ = two_caches
    row = a.rows.first_group[0]
    row.blocks.append(7)  # 10 tokens at block size 4 own 3 blocks, not 4
    with pytest.raises(InvariantError, match=r"invariant 3 .*ceil\(n/B\)=3.* owns 4 blocks \[0, 1, 2, 7\]"):
        pool.check_invariants()
    row.blocks.pop()


def test_table_naming_a_block_twice_is_named(two_caches):
    pool, _, b = two_caches
    row = b.rows.first_group[0]
    row.blocks[2] = 1  # [0, 1, 1]
    with pytest.raises(InvariantError, match=r"invariant 3 \(a table names a block once\) broken for blocks \[1\]"):
        pool.check_invariants()
    row.blocks[2] = 2


def test_leaked_block_is_named():
    pool = BlockPool(block_size=4)
    pool._allocate(2)  # blocks taken outside any block table
    with pytest.raises(InvariantError, match=r"invariant 2 .*\(a leak\): 0: refcount 1 vs 0 entries, 1: refcount 1"):
        pool.check_invariants()
    pool._free([0, 1])
    pool.check_invariants()


def test_corruption_during_generate_stops_the_next_step():
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, debug=True)
    pool = cache.pool
    steps = []

    def corrupt_after_prefill(*args):
        steps.append(1)
        if len(steps) == 1:
            pool.groups[0].allocator._refcount[0] += 1

    handle = model.register_forward_hook(corrupt_after_prefill)
    try:
        with pytest.raises(InvariantError, match=r"invariant 2 .*0: refcount 2 vs 1 entries"):
            model.generate(ids(1, 6), past_key_values=cache, max_new_tokens=5, do_sample=False)
    finally:
        handle.remove()
    assert len(steps) == 1  # the step after the corruption did not complete
    pool.groups[0].allocator._refcount[0] -= 1
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


# -- stale reads -------------------------------------------------------------------------------------------------------
def _free_first_block_behind_the_cache(cache: PagedCache) -> int:
    """Simulate a bookkeeping bug: the pool frees block 0 while the cache's table still names it."""
    b = cache.block_tables()[0][0]
    cache.pool._free([b])
    return b


def _undo_free(cache: PagedCache, b: int) -> None:
    cache.pool.groups[0].allocator._free.discard(b)
    cache.pool.groups[0].allocator._refcount[b] = 1


@pytest.mark.parametrize("mode", ["poison", "poison+check", "off"])
def test_stale_read_after_a_block_is_freed_behind_the_cache(mode):
    model = tiny_model("llama")
    x, nxt = ids(1, 6), ids(1, 1, seed=9)
    ref = DynamicCache()
    model(x, past_key_values=ref)
    want = model(nxt, past_key_values=ref).logits
    # "poison": the pool poisons freed blocks but the cache does not check invariants, so the stale read happens;
    # "poison+check": full debug mode; "off": neither.
    pool = BlockPool(block_size=4, debug=mode != "off")
    cache = PagedCache(pool=pool, debug=mode == "poison+check")
    model(x, past_key_values=cache)  # blocks 0, 1; the next token goes to block 1, so no block is allocated
    b = _free_first_block_behind_the_cache(cache)
    if mode == "poison+check":
        # The invariant check at the start of the step catches the bug before anything is read.
        with pytest.raises(InvariantError, match=rf"invariant 2 .*{b}: refcount 0 vs 1 entries"):
            model(nxt, past_key_values=cache)
    else:
        logits = model(nxt, past_key_values=cache).logits
        if mode == "poison":
            assert torch.isnan(logits).all()  # the stale read shows up at once
        else:
            assert torch.equal(logits, want)  # silent: the freed block still holds the old K/V
    _undo_free(cache, b)
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0
