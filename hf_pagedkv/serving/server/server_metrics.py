"""`ServerMetrics`: what GET /metrics serves, in Prometheus' text format (``prometheus_client``).

Per request (observed when its answer is complete)::

    hf_pagedkv_server_requests_total{endpoint, status}                  counter, HTTP status of every answer
    hf_pagedkv_server_ttft_seconds{endpoint}                             histogram, arrival -> first token
    hf_pagedkv_server_request_seconds{endpoint}                          histogram, arrival -> answer complete
    hf_pagedkv_server_time_per_output_token_seconds{endpoint}            histogram, (end - first token) / (tokens - 1)
    hf_pagedkv_server_prompt_tokens_total, ..._completion_tokens_total   counters

The four service signals (gauges read at scrape time)::

    hf_pagedkv_service_kv_memory_bytes{state="in_use"|"reserved"}   KV memory of the pool
    hf_pagedkv_service_kv_memory_ratio                              blocks in use / blocks held
    hf_pagedkv_service_allocation_failure_rate                      engine allocation failures per second over the
                                                                    last 60 s (a request's next blocks were not
                                                                    free: it waited, or a request was preempted)
    hf_pagedkv_service_prefix_hit_ratio                             prompt tokens served from cached blocks / looked up
    hf_pagedkv_service_latency_p99_seconds{kind="ttft"|"e2e"}       P99 (nearest rank) of the requests answered in
                                                                    the last 60 s

and the engine's state: ``hf_pagedkv_service_requests{state="running"|"waiting"}``, ``hf_pagedkv_service_draining``,
counters of preemptions, swaps, allocation failures, generated tokens; plus the pool's own series (`PoolCollector`,
label ``pool="engine"``).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hf_pagedkv.observe.latency_histogram import nearest_rank
from hf_pagedkv.observe.prometheus import PoolCollector

WINDOW_S = 60.0  # seconds the service signals' rates and percentiles cover
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The server's Prometheus registry (its own, not the process-global one).

    Args:
        service (`EngineService`): read at scrape time (its engine, pool, runner).
    """

    def __init__(self, service) -> None:
        self.service = service  # fixed
        self.registry = CollectorRegistry()  # fixed
        r = self.registry
        self.requests = Counter("hf_pagedkv_server_requests", "Answers by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("hf_pagedkv_server_ttft_seconds", "Arrival to the first generated token.",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hf_pagedkv_server_request_seconds", "Arrival to the complete answer.", ["endpoint"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hf_pagedkv_server_time_per_output_token_seconds",
                              "Time per generated token after the first.", ["endpoint"], buckets=TOKEN_BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("hf_pagedkv_server_prompt_tokens", "Prompt tokens of answered requests.",
                                     registry=r)
        self.completion_tokens = Counter("hf_pagedkv_server_completion_tokens", "Tokens generated for clients.",
                                         registry=r)
        pools = PoolCollector()
        pools.add(service.pool, "engine")
        r.register(pools)
        r.register(_ServiceCollector(self))
        self._lock = threading.Lock()  # guards the windows below
        self._recent: deque[tuple[float, float, float | None]] = deque()  # (end time, e2e, ttft), last WINDOW_S
        self._failures: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])  # (time, engine failures)

    def observe(self, endpoint: str, status: int, started: float | None = None, first_token: float | None = None,
                ended: float | None = None, completion_tokens: int = 0, prompt_tokens: int = 0) -> None:
        """One answered request (times: `time.perf_counter()`; a 4xx/5xx without generation gives none)."""
        self.requests.labels(endpoint, str(status)).inc()
        if started is None or ended is None:
            return
        e2e = ended - started
        ttft = None if first_token is None else first_token - started
        self.e2e.labels(endpoint).observe(e2e)
        if ttft is not None:
            self.ttft.labels(endpoint).observe(ttft)
            if completion_tokens > 1:
                self.tpot.labels(endpoint).observe((ended - first_token) / (completion_tokens - 1))
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, e2e, ttft))
            self._trim(now)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def window(self, failures: int) -> tuple[float, list[float], list[float]]:
        """Allocation failures per second over the window, and its e2e and TTFT samples (sorted)."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            self._failures.append((now, failures))
            while len(self._failures) > 2 and self._failures[1][0] <= now - WINDOW_S:
                self._failures.popleft()
            t0, f0 = self._failures[0]
            rate = (failures - f0) / (now - t0) if now > t0 else 0.0
            e2e = sorted(x[1] for x in self._recent)
            ttft = sorted(x[2] for x in self._recent if x[2] is not None)
        return rate, e2e, ttft


class _ServiceCollector:
    """The service signals and the engine's state, read at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        service = self._metrics.service
        st = service.engine.stats()
        pool = service.pool.stats()
        rate, e2e, ttft = self._metrics.window(st.num_allocation_failures)
        kv = GaugeMetricFamily("hf_pagedkv_service_kv_memory_bytes", "KV memory of the engine's pool.",
                               labels=["state"])
        kv.add_metric(["in_use"], pool.bytes_in_use)
        kv.add_metric(["reserved"], pool.bytes_reserved)
        yield kv
        yield GaugeMetricFamily("hf_pagedkv_service_kv_memory_ratio", "KV blocks in use / blocks held.",
                                value=pool.usage)
        yield GaugeMetricFamily("hf_pagedkv_service_allocation_failure_rate",
                                f"Engine allocation failures per second over the last {WINDOW_S:.0f} s.", value=rate)
        yield GaugeMetricFamily("hf_pagedkv_service_prefix_hit_ratio",
                                "Prompt tokens served from cached blocks / prompt tokens looked up.",
                                value=st.prefix_hit_rate)
        p99 = GaugeMetricFamily("hf_pagedkv_service_latency_p99_seconds",
                                f"P99 latency of the requests answered in the last {WINDOW_S:.0f} s.",
                                labels=["kind"])
        for kind, xs in (("ttft", ttft), ("e2e", e2e)):
            if xs:
                p99.add_metric([kind], nearest_rank(xs, 0.99))
        yield p99
        reqs = GaugeMetricFamily("hf_pagedkv_service_requests", "Engine requests by state.", labels=["state"])
        reqs.add_metric(["running"], st.num_running)
        reqs.add_metric(["waiting"], st.num_waiting)
        yield reqs
        yield GaugeMetricFamily("hf_pagedkv_service_draining", "1 while the server drains (new requests get 503).",
                                value=float(service.draining))
        for name, doc, value in (
                ("preemptions", "Running requests whose blocks were freed for others.", st.num_preemptions),
                ("swaps", "Preempted requests swapped to the host tier (not recomputed).", st.num_swaps),
                ("allocation_failures", "Times a request's next blocks were not free.", st.num_allocation_failures),
                ("generated_tokens", "Tokens sampled by the engine.", st.num_tokens_generated),
                ("cancelled_requests", "Engine requests cancelled (client gone, stop string, shutdown).",
                 st.num_cancelled),
                ("failed_requests", "Engine requests failed.", st.num_failed)):
            yield CounterMetricFamily(f"hf_pagedkv_service_{name}", doc, value=value)


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
