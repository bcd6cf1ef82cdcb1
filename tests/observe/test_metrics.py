"""Pool metrics, alerts and the Prometheus exporter (hf_pagedkv/observe/metrics.py, alerts.py, prometheus.py)."""

from __future__ import annotations

import dataclasses

import json
import logging
import sys
import urllib.request

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError
from hf_pagedkv.observe.latency_histogram import LatencyHistogram
from tests.conftest import ids, tiny_model


def _alert_warnings(caplog, name: str) -> list[logging.LogRecord]:
    """The records of alert `name` firing: INFO on `hf_pagedkv.observe.alerts` (opt-in, never on stderr by default)."""
    return [r for r in caplog.records if r.name == "hf_pagedkv.observe.alerts" and r.levelno == logging.INFO
            and f"alert {name}:" in r.getMessage()]


def test_counters_follow_a_generate_call():
    # B=4, a 10-token prompt: the prefill allocates 3 blocks in one request; 5 new tokens are cached after it
    # (generate does not feed its last token back), and crossing token 12 allocates a 4th block: 2 requests.
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=16)
    with PagedCache(pool=pool) as cache:
        model.generate(ids(1, 10), past_key_values=cache, max_new_tokens=6, do_sample=False)
        assert cache.get_seq_length() == 15
        snap = pool.metrics.snapshot()
        assert snap.stats.blocks_in_use == 4
        assert (snap.allocation_requests, snap.blocks_allocated, snap.allocation_failures) == (2, 4, 0)
        assert snap.failure_rate == 0.0
        assert snap.occupancy == 4 / 16
        assert snap.fragmentation == 1 - 15 / 16
        assert snap.peak_blocks_in_use == 4
        # 6 new tokens = 1 prefill + 5 decode steps; latencies are the 4 intervals between decode steps.
        assert snap.decode_steps == 4 == snap.window_steps == pool.metrics.histogram.count
        assert 0 < snap.step_p50 <= snap.step_p90 <= snap.step_p99
        assert snap.prefix_lookups == 0 and snap.prefix_hit_rate is None and not snap.prefix_caching
        json.dumps(snap.to_dict())
    pool.check_invariants()
    assert pool.metrics.snapshot().peak_blocks_in_use == 4  # the peak outlives the release


def test_beam_search_counts_copy_on_write():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    with PagedCache(pool=pool) as cache:
        model.generate(ids(1, 10), past_key_values=cache, max_new_tokens=8, num_beams=3, do_sample=False)
        snap = pool.metrics.snapshot()
    # beams share the prompt's partial last block, so their first writes into it copy it first
    assert snap.cow_copies >= 2
    assert snap.decode_steps == 8 - 2


def test_allocation_failure_alert_logs_once_and_shows_in_health(caplog):
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=2)
    assert pool.health().ok
    caplog.set_level(logging.INFO, logger="hf_pagedkv.observe.alerts")
    for _ in range(3):  # three failed prefills of 12 tokens (3 blocks) into a pool of 2
        with PagedCache(pool=pool) as cache, pytest.raises(PoolExhaustedError):
            model(ids(1, 12), past_key_values=cache)
        pool.check_invariants()
    health = pool.health()
    assert not health.ok
    assert [a.name for a in health.alerts] == ["allocation_failure_rate"]
    assert health.alerts[0].value == 1.0 and health.alerts[0].threshold == 0.001
    snap = health.snapshot
    assert (snap.allocation_requests, snap.allocation_failures, snap.failure_rate) == (3, 3, 1.0)
    assert snap.alerts == ("allocation_failure_rate",)
    assert len(_alert_warnings(caplog, "allocation_failure_rate")) == 1  # one warning for the crossing, not three
    assert "allocation failure rate" in str(health)
    assert pool.stats().blocks_in_use == 0


def test_occupancy_alert_hysteresis(caplog):
    # threshold 0.85, hysteresis 0.1: fires above 0.85, clears only at or below 0.765
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=10)
    caplog.set_level(logging.INFO, logger="hf_pagedkv.observe.alerts")
    a = PagedCache(pool=pool)
    model(ids(1, 36), past_key_values=a)  # 9 of 10 blocks: 0.9
    assert [x.name for x in pool.health().alerts] == ["occupancy"]
    pool.health()
    assert len(_alert_warnings(caplog, "occupancy")) == 1
    a.crop(-4)  # 8 blocks: 0.8, below the threshold but above the clearing level: still firing
    assert not pool.health().ok
    a.crop(-8)  # 6 blocks: 0.6: clears
    assert pool.health().ok
    assert any("alert occupancy cleared" in r.getMessage() for r in caplog.records)
    b = PagedCache(pool=pool)
    model(ids(1, 12), past_key_values=b)  # 9 blocks again: fires a second time
    assert not pool.health().ok
    assert len(_alert_warnings(caplog, "occupancy")) == 2
    a.release()
    b.release()
    pool.check_invariants()


