"""Prefix blocks the device tier evicts move to the host tier, and a hit copies them back before any read: the
catalogued offload race, exactness of a hit served from the host, and a failed copy-back."""

import pytest
import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from tests.conftest import ids, tiny_model
from tests.prefix_utils import GEN, assert_same_output, fresh_generate, tiny_single_thread  # noqa: F401

B = 4


@torch.no_grad()
def prefill(model, pool, x) -> PagedCache:
    cache = PagedCache.from_prefix(pool, x, model=model)
    model(x[:, cache.get_seq_length():], **cache_kwargs(cache))
    return cache


def keys(cache, n: int) -> list[torch.Tensor]:
    """Each layer's keys and values of the first `n` tokens (copies)."""
    return [t[:, :, :n].clone() for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_the_offload_race_reloaded_kv_equals_the_original_and_the_reuser_is_untouched(quant):
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=10, prefix_caching=True, host_memory="1MiB", debug=True, quant=quant)
    a_seq = ids(1, 16, seed=1)  # 4 full blocks
    a = prefill(model, pool, a_seq)
    a_kv = keys(a, 16)
    a.publish(a_seq)
    a.release()  # 4 cached-idle blocks, A's tail the oldest
    d_seq = ids(1, 12, seed=2)
    d = prefill(model, pool, d_seq)
    d.publish(d_seq)
    d.release()  # 3 more cached-idle blocks, newer; 3 free
    # B takes the 3 free blocks and evicts the 2 oldest idle ones (A's last two): they move to the host first
    b = prefill(model, pool, ids(1, 19, seed=3))
    b_kv = keys(b, 19)
    pool.check_invariants()
    host = pool.host.stats()
    assert (pool.stats().evictions, host.blocks_demoted, host.blocks_cached) == (2, 2, 2)
    # C hits all of A: 2 blocks on the device, 2 copied back from the host into blocks D's evicted tail freed
    c_seq = torch.cat([a_seq, ids(1, 3, seed=4)], 1)
    c = prefill(model, pool, c_seq)
    pool.check_invariants()
    assert c.get_seq_length() == 19 and pool.stats().hit_tokens == 16
    assert pool.host.stats().blocks_promoted == 2
    for got, want in zip(keys(c, 16), a_kv):
        assert torch.equal(got, want)  # the reloaded K/V equal the original
    for got, want in zip(keys(b, 19), b_kv):
        assert torch.equal(got, want)  # and the request that reused the device blocks is untouched
    b.release()
    c.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == 0


def test_a_hit_served_from_the_host_equals_a_fresh_run():
    model = tiny_model("gemma2")  # a full-attention and a sliding-window group
    pool = BlockPool(block_size=B, num_blocks=12, prefix_caching=True, host_memory="1MiB", debug=True)
    system = ids(1, 4 * B, seed=5)
    hf_pagedkv.generate(model, torch.cat([system, ids(1, 2, seed=6)], 1), pool=pool, **GEN)
    for seed in (7, 8):  # unrelated requests push the system prompt's blocks out of the device tier
        hf_pagedkv.generate(model, ids(1, 30, seed=seed), pool=pool, **GEN)
    pool.check_invariants()
    assert pool.host.stats().blocks_demoted > 0
    y = torch.cat([system, ids(1, 5, seed=9)], 1)
    before = pool.stats().hit_tokens
    out = hf_pagedkv.generate(model, y, pool=pool, **GEN)
    pool.check_invariants()
    assert pool.stats().hit_tokens - before == 4 * B and pool.host.stats().blocks_promoted > 0
    assert_same_output(fresh_generate(model, y), out)


def test_an_exception_during_a_copy_back_leaves_both_tiers_exact(monkeypatch):
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=6, prefix_caching=True, host_memory="1MiB", debug=True)
    x = ids(1, 13, seed=10)
    hf_pagedkv.generate(model, x, pool=pool, **GEN)
    hf_pagedkv.generate(model, ids(1, 17, seed=11), pool=pool, **GEN)  # x's blocks go to the host
    cached = pool.host.stats().blocks_cached
    assert cached > 0
    store = type(pool.groups[0].store)

    def broken(self, blocks, tensors):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(store, "import_blocks", broken)
    before = pool.stats()
    with pytest.raises(RuntimeError, match="copy failed"):
        PagedCache.from_prefix(pool, x, model=model)
    pool.check_invariants()
    after = pool.stats()
    # the host copies are still there (making room may have moved more idle device blocks to the host)
    assert pool.host.stats().blocks_cached >= cached and pool.host.stats().blocks_promoted == 0
    assert (after.blocks_in_use, after.blocks_free + after.blocks_cached) == (0, before.blocks_free
                                                                              + before.blocks_cached)
    monkeypatch.undo()
    hits = pool.stats().hit_tokens
    out = hf_pagedkv.generate(model, x, pool=pool, **GEN)  # and a later request hits all of x's prefix
    pool.check_invariants()
    assert pool.stats().hit_tokens - hits == 12 and pool.host.stats().blocks_promoted > 0
    assert_same_output(fresh_generate(model, x), out)


def test_save_prefix_cache_writes_both_tiers(tmp_path):
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=6, prefix_caching=True, host_memory="1MiB")
    x = ids(1, 13, seed=12)
    hf_pagedkv.generate(model, x, pool=pool, **GEN)
    hf_pagedkv.generate(model, ids(1, 17, seed=13), pool=pool, **GEN)  # x's blocks go to the host
    on_host, on_device = pool.host.stats().blocks_cached, pool.stats().blocks_cached
    assert on_host > 0
    path = tmp_path / "p.safetensors"
    assert pool.save_prefix_cache(path) == on_host + on_device
    loaded = BlockPool.load_prefix_cache(path, model=model)  # no host tier: all on the device
    assert loaded.stats().blocks_cached == on_host + on_device
    out = hf_pagedkv.generate(model, x, pool=loaded, **GEN)
    assert loaded.stats().hit_tokens == 12
    loaded.check_invariants()
    assert_same_output(fresh_generate(model, x), out)
