"""GET /metrics: per-request latency histograms and counters by endpoint and status, the four service signals (KV
memory, allocation failure rate, prefix hit rate, P99 latency) equal to what the engine and the pool report, and
the pool's own series."""

import time

from prometheus_client.parser import text_string_to_metric_families

from hf_pagedkv import BlockPool
from tests.serving.server_helpers import (BLOCK, MODEL, PROMPTS, get, openai, running_server,
                                          tiny_single_thread)  # noqa: F401


def scrape(srv) -> dict:
    """{(sample name, frozenset of labels): value}."""
    status, text = get(srv.port, "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_request_histograms_and_service_signals():
    with running_server() as srv:
        walls = []
        for i, prompt in enumerate(PROMPTS):
            t0 = time.perf_counter()
            if i % 2:
                list(srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                   stream=True))
            else:
                srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            walls.append(time.perf_counter() - t0)
        srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        for _ in range(2):
            try:
                srv.client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
            except openai.BadRequestError:
                pass
        srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)  # a prefix hit
        srv.wait_idle()
        m = scrape(srv)
        engine, pool = srv.service.engine.stats(), srv.pool.stats()
    assert value(m, "hf_pagedkv_server_requests_total", endpoint="completions", status="200") == 5
    assert value(m, "hf_pagedkv_server_requests_total", endpoint="completions", status="400") == 2
    assert value(m, "hf_pagedkv_server_requests_total", endpoint="chat", status="200") == 1
    assert value(m, "hf_pagedkv_server_ttft_seconds_count", endpoint="completions") == 5
    assert value(m, "hf_pagedkv_server_request_seconds_count", endpoint="completions") == 5
    assert value(m, "hf_pagedkv_server_request_seconds_bucket", endpoint="completions", le="+Inf") == 5
    assert value(m, "hf_pagedkv_server_completion_tokens_total") == engine.num_tokens_generated
    # the four service signals
    assert value(m, "hf_pagedkv_service_kv_memory_bytes", state="in_use") == pool.bytes_in_use == 0
    assert value(m, "hf_pagedkv_service_kv_memory_bytes", state="reserved") == pool.bytes_reserved > 0
    assert value(m, "hf_pagedkv_service_allocation_failure_rate") == 0.0  # a growable pool never runs out
    hit = value(m, "hf_pagedkv_service_prefix_hit_ratio")
    assert hit == engine.prefix_hit_rate > 0
    e2e_p99 = value(m, "hf_pagedkv_service_latency_p99_seconds", kind="e2e")
    assert 0 < value(m, "hf_pagedkv_service_latency_p99_seconds", kind="ttft") <= e2e_p99 <= max(walls) + 1.0
    # the pool's own series
    assert value(m, "hf_pagedkv_pool_blocks", pool="engine", state="in_use") == 0
    cached = value(m, "hf_pagedkv_pool_blocks", pool="engine", state="cached")  # the prompts' published blocks
    assert cached == pool.blocks_cached > 0
    assert cached + value(m, "hf_pagedkv_pool_blocks", pool="engine", state="free") == pool.num_blocks
    assert value(m, "hf_pagedkv_service_requests", state="running") == 0


def test_allocation_failures_show_in_a_full_pool():
    pool = BlockPool(block_size=BLOCK, num_blocks=12, prefix_caching=True, debug=True)  # 48 tokens for everyone
    with running_server(pool) as srv:
        streams = [srv.client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}) for p in PROMPTS]
        texts = ["".join(c.choices[0].text for c in s) for s in streams]
        srv.wait_idle()
        m = scrape(srv)
        engine = srv.service.engine.stats()
    assert all(texts)
    assert engine.num_allocation_failures > 0
    assert value(m, "hf_pagedkv_service_allocation_failures_total") == engine.num_allocation_failures
    assert value(m, "hf_pagedkv_service_allocation_failure_rate") > 0
    assert value(m, "hf_pagedkv_service_kv_memory_ratio") == 0.0
    assert value(m, "hf_pagedkv_service_preemptions_total") == engine.num_preemptions
    assert value(m, "hf_pagedkv_service_swaps_total") == engine.num_swaps == 0  # no host tier: recomputed


def test_every_metric_of_the_grafana_dashboard_is_served():
    """examples/grafana_dashboard.json queries only series that /metrics exposes (a renamed metric breaks it)."""
    import json
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json").read_text())
    names = {name for panel in board["panels"] for target in panel["targets"]
             for name in re.findall(r"\bhf_pagedkv_[a-z0-9_]+", target["expr"])}
    assert len(names) >= 10
    with running_server() as srv:
        srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
        srv.wait_idle()
        served = {name for name, _ in scrape(srv)}
    assert names <= served, sorted(names - served)
