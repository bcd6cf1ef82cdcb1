"""Host-tier counters in `pool.stats()`, the metrics snapshot and the Prometheus exporter, after a known sequence of
offloads, prefetches and demotions."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from tests.conftest import ids, tiny_model
from tests.prefix_utils import tiny_single_thread  # noqa: F401 (autouse fixture)

B = 4
BLOCK = 3 * 2 * 2 * 16 * 4 * B  # tiny llama: 3 layers x K+V x 2 KV heads x head_dim 16 x fp32 x 4 tokens = 3 KiB


def host_counters(st) -> tuple:
    return (st.host_blocks, st.host_blocks_in_use, st.host_blocks_cached, st.host_blocks_free, st.blocks_to_host,
            st.blocks_from_host, st.bytes_to_host, st.bytes_from_host)


@torch.no_grad()
def run_sequence(model, pool) -> None:
    """Offload a 3-block cache, prefetch it, then publish 2 full blocks and let a hog evict them to the host."""
    x = ids(1, 11, seed=1)  # 3 blocks: 2 full + 1 partial
    cache = PagedCache.from_prefix(pool, x, model=model)
    model(x, **cache_kwargs(cache))
    pool.check_invariants()
    # nothing has used the host tier yet: its budget is known, its blocks are not (it is sized at its first use)
    st = pool.stats()
    assert st.host_memory == 6 * BLOCK and host_counters(st) == (0,) * 8 and st.host_usage == 0.0
    cache.offload()
    pool.check_invariants()
    assert host_counters(pool.stats()) == (6, 3, 0, 3, 3, 0, 3 * BLOCK, 0)
    cache.prefetch()
    pool.check_invariants()
    assert host_counters(pool.stats()) == (6, 0, 0, 6, 3, 3, 3 * BLOCK, 3 * BLOCK)
    cache.publish(x)  # 2 full blocks published
    cache.release()  # ... now cached-idle on the device
    pool.check_invariants()
    with PagedCache(pool=pool, config=model.config) as hog:  # 8 blocks: the 2 idle ones are evicted, to the host
        model(ids(1, 32, seed=2), **cache_kwargs(hog))
        pool.check_invariants()
        st = pool.stats()
        assert (st.blocks_in_use, st.blocks_cached, st.evictions) == (8, 0, 2)
        assert host_counters(st) == (6, 0, 2, 4, 5, 3, 5 * BLOCK, 3 * BLOCK)
        assert st.host_usage == pytest.approx(2 / 6)
    pool.check_invariants()


def test_host_counters_in_stats_and_snapshot():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=8, prefix_caching=True, host_memory=6 * BLOCK, debug=True)
    assert pool.metrics.snapshot().host_occupancy is None  # not sized yet
    run_sequence(model, pool)
    st = pool.stats()
    assert st.bytes_per_block == BLOCK  # what a block export moves, for full-precision storage
    assert st.host_bytes_reserved == 6 * BLOCK  # preallocated at the first offload
    host = pool.host.stats()
    assert (host.blocks_offloaded, host.blocks_prefetched, host.blocks_demoted, host.blocks_promoted) == (3, 3, 2, 0)
    snap = pool.metrics.snapshot()
    assert snap.host_occupancy == pytest.approx(2 / 6)
    assert (snap.blocks_to_host, snap.blocks_from_host, snap.bytes_to_host, snap.bytes_from_host) == (
        5, 3, 5 * BLOCK, 3 * BLOCK)
    assert snap.bytes_to_host_per_s >= 0 and snap.to_dict()["stats"]["host_blocks_cached"] == 2


def test_a_pool_without_host_tier_reports_none():
    pool = BlockPool(block_size=B, num_blocks=8)
    st = pool.stats()
    assert st.host_memory is None and host_counters(st) == (0,) * 8
    assert pool.metrics.snapshot().host_occupancy is None


def test_prometheus_exports_the_host_tier():
    parser = pytest.importorskip("prometheus_client.parser")
    from hf_pagedkv.observe.prometheus import start_prometheus_server

    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=8, prefix_caching=True, host_memory=6 * BLOCK)
    plain = BlockPool(block_size=B, num_blocks=8)
    run_sequence(model, pool)
    with start_prometheus_server({"main": pool, "plain": plain}, port=0) as exporter:
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in parser.text_string_to_metric_families(body) for s in fam.samples}

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted({"pool": "main", **labels}.items())))]

    assert [value("hf_pagedkv_host_blocks", state=s) for s in ("in_use", "cached", "free")] == [0, 2, 4]
    assert value("hf_pagedkv_host_bytes", state="reserved") == 6 * BLOCK
    assert value("hf_pagedkv_host_bytes", state="budget") == 6 * BLOCK
    assert value("hf_pagedkv_host_blocks_moved_total", direction="to_host") == 5
    assert value("hf_pagedkv_host_blocks_moved_total", direction="from_host") == 3
    assert value("hf_pagedkv_host_bytes_moved_total", direction="to_host") == 5 * BLOCK
    assert value("hf_pagedkv_host_bytes_moved_total", direction="from_host") == 3 * BLOCK
    # a pool without a host tier exports no host series
    assert not [k for k in samples if k[0].startswith("hf_pagedkv_host") and ("pool", "plain") in k[1]]
