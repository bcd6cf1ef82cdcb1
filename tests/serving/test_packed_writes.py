"""A packed step's writes for every request at once (`PackedWrites`, `StepIO`) store and read exactly what each
request's own `PagedCache.update` stores and reads: the same slots, the same history, the same masks. Each scenario
runs twice on twin pools, once through `PackedCache.update` and once through every cache's `update`, and compares
every layer's parts and the pools' storage."""

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.retention import SinkWindow
from hf_pagedkv.serving.packed_cache import PackedCache, PackedSegment, PackedWrites, packed_parts
from tests.conftest import tiny_model

BLOCK = 4


def kv(config, n, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (1, config.num_key_value_heads, n, config.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def run_step(caches, qs, config, seed, packed):
    """One step of `qs[i]` new tokens for cache `i`, every layer: through a `PackedCache` (`packed`) or each cache's
    own `update`. Returns the parts of every layer (lo, hi, keys, values, mask) and the `PackedCache` (or None)."""
    segments, lo = [], 0
    for cache, q in zip(caches, qs):
        segments.append(PackedSegment(cache, lo, lo + q, cache.get_seq_length()))
        lo += q
    step = PackedCache(segments) if packed else None
    layers = []
    for layer_idx in range(config.num_hidden_layers):
        k, v = kv(config, lo, seed * 100 + layer_idx)
        if packed:
            step.update(k, v, layer_idx)
            # (copies: a view of the pool changes with later steps)
            layers.append([(p.lo, p.hi, p.keys.clone(), p.values.clone(), p.mask) for p in packed_parts(k).parts])
            continue
        parts = []
        for seg in segments:
            keys, values = seg.cache.update(k[:, :, seg.lo: seg.hi], v[:, :, seg.lo: seg.hi], layer_idx)
            mask = None if seg.hi - seg.lo == 1 else PackedCache(segments)._mask(
                seg.start, seg.hi - seg.lo, keys.shape[-2], seg.cache.layers[layer_idx].sliding_window, keys.device)
            parts.append((seg.lo, seg.hi, keys.clone(), values.clone(), mask))
        layers.append(parts)
    return layers, step


def same_parts(a, b):
    assert len(a) == len(b)
    for layer_a, layer_b in zip(a, b):
        for (lo, hi, k, v, m), (lo2, hi2, k2, v2, m2) in zip(layer_a, layer_b, strict=True):
            assert (lo, hi) == (lo2, hi2)
            assert torch.equal(k, k2) and torch.equal(v, v2)
            assert (m is None and m2 is None) or torch.equal(m, m2)


def schedule(name, steps, retention_of=()):
    """Both runs of `steps` (lists of per-cache new tokens; 0: the cache sits the step out) on twin pools; returns
    the packed run's `PackedCache` of each step and the two pools."""
    config = tiny_model(name).config
    out = {}
    for packed in (True, False):
        pool = BlockPool(block_size=BLOCK, debug=True)
        caches = [PagedCache(pool=pool, config=config, retention=SinkWindow(sink_tokens=4, window=8)
                             if i in retention_of else None) for i in range(len(steps[0]))]
        runs, steps_seen = [], []
        for s, qs in enumerate(steps):
            chosen = [(c, q) for c, q in zip(caches, qs) if q]
            parts, step = run_step([c for c, _ in chosen], [q for _, q in chosen], config, s, packed)
            runs.append(parts)
            steps_seen.append(step)
            pool.check_invariants()
        out[packed] = (runs, steps_seen, pool, caches)
    (packed_runs, steps_seen, pool, caches), (ref_runs, _, ref_pool, ref_caches) = out[True], out[False]
    for a, b in zip(packed_runs, ref_runs):
        same_parts(a, b)
    for c, r in zip(caches, ref_caches):
        assert [layer.num_tokens for layer in c.layers] == [layer.num_tokens for layer in r.layers]
        for i in range(config.num_hidden_layers):  # every layer's stored history, read back through the cache
            assert torch.equal(c.layers[i].keys, r.layers[i].keys) and torch.equal(c.layers[i].values,
                                                                                    r.layers[i].values)
    return steps_seen, pool, caches


def test_decodes_and_prefills_share_one_write_per_layer():
    # prefills of 5, 9 and 3 tokens, then steps of decodes next to a late prefill chunk; the caches' blocks
    # interleave (a request's blocks are not consecutive: its history is gathered) in some steps
    steps = [[5, 9, 3, 0], [1, 1, 1, 6], [1, 1, 1, 7], [1, 0, 1, 1], [1, 1, 1, 1]]
    seen, pool, caches = schedule("llama", steps)
    later = seen  # (fresh caches too: their layers' specs are fixed from the step's K/V, as `update` does)
    for step in seen:
        writes = step._writes[0]
        assert isinstance(writes, PackedWrites)
        assert all(io is not None for io in writes.ios)  # every request in the one write
        assert writes.tokens is None and writes.slots.shape == (sum(s.hi - s.lo for s in step.segments),)
    assert any(io.view_start is None for step in later for io in step._writes[0].ios )  # a gathered history
    assert any(io.view_start is not None for step in later for io in step._writes[0].ios )  # a view
    for c in caches:
        c.release()
    assert pool.stats().blocks_in_use == 0


def test_sliding_window_groups_each_get_their_writes():
    # gemma2: sliding (window 8) and full-attention layers in two groups; decodes past the window
    steps = [[6, 10], [1, 1], [9, 1], [1, 1], [1, 1]]
    seen, pool, caches = schedule("gemma2", steps)
    for step in seen[1:]:
        assert len(step._writes) == 2 and all(isinstance(w, PackedWrites) for w in step._writes.values())
        los = {g: [io.lo for io in w.ios] for g, w in step._writes.items()}
        assert any(lo > 0 for lo in sum(los.values(), []))  # a sliding layer reads from its window's start
    for c in caches:
        c.release()


def test_a_request_with_a_retention_policy_goes_through_its_cache():
    # request 1 evicts (sink_window) before each step: its segment is written by its own `update`, the others
    # by the one write, with the packed positions of their tokens
    steps = [[6, 10, 4], [1, 1, 1], [1, 3, 1], [1, 1, 1], [1, 1, 1]]
    seen, pool, caches = schedule("llama", steps, retention_of=(1,))
    for step in seen[1:]:
        ios = step._writes[0].ios
        assert ios[1] is None and ios[0] is not None and ios[2] is not None
        segs = step.segments
        expect = list(range(segs[0].lo, segs[0].hi)) + list(range(segs[2].lo, segs[2].hi))
        assert step._writes[0].tokens.tolist() == expect
    assert caches[1].retention_stats().num_evictions > 0
    for c in caches:
        c.release()


def test_step_io_refuses_what_it_does_not_cover_and_a_layer_written_twice():
    config = tiny_model("llama").config
    pool = BlockPool(block_size=BLOCK)
    cache = PagedCache(pool=pool, config=config)
    layers = cache.layers
    assert cache.runner.step_io(layers[0]) is None  # no step planned
    run_step([cache], [5], config, 0, packed=False)
    assert cache.runner.step_io(layers[1]) is None  # every layer wrote the step
    k, v = kv(config, 1, 7)
    cache.update(k, v, 0)  # the next step, planned by its first layer
    io = cache.runner.step_io(layers[1])
    assert (io.start, io.end, io.lo, io.slots.shape) == (5, 6, 0, (1,))
    io.store.write(1, io.slots, k, v)
    io.written(layers[1])
    assert layers[1].num_tokens == 6
    with pytest.raises(RuntimeError, match="holds 6 tokens, not the 5 of the step being written"):
        io.written(layers[1])
    keys, values = io.read(layers[1])
    assert keys.shape == (1, config.num_key_value_heads, 6, config.head_dim) and torch.equal(keys[:, :, -1:], k)
    quant = PagedCache(pool=BlockPool(block_size=32, quant="k8v4"), config=config)
    run_step([quant], [3], config, 1, packed=False)
    quant.update(k, v, 0)
    assert quant.runner.step_io(quant.layers[1]) is None  # a quantized store writes through `update`
    quant.release()
    cache.release()
