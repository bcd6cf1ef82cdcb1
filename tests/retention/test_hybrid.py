"""Retention on hybrid models (tiny Gemma2 and Gemma3, sliding window 8): the full-attention layers evict, the
sliding-window layers keep exactly their window (`WindowRealign`) -- checked against the model run without a cache
under one mask per layer type, and against a `DynamicCache` whose full-attention layers are compacted by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, cache_kwargs
from hf_pagedkv.retention import KVzip, KeyDiff, KeyNorm, PyramidKV, SinkWindow, SnapKV
from hf_pagedkv.adapter.window_realign import WindowRealign
from tests.conftest import ids, tiny_model
from tests.retention.reference import compacted_dynamic_reference, run_steps, sink_window_visible, snapkv_reference
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4
STEPS = [13, 1, 1, 1, 5, 1, 7, 1, 1, 3, 1, 1, 9, 1]
WINDOW = 8  # the tiny models' sliding window


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hybrid(request, one_thread):
    return tiny_model(request.param)


@pytest.fixture
def copies(monkeypatch):
    """Counts the sliding groups realigned by a copy (the others shift)."""
    seen = []
    real = WindowRealign._copy

    def spy(self, rt, *args):
        seen.append(rt.group)
        return real(self, rt, *args)

    monkeypatch.setattr(WindowRealign, "_copy", spy)
    return seen


def sliding_visible(n: int, window: int) -> torch.Tensor:
    """`[n, n]` bool: token `i` sees tokens ``i - window + 1 .. i`` (a sliding-window layer of `DynamicCache`)."""
    i = torch.arange(n)
    return (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)


def per_type_reference(model, x: torch.Tensor, full_visible: torch.Tensor) -> torch.Tensor:
    """Logits of `x` in one pass without a cache: full-attention layers under `full_visible` `[seq, seq]`, sliding
    ones under their window, at true positions (transformers takes one 4D mask per layer type)."""
    batch, n = x.shape
    masks = {"full_attention": full_visible, "sliding_attention": sliding_visible(n, WINDOW)}
    # additive float masks: Gemma2's eager attention (soft-capping) adds the mask to the scores
    lowest = torch.finfo(torch.float32).min
    masks = {kind: torch.zeros(n, n).masked_fill(~m, lowest)[None, None].expand(batch, 1, -1, -1)
             for kind, m in masks.items()}
    with torch.no_grad():
        return model(x, attention_mask=masks).logits


@pytest.mark.parametrize("sink_tokens, window", [(4, 8), (4, 9), (2, 12), (4, 20)])
def test_sink_window_equals_the_per_layer_type_reference(hybrid, sink_tokens, window, copies):
    x = ids(1, sum(STEPS), seed=3)
    cache = PagedCache(block_size=B, config=hybrid.config, retention=SinkWindow(sink_tokens, window), debug=True)
    visible, held = sink_window_visible(STEPS, B, sink_tokens, window)
    got = run_steps(hybrid, x, STEPS, cache, before=lambda c, s, q: c.check_invariants())
    want = per_type_reference(hybrid, x, visible)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL  # different step shapes: reassociated sums only
    full = run_steps(hybrid, x, STEPS, DynamicCache(config=hybrid.config))
    assert (got - full).abs().max() > 1e-2  # the eviction changed what the full-attention layers saw
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (sum(STEPS), len(held[-1])) and stats.num_evictions
    assert cache.get_seq_length() == sum(STEPS)
    cache.check_invariants()
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().blocks_in_use == 0


def test_sink_window_moves_no_tensor(hybrid, copies):
    """A block-level eviction with a window at least the sliding one only shifts the sliding blocks' positions."""
    for window in (8, 9, 12, 20):
        cache = PagedCache(block_size=B, config=hybrid.config, retention=SinkWindow(4, window))
        run_steps(hybrid, ids(1, sum(STEPS), seed=3), STEPS, cache)
        assert cache.retention_stats().num_evictions > 2
        assert not copies, window
        cache.release()


