"""`PyramidKV`: SnapKV's scores with per-layer budgets that shrink with depth. The full-attention layers are split into
tiers, each its own layer group, so each tier's evicted blocks really go back to the pool -- checked against a run of
the model without a cache whose every layer hides exactly each head's evicted positions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import PyramidKV, SnapKV
from hf_pagedkv.blocks.block_table import num_blocks_for
from tests.conftest import VOCAB, ids, tiny_model
from tests.retention.reference import run_steps, snapkv_reference
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4
LAYERS = 8


@pytest.fixture(scope="module")
def llama8(one_thread):
    """A tiny random Llama with 8 layers (4 query heads over 2 KV heads) and the "hf_pagedkv" attention."""
    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation("hf_pagedkv")
    return model


def check(cache, start, q):
    cache.check_invariants()


def layer_keeps(policy: PyramidKV, held: int, keep: int) -> dict[int, int]:
    """Layer index -> tokens kept, from the policy's tier budgets (all 8 layers are full attention)."""
    tiers = policy.tiers_of(LAYERS)
    budgets = policy.tier_budgets(keep, held, [len(t) for t in tiers], B)
    return {layer: budgets[t] for t, layers in enumerate(tiers) for layer in layers}


# -- the schedule -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("held, keep, beta", [(1024, 512, 20), (1024, 256, 20), (4096, 1024, 5), (300, 150, 20)])
def test_the_schedule_averages_the_uniform_budget_and_shrinks_with_depth(held, keep, beta):
    policy = PyramidKV(budget=keep, beta=beta)
    for layers in (8, 30, 32):
        per_layer = policy.budgets(layers, held)
        assert abs(sum(per_layer) - keep * layers) < 1e-6 * keep * layers  # the paper's total, exactly
        assert all(a >= b for a, b in zip(per_layer, per_layer[1:]))  # non-increasing with depth
        assert per_layer[0] <= held and per_layer[-1] >= policy.recent_tokens
        for block in (1, 16, 32):
            sizes = [len(t) for t in policy.tiers_of(layers)]
            got = policy.tier_budgets(keep, held, sizes, block)
            assert all(a >= b for a, b in zip(got, got[1:])) and got[0] > got[-1]
            assert all((got[0] - b) % block == 0 for b in got)  # whole blocks apart: tables end together
            # the total within rounding: the top tier to a token, each tier's difference to half a block
            total = sum(b * n for b, n in zip(got, sizes))
            assert abs(total - keep * layers) <= layers * (block / 2 + 1), (got, total, keep * layers)