def test_step_latency_alert_against_the_run_baseline(monkeypatch, caplog):
    pool = BlockPool(block_size=4)
    m = pool.metrics
    m.configure(window=2.0, min_window_steps=8, check_interval=0.0)
    clock = [100.0]
    monkeypatch.setattr("hf_pagedkv.observe.metrics.time.perf_counter", lambda: clock[0])
    caplog.set_level(logging.INFO, logger="hf_pagedkv.observe.alerts")

    class FakeCache:  # any object a weak reference can point to stands for a cache
        pass

    cache = FakeCache()

    def steps(n: int, seconds: float) -> None:
        for _ in range(n):
            clock[0] += seconds
            m.on_step(cache, 1)

    steps(1 + 4 + 32, 0.010)  # first step starts the clock, 4 warm-up steps, 32 baseline steps of 10 ms
    assert m.baseline_p99 == pytest.approx(0.010)
    assert pool.health().ok
    steps(20, 0.050)  # 50 ms > 2 x 10 ms
    health = pool.health()
    assert [a.name for a in health.alerts] == ["step_latency"]
    assert health.alerts[0].threshold == pytest.approx(0.020)
    steps(300, 0.010)  # 3 s of fast steps: the slow ones leave the 2 s window
    assert pool.health().ok
    assert len(_alert_warnings(caplog, "step_latency")) == 1
    steps(1, 5.0)  # a multi-token step (prefill) ends the interval: the pause is never timed
    m.on_step(cache, 7)
    clock[0] += 60.0
    m.on_step(cache, 1)
    assert max(s for _, s in m.histogram.recent) == pytest.approx(5.0)  # the 60 s gap was not recorded


def test_prefix_counters_and_hit_rate_alert(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hf_pagedkv.observe.alerts")
    off, on = BlockPool(block_size=4), BlockPool(block_size=4, prefix_caching=True)
    for pool in (off, on):  # 50 lookups of 600 tokens in all, 300 of them hits: hit rate 0.5
        fake = dataclasses.replace(pool.stats(), lookups=50, lookup_tokens=600, hit_tokens=300, evictions=7,
                                   cow_copies=3)
        monkeypatch.setattr(pool, "stats", lambda fake=fake: fake)
        snap = pool.metrics.snapshot()
        assert (snap.prefix_lookups, snap.prefix_hit_tokens, snap.evictions, snap.cow_copies) == (50, 300, 7, 3)
        assert snap.prefix_hit_rate == 0.5
    assert off.health().ok  # prefix caching is off: no hit-rate alert
    health = on.health()
    assert [a.name for a in health.alerts] == ["prefix_hit_rate"]
    assert len(_alert_warnings(caplog, "prefix_hit_rate")) == 1


def test_histogram_buckets_and_percentiles():
    h = LatencyHistogram(buckets=(0.01, 0.1))
    for i, s in enumerate([0.005, 0.01, 0.05, 0.2, 0.02]):
        h.observe(s, now=float(i))
    assert h.cumulative() == [("0.01", 2), ("0.1", 4), ("+Inf", 5)]
    assert h.sum == pytest.approx(0.285)
    assert h.percentiles((0.5, 0.99)) == (5, (0.02, 0.2))
    assert h.percentiles((0.5,), since=3.0) == (2, (0.02,))
    assert h.percentiles((0.5,), since=10.0) == (0, (None,))


def test_bad_alert_settings():
    pool = BlockPool()
    with pytest.raises(ValueError, match="Unknown alert setting"):
        pool.metrics.configure(ocupancy=0.9)
    with pytest.raises(ValueError, match=r"occupancy must be a number in \[0, 1\], got 1.5"):
        pool.metrics.configure(occupancy=1.5)
    assert pool.metrics.configure(occupancy=0.9).occupancy == 0.9


def test_prometheus_exporter_serves_the_pool():
    parser = pytest.importorskip("prometheus_client.parser")
    from hf_pagedkv.observe.prometheus import start_prometheus_server

    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=32)
    cache = PagedCache(pool=pool)
    with torch.inference_mode():
        model.generate(ids(2, 9), past_key_values=cache, max_new_tokens=6, do_sample=False)
    with start_prometheus_server({"main": pool}, port=0) as exporter:
        assert exporter.port > 0 and exporter.addr == "127.0.0.1"
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in parser.text_string_to_metric_families(body) for s in fam.samples}
    stats, snap = pool.stats(), pool.metrics.snapshot()

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted({"pool": "main", **labels}.items())))]

    assert value("hf_pagedkv_pool_blocks", state="in_use") == stats.blocks_in_use == 2 * 4  # 14 tokens a row
    assert value("hf_pagedkv_pool_blocks", state="free") == stats.blocks_free
    assert value("hf_pagedkv_pool_bytes", state="in_use") == stats.bytes_in_use
    assert value("hf_pagedkv_pool_bytes", state="reserved") == stats.bytes_reserved
    assert value("hf_pagedkv_pool_tokens") == stats.tokens_stored == 2 * 14
    assert value("hf_pagedkv_pool_occupancy_ratio") == pytest.approx(8 / 32)
    assert value("hf_pagedkv_allocation_requests_total") == snap.allocation_requests
    assert value("hf_pagedkv_blocks_allocated_total") == snap.blocks_allocated
    assert value("hf_pagedkv_allocation_failures_total") == 0
    assert value("hf_pagedkv_decode_step_seconds_count") == snap.decode_steps == 4
    assert value("hf_pagedkv_decode_step_seconds_bucket", le="+Inf") == 4
    assert value("hf_pagedkv_alert_active", alert="occupancy") == 0
    cache.release()


def test_prometheus_missing_dependency_names_the_extra(monkeypatch):
    from hf_pagedkv.observe.prometheus import start_prometheus_server

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r'pip install "\.\[metrics\]"'):
        start_prometheus_server(BlockPool())


def test_growable_pool_never_raises_the_occupancy_alert():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)  # grows on demand: right after a prefill it is often exactly full
    with PagedCache(pool=pool) as cache, PagedCache(pool=pool) as other:
        model(ids(1, 64 * 4), past_key_values=cache)  # 64 blocks, and the pool grew with 16 blocks of headroom
        model(ids(1, 16 * 4), past_key_values=other)  # fills the headroom exactly
        assert pool.metrics.snapshot().occupancy == 1.0
        assert pool.health().ok