@pytest.mark.parametrize("policy_cls", [KeyNorm, KeyDiff])
@pytest.mark.parametrize("budget, sink, recent", [(14, 2, 4), (9, 0, 0)])
def test_importance_equals_a_hand_compacted_dynamic_cache(hybrid, policy_cls, budget, sink, recent, copies):
    x = ids(1, sum(STEPS), seed=8)
    policy = policy_cls(budget=budget, sink_tokens=sink, recent_tokens=recent)
    cache = PagedCache(block_size=B, config=hybrid.config, retention=policy, debug=True)
    got = run_steps(hybrid, x, STEPS, cache, before=lambda c, s, q: c.check_invariants())
    want = compacted_dynamic_reference(hybrid, x, STEPS, budget, policy.name, sink, recent)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    full = run_steps(hybrid, x, STEPS, DynamicCache(config=hybrid.config))
    assert (got - full).abs().max() > 1e-2
    assert copies  # budgets that are not whole blocks move the window by a copy
    assert cache.retention_stats().tokens_held == budget + STEPS[-1]
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_quantized_hybrid_pool_evicts_and_stays_close(hybrid):
    x = ids(1, sum(STEPS), seed=4)
    exact = PagedCache(block_size=B, config=hybrid.config, retention=SinkWindow(4, 9))
    quant = PagedCache(block_size=B, config=hybrid.config, retention=SinkWindow(4, 9), quant="k8v8", debug=True)
    want = run_steps(hybrid, x, STEPS, exact)
    got = run_steps(hybrid, x, STEPS, quant, before=lambda c, s, q: c.check_invariants())
    assert (got - want).abs().max() < 0.05  # int8 K/V of a random tiny model: small drift, nothing broken
    assert quant.retention_stats() == exact.retention_stats()
    for c in (exact, quant):
        c.release()
        assert c.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("quant", [None, "k8v8", "k4v4"])