def test_tiers_are_contiguous_and_as_even_as_possible():
    assert PyramidKV(budget=100, tiers=4).tiers_of(10) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert PyramidKV(budget=100, tiers=4).layer_tiers(8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert PyramidKV(budget=100, tiers=1).layer_tiers(3) == [0, 0, 0]
    assert "tiers=4" in repr(PyramidKV(budget=100)) and "beta=20" in repr(PyramidKV(budget=100))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tiers"):
        PyramidKV(budget=64, tiers=0)
    with pytest.raises(ValueError, match="beta"):
        PyramidKV(budget=64, beta=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        PyramidKV()
    with pytest.raises(ValueError, match="kernel_size"):
        PyramidKV(budget=64, kernel_size=2)
    config = tiny_model("llama").config  # 3 layers
    with pytest.raises(ValueError, match="at least 4 full-attention layers"):
        PagedCache(config=config, retention=PyramidKV(budget=64))
    with pytest.raises(ValueError, match="config=model.config"):
        PagedCache(retention=PyramidKV(budget=64, tiers=2))
    # 8 layers in 4 tiers, 32 protected tokens: a 34-token budget leaves the top tier 32.4 on average, < 32 + 1
    with pytest.raises(ValueError, match="top tier keeps 32.4 tokens"):
        PyramidKV(budget=34, tiers=4).layer_tiers(8)
    assert PyramidKV(budget=40, tiers=4).layer_tiers(8)  # 33.7


# -- through the model --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, keep", [
    (PyramidKV(budget=16, recent_tokens=4, kernel_size=3), 16),
    (PyramidKV(compression_ratio=0.5, sink_tokens=2, recent_tokens=4, tiers=3, beta=4), 20),
])
def test_a_question_after_the_compressed_prompt_equals_the_head_masked_reference(llama8, policy, keep):
    steps = [40, 5, 1, 1, 3, 1]  # a prompt, a multi-token question, decoding, a multi-token step
    x = ids(2, sum(steps), seed=21)
    cache = PagedCache(block_size=B, config=llama8.config, retention=policy, debug=True)
    got = run_steps(llama8, x, steps, cache, before=check)
    keeps = layer_keeps(policy, steps[0], keep)
    assert len(set(keeps.values())) == policy.tiers  # really different budgets per tier
    want = snapkv_reference(llama8, x, steps[0], keeps, policy.recent_tokens, policy.sink_tokens,
                            policy.kernel_size, policy.pooling)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL  # the prefill and every step after the compression
    full = run_steps(llama8, x, steps, PagedCache(block_size=B, config=llama8.config))
    assert (got - full).abs().max() > 1e-2  # the eviction really changed what attention saw
    stats = cache.retention_stats()
    after = sum(steps[1:])
    per_layer = tuple(keeps[layer] + after for layer in range(LAYERS))
    assert stats.tokens_held_per_layer == per_layer
    assert (stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (sum(steps), sum(per_layer) // LAYERS, 1)
    assert cache.get_seq_length() == sum(steps)
    # every tier holds its own budget's blocks (plus each row's partial last block), not tier 0's nor the context's
    tiers = policy.tiers_of(LAYERS)
    groups = cache.pool.stats().groups
    assert len(groups) == policy.tiers
    for t, layers in enumerate(tiers):
        assert groups[t].layers == tuple(layers)
        assert groups[t].blocks_in_use == 2 * num_blocks_for(keeps[layers[0]] + after, B)
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_one_tier_is_snapkv_bit_for_bit(llama8):
    steps = [40, 5, 1, 3]
    x = ids(2, sum(steps), seed=22)
    snap = SnapKV(budget=16, recent_tokens=4, kernel_size=3)
    pyramid = PyramidKV(budget=16, recent_tokens=4, kernel_size=3, tiers=1)
    a = run_steps(llama8, x, steps, PagedCache(block_size=B, config=llama8.config, retention=snap))
    cache = PagedCache(block_size=B, config=llama8.config, retention=pyramid, debug=True)
    b = run_steps(llama8, x, steps, cache, before=check)
    assert torch.equal(a, b)  # the same steps, shapes and kept tokens
    assert cache.retention_stats().tokens_held == 16 + sum(steps[1:]) and len(cache.pool.groups) == 1
    cache.release()


@pytest.mark.parametrize("quant", [None, "k8v8"])
def test_bytes_in_use_are_the_tiers_budgets(llama8, quant):
    policy = PyramidKV(compression_ratio=0.75, recent_tokens=4, sink_tokens=1)
    steps = [64, 1]
    x = ids(2, sum(steps), seed=23)
    pool = BlockPool(block_size=B, quant=quant)
    cache = PagedCache(pool=pool, config=llama8.config, retention=policy, debug=True)
    run_steps(llama8, x, steps, cache, before=check)
    keeps = layer_keeps(policy, steps[0], 16)
    assert keeps[0] > keeps[LAYERS - 1]
    stats = pool.stats()
    for t, layers in enumerate(policy.tiers_of(LAYERS)):
        group = stats.groups[t]
        held = keeps[layers[0]] + 1
        # the budget's blocks: its full blocks plus at most one partial block per row
        assert group.blocks_in_use == 2 * num_blocks_for(held, B)
        assert group.blocks_in_use <= 2 * (held // B + 1)
        if quant is None:
            assert group.bytes_in_use == group.blocks_in_use * group.bytes_per_block
        else:  # codes and scales, plus each row's full-precision partial block and sink token
            per_token_fp = len(layers) * 2 * 2 * 16 * 4  # layers x (K, V) x heads x head_dim x fp32
            assert group.bytes_in_use <= group.blocks_in_use * group.bytes_per_block + 2 * (B + 1) * per_token_fp
    full = PagedCache(pool=BlockPool(block_size=B, quant=quant), config=llama8.config)
    run_steps(llama8, x, steps, full)
    assert stats.bytes_in_use < 0.4 * full.pool.stats().bytes_in_use  # a quarter kept, on average
    cache.release()
    full.release()
    assert pool.stats().blocks_in_use == 0


def test_beams_and_return_sequences_share_the_compacted_blocks(llama8):
    pool = BlockPool(block_size=B)
    policy = PyramidKV(compression_ratio=0.5, recent_tokens=4, beta=4)
    cache = PagedCache(pool=pool, config=llama8.config, retention=policy, debug=True)
    out = llama8.generate(ids(1, 40, seed=24), **cache_kwargs(cache), num_beams=3, num_return_sequences=2,
                          max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (2, 48)
    stats = cache.retention_stats()
    assert stats.num_evictions == 1 and stats.tokens_seen == 47
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
    # identical prefill rows are compacted once per tier and share the result
    shared = PagedCache(block_size=B, config=llama8.config, retention=policy, debug=True)
    run_steps(llama8, ids(1, 41, seed=24).repeat(3, 1), [40, 1], shared)
    keeps = layer_keeps(policy, 40, 20)
    for t, layers in enumerate(policy.tiers_of(LAYERS)):
        group = shared.pool.groups[t]
        full_blocks = keeps[layers[0]] // B  # the kept full blocks, once; each row's own last block on top
        assert group.allocator.num_used_blocks == full_blocks + 3 * (num_blocks_for(keeps[layers[0]] + 1, B)
                                                                     - full_blocks)
    shared.check_invariants()
    shared.release()


def test_fork_crop_and_reset_after_the_compression(llama8):
    steps = [40, 5, 2]
    x = ids(1, sum(steps), seed=25)
    policy = PyramidKV(budget=16, recent_tokens=4)
    cache = PagedCache(block_size=B, config=llama8.config, retention=policy, debug=True)
    run_steps(llama8, x, steps[:2], cache, before=check)
    fork = cache.fork()
    a = run_steps(llama8, x[:, 45:], [2], cache)
    cache.crop(-2)  # assisted decoding takes back its last step
    b = run_steps(llama8, x[:, 45:], [2], cache)
    c = run_steps(llama8, x[:, 45:], [2], fork)
    assert torch.equal(a, b)  # the same steps on the same blocks
    # the fork reads its copy-on-write last blocks gathered, not as one view: the same tokens, other kernels
    assert (b - c).abs().max() < CROSS_STEP_LOGIT_ATOL
    with pytest.raises(ValueError, match="evicted tokens cannot come back"):
        cache.crop(-10)
    for cc in (cache, fork):
        cc.check_invariants()
    cache.reset()
    cache.check_invariants()
    assert cache.get_seq_length() == 0 and cache.retention_stats().tokens_held == 0
    run_steps(llama8, x[:, :8], [8], cache, before=check)  # usable again: nothing evicted yet, tier 0 unchanged
    assert [layer.get_mask_sizes(1) for layer in cache.layers][-1] == (9, 0)
    for cc in (cache, fork):
        cc.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_the_passkey_eval_builds_it_like_snap_kv():
    from eval.long_context import policy_for
    from eval.long_context_config import PASSKEY_METHODS, LongContextConfig

    cfg = LongContextConfig(task="passkey", methods=["full", "pyramid_kv"], contexts=[1024], ratios=[0.5])
    assert "pyramid_kv" in PASSKEY_METHODS
    policy = policy_for("pyramid_kv", cfg, ratio=0.5, context=1024)
    assert policy == PyramidKV(compression_ratio=0.5, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)
    assert policy.needs_queries and policy.tiers == 4


def test_one_evict_event_per_tier(llama8):
    pool = BlockPool(block_size=B)
    pool.events.enable()
    policy = PyramidKV(budget=16, recent_tokens=4)
    cache = PagedCache(pool=pool, config=llama8.config, retention=policy, debug=True)
    run_steps(llama8, ids(1, 41, seed=26), [40, 1], cache)
    evicts = [e for e in pool.events.take_events() if e["kind"] == "evict"]
    keeps = layer_keeps(policy, 40, 16)
    tiers = policy.tiers_of(LAYERS)
    assert [e["group"] for e in evicts] == list(range(policy.tiers))
    assert [e["tokens"] for e in evicts] == [40 - keeps[t[0]] for t in tiers]  # what each tier let go
    assert all(e["policy"] == "pyramid_kv" and len(e["blocks"]) == 10 for e in evicts)  # the prompt's 10 blocks
    cache.release()


def test_offload_and_prefetch_keep_every_tier(llama8):
    steps = [40, 5, 2]
    x = ids(1, sum(steps), seed=27)
    policy = PyramidKV(budget=16, recent_tokens=4)
    straight = PagedCache(block_size=B, config=llama8.config, retention=policy)
    want = run_steps(llama8, x, steps, straight)[:, 45:]
    pool = BlockPool(block_size=B, host_memory="4MiB")
    cache = PagedCache(pool=pool, config=llama8.config, retention=policy, debug=True)
    run_steps(llama8, x, steps[:2], cache, before=check)
    stats = cache.retention_stats()
    cache.offload()
    assert pool.stats().blocks_in_use == 0
    cache.prefetch()
    cache.check_invariants()
    got = run_steps(llama8, x[:, 45:], [2], cache, before=check)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    assert stats.tokens_held_per_layer == tuple(n - 2 for n in cache.retention_stats().tokens_held_per_layer)
    for c in (straight, cache):
        c.release()
    assert pool.stats().blocks_in_use == 0


def test_a_saved_prefix_cache_keeps_its_tiers(llama8, tmp_path):
    x = ids(1, 46, seed=28)  # a 40-token prompt (10 blocks) shared by two requests, then 5 question tokens + 1
    policy = PyramidKV(budget=16, recent_tokens=4)
    pool = BlockPool(block_size=B, prefix_caching=True)
    first = PagedCache(pool=pool, config=llama8.config, retention=policy, debug=True)
    want = run_steps(llama8, x, [40, 5, 1], first)[:, 40:]
    second = PagedCache(pool=pool, config=llama8.config, retention=policy)  # publishes before its compression
    run_steps(llama8, x, [40], second)
    assert second.publish(x[:, :40], model=llama8) == 10 * policy.tiers  # every tier group's 10 blocks
    path = tmp_path / "prefix.safetensors"
    assert pool.save_prefix_cache(path, model=llama8) == 10 * policy.tiers
    loaded = BlockPool.load_prefix_cache(path, model=llama8)  # a new pool, as in a new process
    assert [g.name for g in loaded.groups] == ["full", "full.tier1", "full.tier2", "full.tier3"]
    cache = PagedCache.from_prefix(loaded, x[:, :40], model=llama8, retention=policy, debug=True)
    assert cache.get_seq_length() == 36  # 9 blocks hit in every tier; the last 4 prompt tokens computed
    got = run_steps(llama8, x[:, 36:], [4, 5, 1], cache, before=check)[:, 4:]
    # the hit's K/V are the first run's; the prompt's last 4 tokens ran as their own step
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    for c in (first, second, cache):
        c.release()


def test_a_tier_0_that_keeps_every_token_compacts_once(one_thread):
    """Two layers in two tiers, budget 24 of 40: tier 0 keeps all 40 (nothing is evicted from the span), tier 1 keeps
    8. The step's later calls (`before_step`, a second mask) must not compact again (they found no queries left
    and raised before)."""
    torch.manual_seed(99)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("hf_pagedkv")
    policy = PyramidKV(budget=24, recent_tokens=4, kernel_size=3, tiers=2)
    assert policy.tier_budgets(24, 40, [1, 1], B) == [40, 8]
    steps = [40, 5, 1, 3]
    x = ids(1, sum(steps), seed=24)
    cache = PagedCache(block_size=B, config=config, retention=policy, debug=True)
    got = run_steps(model, x, steps, cache, before=check)
    want = snapkv_reference(model, x, steps[0], {0: 40, 1: 8}, policy.recent_tokens, policy.sink_tokens,
                            policy.kernel_size, policy.pooling)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    after = sum(steps[1:])
    assert cache.retention_stats().tokens_held_per_layer == (40 + after, 8 + after)
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_a_pool_with_tiers_refuses_a_cache_with_other_tiers_up_front(llama8):
    pool = BlockPool(block_size=B)
    tiered = PagedCache(pool=pool, config=llama8.config, retention=PyramidKV(budget=16, recent_tokens=4, tiers=2))
    run_steps(llama8, ids(1, 31, seed=3), [30, 1], tiered)
    before = pool.stats().blocks_in_use
    for retention in (None, PyramidKV(budget=16, recent_tokens=4, tiers=4)):
        with pytest.raises(ValueError, match="must all use the same tiers"):  # when built, not at its first step
            PagedCache(pool=pool, config=llama8.config, retention=retention)
        assert pool.stats().blocks_in_use == before
    same = PagedCache(pool=pool, config=llama8.config, retention=PyramidKV(budget=16, recent_tokens=4, tiers=2))
    run_steps(llama8, ids(1, 31, seed=4), [30, 1], same)  # the same tiers share the pool
    pool.check_invariants()
    for cache in (tiered, same):
        cache.release()
    assert pool.stats().blocks_in_use == 0
