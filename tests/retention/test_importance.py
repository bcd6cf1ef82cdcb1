"""Query-free importance policies (`KeyNorm`, `KeyDiff`): every (layer, KV head) keeps the same number of tokens,
compacted into fresh blocks, and the blocks beyond the budget go back to the pool -- checked against a
`DynamicCache` compacted by hand (plain top-k) and run at the true positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import KVzip, KVzipScoring, KeyDiff, KeyNorm, SinkWindow
from hf_pagedkv.blocks.block_table import num_blocks_for
from tests.conftest import ids, tiny_model
from tests.retention.reference import compacted_dynamic_reference, run_steps
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4
STEPS = [21, 1, 1, 6, 1, 1, 1, 9, 1, 1, 2, 1]
POLICIES = [KeyNorm, KeyDiff]


@pytest.fixture(scope="module")
def llama(one_thread):
    return tiny_model("llama")


@pytest.mark.parametrize("policy_cls", POLICIES)
@pytest.mark.parametrize("budget, sink, recent", [(14, 2, 4), (9, 0, 0)])
def test_outputs_equal_a_hand_compacted_dynamic_cache(llama, policy_cls, budget, sink, recent):
    x = ids(1, sum(STEPS), seed=8)
    policy = policy_cls(budget=budget, sink_tokens=sink, recent_tokens=recent)
    cache = PagedCache(block_size=B, config=llama.config, retention=policy, debug=True)
    got = run_steps(llama, x, STEPS, cache, before=lambda c, s, q: c.check_invariants())
    want = compacted_dynamic_reference(llama, x, STEPS, budget, policy.name, sink, recent)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL  # different kernels' shapes: reassociated sums only
    full = run_steps(llama, x, STEPS, DynamicCache(config=llama.config))
    assert (got - full).abs().max() > 1e-2  # the eviction really changed what attention saw
    stats = cache.retention_stats()
    assert stats.tokens_seen == sum(STEPS) == cache.get_seq_length()
    assert stats.tokens_held == budget + STEPS[-1]
    assert cache.pool.stats().blocks_in_use == num_blocks_for(budget + STEPS[-1], B)
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_each_head_keeps_its_own_tokens(llama):
    x = ids(1, 30, seed=9)
    policy = KeyNorm(budget=12, sink_tokens=0, recent_tokens=0)
    cache = PagedCache(block_size=B, config=llama.config, retention=policy)
    run_steps(llama, x, [30], cache)
    before = [layer.keys.clone() for layer in cache.layers]  # [1, heads, 30, dim]
    run_steps(llama, ids(1, 1, seed=1), [1], cache)
    for layer, keys in zip(cache.layers, before):
        norms = keys.norm(dim=-1)[0]  # [heads, 30]
        want = norms.topk(12, largest=False).indices.sort().values  # [heads, 12]: the lowest norms, in order
        got = layer.keys[0, :, :12]  # the compacted slots
        assert torch.equal(got, keys[0].gather(1, want[..., None].expand(-1, -1, keys.shape[-1])))
    heads = [set(i.tolist()) for i in keys.norm(dim=-1)[0].topk(12, largest=False).indices]
    assert heads[0] != heads[1]  # heads kept different tokens in the same slots
    cache.release()


def test_a_stream_holds_the_budget_in_a_fixed_pool(llama):
    budget = 32
    pool = BlockPool(block_size=B, num_blocks=2 * num_blocks_for(budget + 1, B) + 2)  # budget + a compaction's copy
    cache = PagedCache(pool=pool, config=llama.config, retention=KeyNorm(budget=budget, recent_tokens=8))
    out = llama.generate(ids(1, 8, seed=1), **cache_kwargs(cache), max_new_tokens=200, min_new_tokens=200,
                         do_sample=False)
    assert out.shape[1] == 208 and cache.get_seq_length() == 207
    stats = pool.stats()
    assert stats.blocks_in_use == num_blocks_for(budget + 1, B)  # the budget plus this step's token
    assert stats.bytes_in_use == stats.blocks_in_use * stats.bytes_per_block
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_compression_ratio_compacts_the_prompt_once(llama):
    x = ids(1, 40, seed=2)
    cache = PagedCache(block_size=B, config=llama.config, retention=KeyDiff(compression_ratio=0.5, sink_tokens=2,
                                                                               recent_tokens=4))
    run_steps(llama, x, [32, 5, 1, 1, 1], cache)  # a context, then a question and its answer
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (40, 16 + 8, 1)
    want = compacted_dynamic_reference(llama, x, [32, 5, 1, 1, 1], 16, "key_diff", 2, 4, only_step=1)
    got = run_steps(llama, x, [32, 5, 1, 1, 1], PagedCache(block_size=B, config=llama.config,
                                                          retention=KeyDiff(compression_ratio=0.5, sink_tokens=2,
                                                                            recent_tokens=4)))
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    cache.release()


def test_identical_rows_share_the_compacted_blocks_and_beams_work(llama):
    x = ids(1, 21, seed=3).repeat(2, 1)  # two identical rows (as num_return_sequences makes)
    cache = PagedCache(block_size=B, config=llama.config, retention=KeyNorm(budget=10, recent_tokens=2), debug=True)
    run_steps(llama, x, [20, 1], cache)
    a, b = cache.block_tables()  # compacted once: both rows name the same full blocks (the partial last block was
    assert len(a) == 3 and a[:2] == b[:2]  # copied on the decode write, as without retention)
    assert all(cache.pool.groups[0].allocator.refcount(blk) == 2 for blk in a[:2])
    cache.release()
    pool = BlockPool(block_size=B)
    beams = PagedCache(pool=pool, config=llama.config, retention=KeyNorm(budget=12, recent_tokens=4), debug=True)
    out = llama.generate(ids(1, 10, seed=4), **cache_kwargs(beams), num_beams=3, num_return_sequences=2,
                         max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out.shape == (2, 30) and beams.retention_stats().tokens_evicted > 0
    beams.check_invariants()
    beams.release()
    assert pool.stats().blocks_in_use == 0


def test_quantized_pool_compacts_and_re_encodes(llama):
    x = ids(1, sum(STEPS), seed=8)
    policy = KeyNorm(budget=14, sink_tokens=2, recent_tokens=4)
    fp = run_steps(llama, x, STEPS, PagedCache(block_size=B, config=llama.config, retention=policy))
    q8 = PagedCache(block_size=B, config=llama.config, retention=policy, quant="k8v8", debug=True)
    got = run_steps(llama, x, STEPS, q8, before=lambda c, s, q: c.check_invariants())
    # int8 twice (the compaction re-encodes); the kept sets may differ by near-ties of the decoded norms
    assert (got - fp).abs().max() < 0.1
    assert q8.pool.stats().blocks_in_use == num_blocks_for(14 + STEPS[-1], B)
    q8.check_invariants()
    q8.release()


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_recent_share_keeps_that_share_of_the_budget_as_a_recent_window(llama, policy_cls):
    # H2O's split: of 14 kept tokens, the last int(0.5 * 14) = 7 held ones are kept whatever their score
    x = ids(1, sum(STEPS), seed=8)
    policy = policy_cls(budget=14, sink_tokens=2, recent_tokens=0, recent_share=0.5)
    assert policy.recent_for(14) == 7
    cache = PagedCache(block_size=B, config=llama.config, retention=policy, debug=True)
    got = run_steps(llama, x, STEPS, cache, before=lambda c, s, q: c.check_invariants())
    want = compacted_dynamic_reference(llama, x, STEPS, 14, policy.name, 2, 7)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    plain = run_steps(llama, x, STEPS, PagedCache(block_size=B, config=llama.config,
                                                  retention=policy_cls(budget=14, sink_tokens=2, recent_tokens=0)))
    assert (got - plain).abs().max() > 1e-2  # the window changed what was kept
    stats = cache.pool.stats()
    assert cache.retention_stats().tokens_held == 14 + STEPS[-1]
    assert stats.blocks_in_use == num_blocks_for(14 + STEPS[-1], B)  # the budget's blocks, no more
    assert stats.bytes_in_use == stats.blocks_in_use * stats.bytes_per_block
    cache.check_invariants()
    cache.release()


def test_recent_share_selects_the_window_then_the_best_scores():
    # head 0's key norms fall with the position, head 1's rise: KeyNorm (low norm first) prefers late / early tokens
    held, keep = 20, 8
    norms = torch.stack([torch.arange(held, 0, -1), torch.arange(1, held + 1)]).float()  # [2, held]
    keys = torch.zeros(1, 2, held, 4)
    keys[..., 0] = norms
    policy = KeyNorm(budget=keep, sink_tokens=1, recent_tokens=2, recent_share=0.5)
    assert policy.recent_for(keep) == 4  # max(recent_tokens=2, int(0.5 * 8))
    idx = policy.select(keys, keep)  # [1, 2, keep]
    window = [16, 17, 18, 19]
    assert idx[0, 0].tolist() == [0, 13, 14, 15] + window  # the sink, then the lowest norms before the window
    assert idx[0, 1].tolist() == [0, 1, 2, 3] + window
    assert KeyNorm(budget=keep, sink_tokens=1, recent_tokens=2).select(keys, keep)[0, 1].tolist() == \
        [0, 1, 2, 3, 4, 5, 18, 19]  # without the share: only recent_tokens
    # the window never crowds out the sinks; recent_tokens stays the floor; 0 is the default, unchanged
    assert KeyNorm(budget=100, sink_tokens=4, recent_share=0.99).recent_for(100) == 96
    assert KeyNorm(budget=100, recent_tokens=64, recent_share=0.25).recent_for(100) == 64
    assert KeyNorm(budget=100).recent_share == 0 and KeyNorm(budget=100).recent_for(100) == 64


@pytest.mark.parametrize("share", [-0.1, 1.0, 1, True, "0.5", None])
def test_a_bad_recent_share_is_refused(share):
    with pytest.raises(ValueError, match="recent_share"):
        KeyDiff(budget=100, recent_share=share)


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="exactly one"):
        KeyNorm()
    with pytest.raises(ValueError, match="exactly one"):
        KeyNorm(budget=100, compression_ratio=0.5)
    with pytest.raises(ValueError, match="budget"):
        KeyDiff(budget=10, sink_tokens=4, recent_tokens=8)
    with pytest.raises(ValueError, match="compression_ratio"):
        KeyDiff(compression_ratio=1.5)


def test_numpy_scalars_are_the_numbers_they_hold_and_numpy_bools_are_refused():
    # a budget or setting read from an array (np.int64, np.float32) is Python's int / float, as a ratio always was
    for policy, plain in ((KVzip(budget=np.int64(100), chunk_tokens=np.int32(8),
                                 scoring=KVzipScoring(kernel_size=np.uint8(3))),
                           KVzip(budget=100, chunk_tokens=8, scoring=KVzipScoring(kernel_size=3))),
                          (KeyNorm(compression_ratio=np.float32(0.5), recent_share=np.float64(0.25)),
                           KeyNorm(compression_ratio=0.5, recent_share=0.25)),
                          (SinkWindow(np.int64(4), np.int16(64)), SinkWindow(4, 64))):
        assert policy == plain and repr(policy) == repr(plain)
        assert all(type(getattr(policy, f)) is type(getattr(plain, f)) for f in ("budget", "sink_tokens", "window")
                   if hasattr(plain, f))
    for bad in (np.bool_(True), np.float64(100.0), True):  # a bool, or a float budget, is not silently a count
        with pytest.raises(ValueError, match="`budget` must be an int"):
            KVzip(budget=bad, scoring="plain")
    with pytest.raises(ValueError, match="`window` must be an int"):
        SinkWindow(4, np.bool_(True))


def test_a_full_pool_refuses_a_compaction_and_changes_nothing(llama):
    from hf_pagedkv import PoolExhaustedError

    pool = BlockPool(block_size=B, num_blocks=7)  # the 21-token prompt takes 6; a compaction to 10 needs 3 more
    cache = PagedCache(pool=pool, config=llama.config, retention=KeyNorm(budget=10, recent_tokens=2))
    x = ids(1, 22, seed=5)
    run_steps(llama, x, [21], cache)
    tables = cache.block_tables()
    with pytest.raises(PoolExhaustedError):
        run_steps(llama, x[:, 21:], [1], cache)
    assert cache.block_tables() == tables and cache.retention_stats().tokens_held == 21
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_a_compressed_cache_publishes_only_what_it_still_holds_uncompressed(llama):
    from hf_pagedkv.retention import SinkWindow

    x = ids(1, 40, seed=6)
    for policy, intact in ((SinkWindow(sink_tokens=4, window=8), 1), (KeyNorm(budget=12, recent_tokens=4), 0)):
        pool = BlockPool(block_size=B, prefix_caching=True)
        cache = PagedCache(pool=pool, config=llama.config, retention=policy)
        run_steps(llama, x, [30, 1, 1], cache)
        assert cache.retention_stats().tokens_evicted > 0
        assert cache.publish(x[:, :32], model=llama) == intact  # SinkWindow: its sink block; compacted: nothing
        pool.check_invariants()
        cache.release()
