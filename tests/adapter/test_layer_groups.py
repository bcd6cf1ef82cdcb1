"""Layer groups: a hybrid model's sliding-window layers hold only their window, full-attention layers everything.

The model is a tiny Gemma3-style config (4 layers, sliding window 64 on layers 0 and 2, full attention on 1 and 3),
seeded and random, so every number below is exact and cheap; `benchmarks/hybrid_memory.py` measures the same at
real-model sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, cache_kwargs
from hf_pagedkv.tools.verify import dynamic_cache_bytes
from tests.conftest import VOCAB, ids

W, B = 64, 16  # sliding window, block size


@pytest.fixture(scope="module")
def hybrid(one_thread):
    torch.manual_seed(7)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=W,
                              sliding_window_pattern=2, max_position_embeddings=8192, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2)
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    assert [t for t in config.layer_types] == ["sliding_attention", "full_attention"] * 2
    return model


def gen(model, x, cache, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(x, **cache_kwargs(cache), return_dict_in_generate=True, output_logits=True, **kw)


def assert_same(out, ref):
    """Same steps on both sides (one prefill, then one token per step): tokens and logits bit-identical in fp32."""
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        assert torch.equal(got, want)


def sliding_bound(cache: PagedCache) -> int:
    """Blocks a sliding row may hold: the last `window - 1` tokens plus the last step's, and block alignment."""
    return math.ceil((W - 1 + cache.last_step_tokens) / B) + 1


