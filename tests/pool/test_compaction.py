"""`BlockPool.compact` moves live blocks down and `shrink` gives trailing segments back: exact while
sequences are live (forks, beams, prefix-cached and quantized blocks), bounded per call, reported in stats. The
planner alone is tested in tests/blocks/test_compaction_plan.py."""

from __future__ import annotations

import pytest
import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache
from tests.conftest import ids, tiny_model
from tests.fake_kv import kv, labels

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}


def real_bytes(pool: BlockPool) -> int:
    return sum(t.untyped_storage().nbytes() for g in pool.groups for t in g.store.tensors())


def snapshot(cache: PagedCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_compaction_is_exact_for_live_forks_beams_and_prefix_cached_blocks(quant):
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, prefix_caching=True, quant=quant, debug=True)  # debug: stale reads are NaN
    fillers = [PagedCache(pool=pool) for _ in range(3)]
    for i, f in enumerate(fillers):  # hold the low block ids, released later to leave holes
        with torch.no_grad():
            model(ids(1, 22, seed=10 + i), past_key_values=f)
    a = PagedCache(pool=pool)
    model.generate(ids(1, 13, seed=1), past_key_values=a, **GEN)
    b = a.fork()  # shares every block of a
    c = PagedCache(pool=pool)
    model.generate(ids(1, 11, seed=2), past_key_values=c, num_beams=2, **GEN)  # beams share the prompt
    prompt = ids(1, 18, seed=3)
    first = hf_pagedkv.generate(model, prompt, pool=pool, **GEN)  # published, then cached-idle
    assert pool.stats().blocks_cached > 0
    for f in fillers:
        f.release()
    before = {name: snapshot(cache) for name, cache in (("a", a), ("b", b), ("c", c))}
    nxt = ids(1, 1, seed=4)
    with torch.no_grad():
        fork = a.fork()
        want = model(nxt, past_key_values=fork).logits  # the next step, computed before any move
        fork.release()
    assert pool.stats().blocks_trapped > 0
    calls = []
    while (n := pool.compact(max_blocks=3)) > 0:
        calls.append(n)
        pool.check_invariants()
        for cache in (a, b, c):
            cache.check_invariants()
    assert calls and max(calls) <= 3 and pool.stats().blocks_moved == sum(calls) >= 4
    assert pool.stats().blocks_trapped == 0
    for name, cache in (("a", a), ("b", b), ("c", c)):  # every layer reads back bit-identical
        for (k0, v0), (k1, v1) in zip(before[name], snapshot(cache)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1), name
    with torch.no_grad():
        got = model(nxt, past_key_values=a).logits  # decoding continues on the moved blocks
    assert torch.equal(got, want)
    hits = pool.stats().hit_tokens
    again = hf_pagedkv.generate(model, prompt, pool=pool, **GEN)  # the moved prefix blocks still hit
    assert pool.stats().hit_tokens - hits == 16 and torch.equal(again, first)
    for cache in (a, b, c):
        cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_a_pool_that_grew_for_a_burst_gives_its_memory_back_after_compact_and_shrink():
    """'Out of memory although usage is low': after a burst, a few live rows sit in the last segments, so the pool
    holds its peak storage and `shrink` alone returns nothing; `compact` moves them down, then `shrink` returns
    the free segments (the bytes of the real tensors drop), and the survivors read back unchanged."""
    pool = BlockPool(block_size=4)
    burst = [PagedCache(pool=pool) for _ in range(6)]
    for i, cache in enumerate(burst):
        cache.update(*kv(1, 0, 40 + 4 * i, label=10 * i), layer_idx=0)  # each growth is a segment
    s = pool.stats()
    assert s.num_segments >= 3
    survivor = burst[-1]  # the last request holds the highest block ids
    for cache in burst[:-1]:
        cache.release()
    peak = real_bytes(pool)
    assert pool.shrink() == 0 and real_bytes(pool) == peak  # its blocks pin the last segment
    while pool.compact(max_blocks=4):
        pool.check_invariants()
    returned = pool.shrink()
    assert returned > 0 and real_bytes(pool) == peak - returned == pool.stats().bytes_reserved
    assert pool.stats().bytes_returned == returned
    assert pool.num_blocks * 64 == pool.stats().bytes_reserved  # 64 B per block here
    assert pool.stats().blocks_in_use == 15 and labels(survivor) == [[50] * 60]
    survivor.check_invariants()
    survivor.update(*kv(1, 60, 30, label=50), layer_idx=0)  # and it grows again from there
    assert labels(survivor) == [[50] * 90]
    survivor.release()
    pool.check_invariants()


