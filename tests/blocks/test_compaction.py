"""`BlockPool.compact` moves live blocks down and `shrink` gives trailing segments back: exact while
sequences are live (forks, beams, prefix-cached and quantized blocks), bounded per call, reported in stats."""

from __future__ import annotations

import pytest
import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.compaction import num_trapped_free, plan_moves
from tests.conftest import ids, tiny_model
from tests.fake_kv import kv, labels

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}


def real_bytes(pool: BlockPool) -> int:
    return sum(t.untyped_storage().nbytes() for g in pool.groups for t in g.store.tensors())


def snapshot(cache: PagedCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_plan_moves_packs_the_highest_live_blocks_into_the_lowest_holes():
    alloc = BlockAllocator()
    alloc.add_blocks(6)
    assert alloc.allocate(6) == [0, 1, 2, 3, 4, 5]
    alloc.decref([1, 3])  # [ 0 live | 1 free | 2 live | 3 free | 4 live | 5 live ]
    assert num_trapped_free(alloc) == 2
    assert plan_moves(alloc, 10) == {5: 1, 4: 3}
    assert plan_moves(alloc, 1) == {5: 1}  # bounded
    for s, d in plan_moves(alloc, 10).items():
        alloc.move(s, d)
    assert alloc.free_blocks() == {4, 5} and num_trapped_free(alloc) == 0 and plan_moves(alloc, 10) == {}
    assert [alloc.refcount(b) for b in range(6)] == [1, 1, 1, 1, 0, 0]


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


def test_plan_moves_makes_rows_consecutive_in_one_segment_before_packing_loose_blocks():
    alloc = BlockAllocator()
    alloc.add_blocks(8)
    assert alloc.allocate(8) == list(range(8))
    alloc.decref([1, 2, 5, 6])  # [ 0 A | 1 free | 2 free | 3 A | 4 idle | 5 free | 6 free | 7 B ]
    rows = [[0, 3], [7]]
    moves = plan_moves(alloc, 10, rows, segment_blocks=[4, 4])
    # highest row first: B down to the lowest hole, 1; A has no place reached by moves down, but no other row shares
    # its blocks: it moves whole, 0 up to 2 (3 stays); the loose 4 has no hole below it left
    assert moves == {7: 1, 0: 2}
    assert plan_moves(alloc, 1, rows, [4, 4]) == {7: 1}  # bounded: A's move would be one more than the budget
    # without B as a row, 7 is loose: A takes 0, 1 (its 0 stays), then 7 packs into the lowest hole left
    assert plan_moves(alloc, 10, [[0, 3]], segment_blocks=[2, 6]) == {3: 1, 7: 2}
    # a row never moves to a place that crosses a segment: with segments [2, 6], [3, 4] cannot go to 1, 2
    assert plan_moves(alloc, 10, [[3, 4]], segment_blocks=[2, 6]) == {7: 1}  # it stays; the loose 7 packs
    assert plan_moves(alloc, 10, [[3, 4]]) == {3: 1, 4: 2, 7: 5}  # one segment: it moves to 1, 2
    for s, d in moves.items():
        alloc.move(s, d)
    assert plan_moves(alloc, 10, [[2, 3], [1]], [4, 4]) == {1: 0}  # A stays; B packs down


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


@pytest.mark.parametrize("seed", range(40))
def test_repeated_compaction_plans_are_valid_and_end(seed):
    """Seeded fuzz of the planner alone: random live blocks, rows (some sharing blocks, as beams do), segments and
    budgets. Every plan moves live blocks to free ones, no destination is a source, and calling again until the
    plan is empty ends well within a bound."""
    import random  # noqa: PLC0415
    rnd = random.Random(seed)
    n = rnd.randint(4, 40)
    alloc = BlockAllocator()
    alloc.add_blocks(n)
    alloc.allocate(n)
    live = set(rnd.sample(range(n), rnd.randint(1, n)))
    alloc.decref([b for b in range(n) if b not in live])
    rows, pool_live = [], sorted(live)
    while pool_live and rnd.random() < 0.8:
        row = rnd.sample(pool_live, rnd.randint(1, min(6, len(pool_live))))
        if rows and rnd.random() < 0.3:  # a beam: shares a prefix of an earlier row
            base = rnd.choice(rows)
            row = base[: rnd.randint(1, len(base))] + [b for b in row if b not in base]
        rows.append(row)
        for b in row:
            pool_live.remove(b) if b in pool_live and rnd.random() < 0.7 else None
    for row in rows:  # refcount = table entries (+1 for blocks no row names: cached-idle stand-ins)
        for b in row:
            alloc.incref([b])
    for b in live:
        if any(b in row for row in rows):
            alloc.decref([b])
    segments, left = [], n
    while left:
        segments.append(rnd.randint(1, left))
        left -= segments[-1]
    max_blocks = rnd.randint(1, 8)
    for _ in range(4 * n + 10):
        moves = plan_moves(alloc, max_blocks, rows, segments)
        if not moves:
            break
        free = alloc.free_blocks()
        assert len(moves) <= max_blocks and all(d in free and s not in free for s, d in moves.items())
        assert not set(moves) & set(moves.values())
        for s, d in moves.items():
            alloc.move(s, d)
        rows = [[moves.get(b, b) for b in row] for row in rows]
    else:
        pytest.fail("compaction did not end")


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
