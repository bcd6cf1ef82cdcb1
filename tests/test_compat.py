"""Contract test: PagedCache/PagedLayer answer the transformers Cache API exactly as DynamicCache/DynamicLayer do.

This covers every piece of transformers behaviour `_compat.py` and the cache rely on, so a transformers upgrade that
changes it fails here first.
"""

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, LlamaConfig

from hf_pagedkv import PagedCache
from hf_pagedkv._compat import layer_plan

GEMMA = Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, sliding_window=6)


def test_layer_plan_reads_layer_types_and_windows():
    assert layer_plan(GEMMA) == [("sliding_attention", 6), ("full_attention", None)] * 2
    llama = LlamaConfig(num_hidden_layers=3)
    assert layer_plan(llama) == [("full_attention", None)] * 3


def test_layer_plan_rejects_unsupported_layer_types_by_name():
    cfg = LlamaConfig(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="'linear_attention'.*layer 1"):
        PagedCache(config=cfg)


def _kv(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, n, 4, generator=g), torch.randn(batch, 1, n, 4, generator=g)


def _assert_same(paged, dyn, steps):
    for idx in range(len(dyn.layers)):
        pl, dl = paged.layers[idx], dyn.layers[idx]
        assert pl.get_seq_length() == dl.get_seq_length()
        assert pl.get_max_length() == dl.get_max_length()
        assert pl.is_sliding == dl.is_sliding
        for q in (1, 3):
            assert pl.get_mask_sizes(q) == dl.get_mask_sizes(q), (idx, q, steps)
        assert paged.get_mask_sizes(2, idx) == dyn.get_mask_sizes(2, idx)
    assert paged.get_seq_length() == dyn.get_seq_length()
    assert paged.is_sliding == dyn.is_sliding


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_same_answers_as_dynamic_cache_through_the_cache_api(block_size):
    paged = PagedCache(block_size=block_size, config=GEMMA, debug=True)
    dyn = DynamicCache(config=GEMMA)
    batch = 2
    steps = [5, 1, 1, 3, 1, 1, 1, 2]  # prefill, decode across the window (6) and several blocks, a chunk
    for s, n in enumerate(steps):
        for idx in range(4):
            k, v = _kv(batch, n, seed=100 * s + idx)
            pk, pv = paged.update(k, v, idx)
            dk, dv = dyn.update(k, v, idx)
            assert torch.equal(pk, dk) and torch.equal(pv, dv), (s, idx)
        _assert_same(paged, dyn, s)
    # Full-attention layers expose their whole K/V like DynamicLayer; sliding ones the last window - 1 tokens, too.
    assert torch.equal(paged.layers[1].keys, dyn.layers[1].keys)
    assert torch.equal(paged.layers[0].values, dyn.layers[0].values)
    # Beam reordering and batch selection, then one more step.
    for op, arg in (("reorder_cache", torch.tensor([1, 1])), ("batch_repeat_interleave", 2),
                    ("batch_select_indices", torch.tensor([0, 3, 2]))):
        getattr(paged, op)(arg)
        getattr(dyn, op)(arg)
        n_rows = 4 if op == "batch_repeat_interleave" else (3 if op == "batch_select_indices" else 2)
        for idx in range(4):
            k, v = _kv(n_rows, 1, seed=7 + idx)
            pk, pv = paged.update(k, v, idx)
            dk, dv = dyn.update(k, v, idx)
            assert torch.equal(pk, dk) and torch.equal(pv, dv), (op, idx)
        _assert_same(paged, dyn, op)
    # crop: DynamicCache's sliding layers cannot crop past their window, so compare on the full layers. The sliding
    # group keeps the last step's tokens (what assisted decoding takes back; tests/test_layer_groups.py goes deeper).
    paged.crop(-1)
    assert paged.get_seq_length() == dyn.get_seq_length() - 1
    assert torch.equal(paged.layers[1].keys, dyn.layers[1].keys[:, :, :-1])
    paged.reset()
    assert paged.get_seq_length() == 0 and paged.pool.stats().blocks_in_use == 0
    paged.release()


def test_layer_level_cache_wide_ops_point_to_the_cache():
    cache = PagedCache()
    cache.update(*_kv(1, 3, 0), 0)
    with pytest.raises(NotImplementedError, match="PagedCache.crop"):
        cache.layers[0].crop(-1)
    with pytest.raises(NotImplementedError, match="PagedCache.reorder_cache"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    assert not cache.is_compileable and cache.is_croppable
    cache.release()


def test_lazy_cache_matches_lazy_dynamic_cache():
    paged, dyn = PagedCache(block_size=2), DynamicCache()
    for s, n in enumerate([4, 1, 1]):
        for idx in range(3):
            k, v = _kv(1, n, 10 * s + idx)
            assert all(torch.equal(a, b) for a, b in zip(paged.update(k, v, idx), dyn.update(k, v, idx)))
    assert len(paged.layers) == len(dyn.layers) == 3
    assert paged.get_seq_length() == dyn.get_seq_length() == 6
    paged.release()