def test_a_copied_window_holds_the_same_tokens(hybrid, quant, copies):
    """14 tokens, then a step after a compaction to 9: each sliding layer's window moves 5 positions (not whole
    blocks: a copy), and reads back what it held (a quantized window re-encoded in fresh blocks, within its step)."""
    x = ids(1, 15, seed=4)
    cache = PagedCache(block_size=B, config=hybrid.config, quant=quant, debug=True,
                       retention=KeyNorm(budget=9, sink_tokens=1, recent_tokens=2))
    run_steps(hybrid, x[:, :14], [14], cache)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in sliding]  # the last window - 1 = 7 tokens
    run_steps(hybrid, x[:, 14:], [1], cache)
    assert copies and cache.retention_stats().tokens_held == 10
    for layer, (k, v) in zip(sliding, before):
        for old, new in ((k, layer.keys), (v, layer.values)):
            assert new.shape[2] == WINDOW - 1  # 6 old tokens, then the new one
            # fp: the same numbers; quantized: codes of the same values, so at most one quantization step apart
            tol = 0.0 if quant is None else old.abs().max().item() / (7 if quant == "k4v4" else 127)
            assert (new[:, :, :6] - old[:, :, 1:]).abs().max() <= tol
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_beams_share_the_realigned_window(hybrid):
    x = ids(1, 11, seed=6)
    kw = dict(max_new_tokens=12, do_sample=False, num_beams=3, num_return_sequences=2)
    cache = PagedCache(block_size=B, config=hybrid.config, retention=SinkWindow(4, 9), debug=True)
    out = hybrid.generate(x, **cache_kwargs(cache), **kw)
    assert out.shape == (2, 23) and cache.retention_stats().num_evictions > 0
    cache.check_invariants()
    # the beams' realigned window blocks are shared: fewer blocks than rows times what a row holds
    per_row = -(-cache.retention_stats().tokens_held // B)
    assert cache.pool.stats().blocks_in_use < cache.num_rows * per_row * 2
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_a_budget_below_the_window_is_refused_and_changes_nothing(hybrid):
    x = ids(1, 20, seed=2)
    cache = PagedCache(block_size=B, config=hybrid.config, retention=KeyNorm(budget=5, sink_tokens=0,
                                                                              recent_tokens=0))
    run_steps(hybrid, x, [20], cache)
    before = cache.pool.stats().blocks_in_use
    with pytest.raises(ValueError, match="window - 1 = 7 tokens"):
        run_steps(hybrid, ids(1, 1, seed=1), [1], cache)
    assert cache.pool.stats().blocks_in_use == before and cache.retention_stats().num_evictions == 0
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_a_full_pool_refuses_the_copy_before_anything_changes(hybrid):
    pool = BlockPool(B, num_blocks=64)
    cache = PagedCache(pool=pool, config=hybrid.config, retention=KeyNorm(budget=9, sink_tokens=0, recent_tokens=0))
    run_steps(hybrid, ids(1, 17, seed=5), [17], cache)
    hog = PagedCache(pool=pool, config=hybrid.config)
    free = {g.name: g.allocator.num_free_blocks for g in pool.groups}
    while min(g.allocator.num_free_blocks for g in pool.groups) > 0:  # fill every group
        try:
            run_steps(hybrid, ids(1, B, seed=7), [B], hog)
        except PoolExhaustedError:
            break
    before = pool.stats().blocks_in_use
    with pytest.raises(PoolExhaustedError):
        run_steps(hybrid, ids(1, 1, seed=1), [1], cache)
    assert pool.stats().blocks_in_use == before and cache.retention_stats().num_evictions == 0, free
    cache.check_invariants()
    pool.check_invariants()
    for c in (hog, cache):
        c.release()
    assert pool.stats().blocks_in_use == 0


def test_kvzip_is_refused_on_sliding_window_models(hybrid):
    with pytest.raises(ValueError, match="reconstruction pass"):
        PagedCache(config=hybrid.config, retention=KVzip(compression_ratio=0.5, scoring="plain"))


@pytest.fixture(scope="module")
def gemma3_paged(one_thread):
    """Tiny Gemma3 (no attention soft-capping, so the reference's plain attention is the model's) with the
    "hf_pagedkv" attention, restored afterwards."""
    model = tiny_model("gemma3")
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    yield model
    model.set_attn_implementation(before)


@pytest.mark.parametrize("policy", [SnapKV(budget=16, recent_tokens=4, kernel_size=3),
                                    SnapKV(budget=10, recent_tokens=4, kernel_size=3),
                                    PyramidKV(budget=24, recent_tokens=4, kernel_size=3, tiers=2)])
def test_query_aware_policies_equal_the_head_masked_reference(gemma3_paged, policy, copies):
    steps = [40, 5, 1, 1, 3, 1]  # a prompt, a multi-token question, decoding, a multi-token step
    x = ids(2, sum(steps), seed=21)
    cache = PagedCache(block_size=B, config=gemma3_paged.config, retention=policy, debug=True)
    got = run_steps(gemma3_paged, x, steps, cache, before=lambda c, s, q: c.check_invariants())
    types = gemma3_paged.config.layer_types
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    tiers = policy.tiers_of(len(full)) if policy.tiers > 1 else [list(range(len(full)))]
    budgets = policy.tier_budgets(policy.keep_for(steps[0]), steps[0], [len(t) for t in tiers], B)
    keeps = {full[i]: budgets[t] for t, members in enumerate(tiers) for i in members}
    assert len(set(keeps.values())) == policy.tiers
    want = snapkv_reference(gemma3_paged, x, steps[0], keeps, policy.recent_tokens, policy.sink_tokens,
                            policy.kernel_size, policy.pooling)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    plain = run_steps(gemma3_paged, x, steps, DynamicCache(config=gemma3_paged.config))
    assert (got - plain).abs().max() > 1e-2
    assert bool(copies) == (policy.budget == 10)  # 40 -> 16 is whole blocks (shift); 40 -> 10 is not (copy)
    assert cache.get_seq_length() == sum(steps)
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_gemma2_soft_capping_through_the_hf_pagedkv_attention(one_thread):
    """Gemma 2 soft-caps its attention logits, which `sdpa` refuses: the "hf_pagedkv" attention attends with the
    eager formula then (steps that do not read in place), so the model's own attention's logits come out, and the
    query-aware policies run on it."""
    model = tiny_model("gemma2")
    before = model.config._attn_implementation
    assert model.config.attn_logit_softcapping  # the case under test
    steps = [20, 1, 3, 1]
    x = ids(2, sum(steps), seed=11)
    want = run_steps(model, x, steps, DynamicCache(config=model.config))  # the model's default attention
    model.set_attn_implementation("hf_pagedkv")
    try:
        got = run_steps(model, x, steps, PagedCache(block_size=B, config=model.config))
        assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
        cache = PagedCache(block_size=B, config=model.config, debug=True,
                           retention=SnapKV(budget=10, recent_tokens=4, kernel_size=3))
        snapped = run_steps(model, x, steps, cache)
        assert cache.retention_stats().tokens_held == 10 + sum(steps[1:])
        assert torch.isfinite(snapped).all() and (snapped - want).abs().max() > 1e-2
        cache.release()
        assert cache.pool.stats().blocks_in_use == 0
    finally:
        model.set_attn_implementation(before)