def test_single_sequence_at_4096_tokens_holds_what_dynamic_cache_holds(hybrid):
    x = ids(1, 4088, seed=1)
    cache = PagedCache(block_size=B, config=hybrid.config, debug=True)
    dyn = DynamicCache(config=hybrid.config)
    assert_same(gen(hybrid, x, cache, max_new_tokens=8), gen(hybrid, x, dyn, max_new_tokens=8))
    assert cache.get_seq_length() == dyn.get_seq_length() == 4095
    full, sliding = cache.pool.stats().groups
    assert (full.window, full.layers, sliding.window, sliding.layers) == (None, (1, 3), W, (0, 2))
    assert full.blocks_in_use == math.ceil(4095 / B)
    assert sliding.blocks_in_use <= sliding_bound(cache) == 5
    ratio = cache.pool.stats().bytes_in_use / dynamic_cache_bytes(dyn)
    assert ratio <= 1.02, ratio  # the target (full layers: 4096 vs 4095 slots; sliding: 5 blocks vs 63)
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("how", ["beams", "samples"])
def test_beams_and_samples_hold_at_most_half_of_dynamic_cache(hybrid, how):
    x = ids(1, 1024, seed=2)
    kw = {"num_beams": 4} if how == "beams" else {"do_sample": True, "num_return_sequences": 4}
    cache = PagedCache(block_size=B, config=hybrid.config, debug=True)
    dyn = DynamicCache(config=hybrid.config)
    torch.manual_seed(3)
    out = gen(hybrid, x, cache, max_new_tokens=16, **kw)
    torch.manual_seed(3)
    ref = gen(hybrid, x, dyn, max_new_tokens=16, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    ratio = cache.pool.stats().bytes_in_use / dynamic_cache_bytes(dyn)
    assert ratio <= 0.5, ratio
    assert all(len(t) <= sliding_bound(cache) for t in cache.block_tables(window=W))
    cache.release()
    cache.pool.check_invariants()


def test_sliding_rows_stay_within_the_window_at_every_decode_step(hybrid):
    """A plain forward loop: after every step the sliding group holds at most the bound, the full group all."""
    cache = PagedCache(block_size=B, config=hybrid.config, debug=True)
    dyn = DynamicCache(config=hybrid.config)
    x = ids(2, 40, seed=4)
    with torch.no_grad():
        a, b = hybrid(x, **cache_kwargs(cache)).logits, hybrid(x, **cache_kwargs(dyn)).logits
        assert torch.equal(a, b)
        for step in range(150):  # crosses the window (64) and many block boundaries
            tok = a[:, -1:].argmax(-1)
            a = hybrid(tok, **cache_kwargs(cache)).logits
            b = hybrid(tok, **cache_kwargs(dyn)).logits
            assert torch.equal(a, b), step
            n = cache.get_seq_length()
            assert [len(t) for t in cache.block_tables()] == [math.ceil(n / B)] * 2
            held = [len(t) for t in cache.block_tables(window=W)]
            assert max(held) <= sliding_bound(cache) == 5, (step, held)
    # the sliding layers' K/V are DynamicCache's (the last window - 1 tokens)
    for p, d in zip(cache.layers, dyn.layers):
        assert torch.equal(p.keys, d.keys) and torch.equal(p.values, d.values)
    cache.release()
    cache.pool.check_invariants()


def test_crop_takes_back_the_last_step_and_refuses_more(hybrid):
    """Assisted decoding crops the rejected draft tokens of its last (multi-token) step: that works. A deeper crop
    would need tokens the sliding group freed: a clear error, nothing changed."""
    cache = PagedCache(block_size=B, config=hybrid.config, debug=True)
    x = ids(1, 200, seed=5)
    with torch.no_grad():
        hybrid(x, **cache_kwargs(cache))
        hybrid(ids(1, 6, seed=6), **cache_kwargs(cache))  # a 6-token step (a draft being verified)
    before, tables = cache.pool.stats(), (cache.block_tables(), cache.block_tables(window=W))
    with pytest.raises(ValueError, match="reaches before what the sliding-window layers"):
        cache.crop(-40)
    assert cache.pool.stats() == before and (cache.block_tables(), cache.block_tables(window=W)) == tables
    cache.crop(-5)  # reject 5 of the 6 tokens
    assert cache.get_seq_length() == 201
    # continue: exact against a fresh cache fed the same steps (200, then the kept token, then more)
    ref = PagedCache(block_size=B, config=hybrid.config, debug=True)
    y = ids(1, 3, seed=7)
    with torch.no_grad():
        hybrid(x, **cache_kwargs(ref))
        hybrid(ids(1, 6, seed=6)[:, :1], **cache_kwargs(ref))
        got, want = hybrid(y, **cache_kwargs(cache)).logits, hybrid(y, **cache_kwargs(ref)).logits
    # NOTE: the kept token was computed in a 6-token step in `cache` and in a 1-token step in `ref`: other matmul
    # shapes, so the K/V agree up to fp32 rounding only.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache.release(), ref.release()
    cache.pool.check_invariants()


def test_fixed_pool_counts_each_group_and_fails_cleanly(hybrid):
    """`num_blocks` is per group; a sliding group fits a long sequence in few blocks, the full group does not."""
    pool = BlockPool(block_size=B, num_blocks=20, debug=True)
    cache = PagedCache(pool=pool, config=hybrid.config, debug=True)
    with torch.no_grad():
        hybrid(ids(1, 300, seed=8), **cache_kwargs(cache))  # 19 blocks in each group during the prefill
        for _ in range(8):  # decoding frees the sliding group's early blocks; the full group needs a 20th
            hybrid(ids(1, 1, seed=9), **cache_kwargs(cache))
    full, sliding = pool.stats().groups
    assert (full.num_blocks, sliding.num_blocks) == (20, 20)
    assert full.blocks_in_use == 20 and sliding.blocks_in_use <= 5
    before = pool.stats()
    with pytest.raises(PoolExhaustedError, match="full layer group: 1 block needed, 0 free"):
        with torch.no_grad():
            hybrid(ids(1, 16, seed=10), **cache_kwargs(cache))
    assert pool.stats().groups == before.groups  # nothing changed in either group
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_prefix_hit_on_a_hybrid_model(hybrid):
    """A sliding group serves a prefix hit from the blocks of the window before the hit point; the prompt is
    published before decoding frees them, so the second request hits its whole shared prefix."""
    import hf_pagedkv

    pool = BlockPool(block_size=B, prefix_caching=True, debug=True)
    shared = ids(1, 10 * B, seed=11)
    outs = []
    for seed in (12, 13):
        x = torch.cat([shared, ids(1, 5, seed=seed)], 1)
        outs.append(hf_pagedkv.generate(hybrid, x, pool=pool, max_new_tokens=100, return_dict_in_generate=True,
                                        output_logits=True))
        pool.check_invariants()
        fresh = gen(hybrid, x, DynamicCache(config=hybrid.config), max_new_tokens=100)
        assert torch.equal(outs[-1].sequences, fresh.sequences)
        for got, want in zip(outs[-1].logits, fresh.logits):
            # NOTE: a hit computes the suffix in its own step: other matmul shapes than one prefill, fp32 rounding
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    stats = pool.stats()
    assert stats.hit_tokens == 10 * B  # the whole shared prefix, served by both groups
    assert stats.blocks_in_use == 0


@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_quantized_hybrid_reads_what_a_one_group_cache_reads(hybrid, quant):
    """Quantized sliding groups encode the same blocks from the same tokens, so a hybrid-aware cache gives the tokens
    of a lazy cache (which keeps every token of every layer in one group), while holding only the windows in its
    sliding layers."""
    x = ids(1, 300, seed=14)
    grouped = PagedCache(quant=quant, config=hybrid.config, debug=True)
    lazy = PagedCache(quant=quant, debug=True)
    out, ref = gen(hybrid, x, grouped, max_new_tokens=40), gen(hybrid, x, lazy, max_new_tokens=40)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        # NOTE: a lazy cache hands its sliding layers every token and lets the mask hide the old ones, the grouped
        # cache only the window: other attention shapes, so equal up to fp32 rounding (as DynamicCache lazy vs
        # DynamicCache(config))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    grouped.check_invariants()
    full, sliding = grouped.pool.stats().groups
    assert sliding.blocks_in_use <= math.ceil((W - 1 + 1) / 32) + 1 < full.blocks_in_use
    # encoded blocks: 2 full layers x 11 + 2 sliding x 3 against 4 x 11 (0.64), plus each group's staged partial block
    assert grouped.pool.stats().bytes_in_use < 0.8 * lazy.pool.stats().bytes_in_use
    grouped.release(), lazy.release()
    grouped.pool.check_invariants()
    assert grouped.pool.stats().bytes_in_use == 0


def test_max_memory_sizes_every_layer_group(hybrid):
    """A byte budget gives each group the same number of blocks when the first layer sizes the pool (a step
    reserves in every group at once), whichever layer type comes first."""
    for cache in (PagedCache(config=hybrid.config, max_memory="4MiB", debug=True),
                  PagedCache(pool=BlockPool(max_memory="4MiB"), config=hybrid.config, debug=True)):
        out = gen(hybrid, ids(1, 100, seed=15), cache, max_new_tokens=20)
        ref = gen(hybrid, ids(1, 100, seed=15), DynamicCache(config=hybrid.config), max_new_tokens=20)
        assert_same(out, ref)
        full, sliding = cache.pool.stats().groups
        per_block = full.bytes_per_block + sliding.bytes_per_block  # all 4 layers
        assert full.num_blocks == sliding.num_blocks == 4 * 2**20 // per_block
        assert cache.pool.stats().bytes_reserved <= 4 * 2**20
        cache.release()
        cache.pool.check_invariants()