def test_a_fixed_pool_keeps_its_storage_and_compact_checks_its_argument():
    pool = BlockPool(block_size=4, num_blocks=8)
    with PagedCache(pool=pool) as a, PagedCache(pool=pool) as b:
        a.update(*kv(1, 0, 8, label=1), layer_idx=0)
        b.update(*kv(1, 0, 8, label=2), layer_idx=0)
    assert pool.shrink() == 0 and pool.num_blocks == 8
    with pytest.raises(ValueError, match="max_blocks"):
        pool.compact(max_blocks=0)


def test_compact_makes_a_single_row_readable_as_a_view_again_with_outputs_unchanged():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, debug=True)
    other = PagedCache(pool=pool)
    a = PagedCache(pool=pool)
    prompt = ids(1, 6, seed=4)
    with torch.no_grad():  # interleave a and other so that a's blocks are not consecutive
        for step in range(4):
            model(ids(1, 4, seed=20 + step), past_key_values=other)
            model(prompt if step == 0 else ids(1, 3, seed=30 + step), past_key_values=a)
    pool.check_invariants()
    blocks = a.block_tables()[0]
    assert blocks != list(range(blocks[0], blocks[0] + len(blocks)))  # scattered: a gather per read
    before = snapshot(a)
    other.release()
    moved = 0
    while (n := pool.compact(max_blocks=8)):  # a row moves up only whole: max_blocks >= its blocks
        moved += n
        pool.check_invariants()
    blocks = a.block_tables()[0]
    assert moved > 0 and blocks == list(range(blocks[0], blocks[0] + len(blocks)))
    for (k0, v0), (k1, v1) in zip(before, snapshot(a)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with torch.no_grad():
        model(ids(1, 1, seed=5), past_key_values=a)
    pool.check_invariants()
    a.release()
    pool.check_invariants()


def test_a_pool_with_shrink_after_gives_its_free_segments_back_by_itself_once_idle():
    pool = BlockPool(block_size=4, shrink_after=0.05)
    caches = [PagedCache(pool=pool) for _ in range(3)]
    for i, cache in enumerate(caches):
        cache.update(*kv(1, 0, 40, label=i), layer_idx=0)  # 10 blocks each: the pool grows in segments
    keep = caches[0]
    grown = real_bytes(pool)
    for cache in caches[1:]:
        cache.release()
    import time  # noqa: PLC0415
    deadline = time.monotonic() + 10  # the timer fires after 0.05 s idle; allow a loaded machine its delays
    while real_bytes(pool) == grown and time.monotonic() < deadline:
        time.sleep(0.02)
    with pool.lock:
        pool.check_invariants()
        assert real_bytes(pool) < grown and pool.stats().bytes_returned == grown - real_bytes(pool)
    assert pool.idle_shrink.num_shrinks >= 1 and labels(keep) == [[0] * 40]  # the live cache is untouched
    keep.update(*kv(1, 0, 8, label=7), layer_idx=0)  # and goes on (the pool grows again if it must)
    pool.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, "5s", True, float("inf"), float("nan"), 1e300])
def test_shrink_after_must_be_seconds_for_a_growable_pool(bad):
    with pytest.raises(ValueError, match="shrink_after"):
        BlockPool(shrink_after=bad)
    with pytest.raises(ValueError, match="growable"):
        BlockPool(num_blocks=8, shrink_after=1.0)
