"""`SnapKV`, the query-aware policy: the ``"hf_pagedkv"`` attention hands the prefill's last queries to the cache,
which scores the prompt per (layer, KV head), keeps the best tokens compactly and frees the rest -- checked against
a run of the model without a cache whose every layer hides exactly each head's evicted positions."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import KeyNorm, SnapKV
from hf_pagedkv.blocks.block_table import num_blocks_for
from tests.conftest import ids
from tests.retention.reference import reference_snapkv_scores, run_steps, snapkv_reference
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4


def check(cache, start, q):
    cache.check_invariants()


@pytest.mark.parametrize("policy, keep", [(SnapKV(budget=12, recent_tokens=6), 12),
                                          (SnapKV(compression_ratio=0.5, sink_tokens=2, recent_tokens=4,
                                                  pooling="max", kernel_size=3), 12)])
def test_a_question_after_the_compressed_prompt_equals_the_head_masked_reference(llama, policy, keep):
    steps = [24, 5, 1, 1, 3, 1]  # a prompt, a multi-token question, decoding, a multi-token step
    x = ids(2, sum(steps), seed=11)  # two different rows
    cache = PagedCache(block_size=B, config=llama.config, retention=policy, debug=True)
    got = run_steps(llama, x, steps, cache, before=check)
    want = snapkv_reference(llama, x, steps[0], keep, policy.recent_tokens, policy.sink_tokens, policy.kernel_size,
                            policy.pooling)
    assert (got[:, : steps[0]] - want[:, : steps[0]]).abs().max() < CROSS_STEP_LOGIT_ATOL  # the prefill
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL  # every step after the compression
    full = run_steps(llama, x, steps, PagedCache(block_size=B, config=llama.config))
    assert (got - full).abs().max() > 1e-2  # the eviction really changed what attention saw
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (sum(steps), keep + sum(steps[1:]), 1)
    # the budget's blocks plus the partial last block of each row, not the context's: every row was compacted
    held = keep + sum(steps[1:])
    pool = cache.pool.stats()
    assert pool.blocks_in_use == 2 * num_blocks_for(held, B)
    assert pool.bytes_in_use == pool.blocks_in_use * pool.bytes_per_block
    assert pool.bytes_in_use <= 2 * (held * pool.bytes_per_block // B + pool.bytes_per_block)
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_scores_equal_the_plain_reference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 17, 8, generator=g), torch.randn(2, 2, 17, 8, generator=g)  # every prompt query
    for pooling, kernel in (("avg", 5), ("max", 3), ("avg", 1)):
        policy = SnapKV(budget=10, recent_tokens=5, pooling=pooling, kernel_size=kernel)
        got = policy.scores(k, (q[:, :, -5:], 0.3))  # the cache records the last `recent_tokens` only
        want = reference_snapkv_scores(q, k, 0.3, 5, kernel, pooling)
        assert torch.allclose(got, want, atol=1e-5), pooling


def test_without_the_hf_pagedkv_attention_it_refuses_and_changes_nothing(llama):
    llama.set_attn_implementation("sdpa")  # sdpa never hands its queries over
    try:
        _refuses(llama)
    finally:
        llama.set_attn_implementation("hf_pagedkv")


def _refuses(model):
    pool = BlockPool(block_size=B)
    cache = PagedCache(pool=pool, config=model.config, retention=SnapKV(budget=12, recent_tokens=4), debug=True)
    x = ids(1, 25, seed=5)
    run_steps(model, x, [24], cache)
    tables = cache.block_tables()
    with pytest.raises(ValueError, match='attn_implementation="hf_pagedkv"'):
        run_steps(model, x[:, 24:], [1], cache)
    assert cache.block_tables() == tables and cache.retention_stats().tokens_held == 24
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_recorded_queries_follow_reordered_rows(llama):
    x = ids(2, 29, seed=12)
    policy = SnapKV(budget=10, recent_tokens=4)
    straight = PagedCache(block_size=B, config=llama.config, retention=policy)
    want = run_steps(llama, x, [24, 5], straight)[[1, 0], 24:]
    swapped = PagedCache(block_size=B, config=llama.config, retention=policy, debug=True)
    run_steps(llama, x, [24], swapped)
    swapped.reorder_cache(torch.tensor([1, 0]))  # row 0 now holds the second prompt: its queries must follow it
    got = run_steps(llama, x[[1, 0], 24:], [5], swapped)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    for cache in (straight, swapped):
        cache.check_invariants()
        cache.release()


def test_beams_and_return_sequences_share_the_compacted_blocks(llama):
    pool = BlockPool(block_size=B)
    cache = PagedCache(pool=pool, config=llama.config, retention=SnapKV(compression_ratio=0.5, recent_tokens=4),
                       debug=True)
    out = llama.generate(ids(1, 24, seed=4), **cache_kwargs(cache), num_beams=3, num_return_sequences=2,
                         max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.shape == (2, 36)
    stats = cache.retention_stats()
    assert (stats.tokens_evicted, stats.num_evictions) == (12, 1)  # the 24-token prompt compacted once, to 12
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
    # the three identical prefill rows are compacted once and share the compacted blocks
    shared = PagedCache(block_size=B, config=llama.config, retention=SnapKV(budget=12, recent_tokens=4), debug=True)
    run_steps(llama, ids(1, 25, seed=4).repeat(3, 1), [24, 1], shared)
    tables = shared.block_tables()
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # the 12 kept tokens: 3 full blocks, once
    assert all(shared.pool.groups[0].allocator.refcount(b) == 3 for b in tables[0][:3])
    assert shared.pool.stats().blocks_in_use == 3 + 3  # and each row's own last block for the decoded token
    shared.release()


def test_a_fork_before_the_compression_compresses_on_its_own(llama):
    x = ids(1, 25, seed=6)
    cache = PagedCache(block_size=B, config=llama.config, retention=SnapKV(budget=12, recent_tokens=4), debug=True)
    run_steps(llama, x, [24], cache)
    fork = cache.fork()
    a = run_steps(llama, x[:, 24:], [1], cache)
    b = run_steps(llama, x[:, 24:], [1], fork)
    assert torch.equal(a, b)
    assert cache.retention_stats() == fork.retention_stats()
    for c in (cache, fork):
        c.check_invariants()
        c.release()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="kernel_size"):
        SnapKV(budget=64, kernel_size=4)
    with pytest.raises(ValueError, match="pooling"):
        SnapKV(budget=64, pooling="mean")
    with pytest.raises(ValueError, match="recent_tokens"):
        SnapKV(budget=64, recent_tokens=0)
    with pytest.raises(ValueError, match="exactly one"):
        SnapKV()
    assert not KeyNorm(budget=100).needs_queries and SnapKV(budget=100).needs_queries


def test_the_query_window_keeps_the_last_queries_per_layer_and_follows_rows():
    from hf_pagedkv.attention.query_window import QueryWindow, recorder_of

    window = QueryWindow(3)
    keys = torch.zeros(2, 1, 5, 4)
    assert recorder_of(keys) is None
    window.tag(keys, layer_idx=1)
    query = torch.arange(2 * 2 * 5 * 4, dtype=torch.float32).view(2, 2, 5, 4)
    recorder_of(keys)(query, 0.5)  # what the "hf_pagedkv" attention does
    assert torch.equal(window.queries[1], query[:, :, -3:]) and window.scaling[1] == 0.5
    assert window.queries[1].untyped_storage().data_ptr() != query.untyped_storage().data_ptr()  # a copy
    assert window.missing([0, 1, 2]) == [0, 2]
    other = window.copy()
    window.select_rows([1, 1])
    assert torch.equal(window.queries[1], query[[1, 1], :, -3:]) and torch.equal(other.queries[1], query[:, :, -3:])
    window.clear()
    assert window.missing([1]) == [1]


def test_a_quantized_pool_compacts_and_re_encodes(llama):
    steps = [24, 5, 1, 1]
    x = ids(1, sum(steps), seed=13)
    policy = SnapKV(budget=12, recent_tokens=4)
    fp = run_steps(llama, x, steps, PagedCache(block_size=B, config=llama.config, retention=policy))
    q8 = PagedCache(block_size=B, config=llama.config, retention=policy, quant="k8v8", debug=True)
    got = run_steps(llama, x, steps, q8, before=check)
    # int8 twice (the compaction re-encodes the kept tokens); the scores come from de-quantized keys
    assert (got - fp).abs().max() < 0.1
    assert q8.pool.stats().blocks_in_use == num_blocks_for(12 + sum(steps[1:]), B)
    q8.check_invariants()
    q8.release()
    assert q8.pool.stats().blocks_in_use == 0
