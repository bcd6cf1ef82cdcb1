"""Pool metrics: allocation counters, a decode-step latency histogram, windowed rates, and alerts with hysteresis.

Every `BlockPool` owns one `PoolMetrics` (``pool.metrics``). The pool and the cache call three cheap hooks
(`count_allocation`, `count_failure`, `on_step`); everything else is computed when someone asks
(`snapshot()`, `pool.health()`, a Prometheus scrape, see `prometheus.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

from hf_pagedkv.observe.alerts import AlertRule, AlertThresholds, Health, default_rules
from hf_pagedkv.observe.latency_histogram import LatencyHistogram, nearest_rank
from hf_pagedkv.observe.metrics_snapshot import MetricsSnapshot

if TYPE_CHECKING:
    from hf_pagedkv.observe.pool_view import ObservedPool

logger = logging.getLogger(__name__)




class PoolMetrics:
    """Counters, decode-step latencies and alerts of one `BlockPool`.

    Decode-step latency is measured by the cache itself as the time between two consecutive decode steps of the
    same cache (a decode step adds exactly one token to every row), each taken when the step's first layer has
    extended the block tables. It is the time per output token a caller of `generate()` sees: the whole forward
    pass plus logits processing and sampling.
    Steps that add several tokens (prefill, assisted decoding) are not timed and end an interval, so a gap
    between a prefill and the first decode step is never counted. NOTE: a cache reused for a second
    `generate()` call whose first step is a single token would count the pause between the calls once;
    `reset_latency()` drops the samples if that matters.

    Invariants: the counters only grow; `histogram.count == decode_steps`; hooks run under the pool's lock or
    this object's own lock, so concurrent caches never lose a count.

    Args:
        pool (`BlockPool`): the pool observed (kept as a weak reference).
        thresholds (`AlertThresholds`, *optional*): alert settings; see `alerts.AlertThresholds`.
    """

    def __init__(self, pool: ObservedPool, thresholds: AlertThresholds | None = None) -> None:
        self._pool = weakref.ref(pool)
        self._lock = threading.Lock()  # guards the step clock and the histogram
        self.thresholds = thresholds or AlertThresholds()  # alert settings; replace via `configure`
        self.num_requests = 0  # allocate() calls + failed reservations; changed by the hooks only
        self.num_failures = 0  # failed reservations (PoolExhaustedError)
        self.num_blocks_allocated = 0  # blocks handed out by allocate()
        self.num_cow_copies = 0  # copy-on-write copies seen by the step hook (used when PoolStats has no count)
        self.peak_blocks_in_use = 0  # most blocks in use at once
        self.histogram = LatencyHistogram()  # decode-step latencies
        self._clock: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> start of its last decode step
        self._baseline: list[float] = []  # the first decode-step latencies, for the P99 baseline
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque(maxlen=4096)  # (time, counters), windowed rates
        self._rules: list[AlertRule] = default_rules(self.thresholds)
        self._next_check = 0.0  # monotonic time of the next alert check from the step hook

    # -- hooks (called by BlockPool and PagedCache; keep them O(1)) -------------------------------------------------
    def count_allocation(self, num_blocks: int, blocks_in_use: int) -> None:
        """`BlockPool._allocate` handed out `num_blocks` blocks; `blocks_in_use` are in use now."""
        self.num_requests += 1
        self.num_blocks_allocated += num_blocks
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks_in_use)

    def count_failure(self, num_blocks: int) -> None:
        """A reservation of `num_blocks` blocks failed (the pool is about to raise `PoolExhaustedError`)."""
        self.num_requests += 1
        self.num_failures += 1
        self.check_alerts()

    def on_step(self, cache: object, num_new_tokens: int, num_cow_copies: int = 0) -> None:
        """The first layer of a forward step of `cache` extended its rows by `num_new_tokens` tokens each."""
        now = time.perf_counter()
        with self._lock:
            self.num_cow_copies += num_cow_copies
            last = self._clock.get(cache) if num_new_tokens == 1 else None
            self._clock[cache] = now if num_new_tokens == 1 else None
            if last is not None:
                seconds = now - last
                self.histogram.observe(seconds, now)
                if len(self._baseline) < self.thresholds.baseline_steps + self.thresholds.warmup_steps:
                    self._baseline.append(seconds)
        if now >= self._next_check:
            self._next_check = now + self.thresholds.check_interval
            self.check_alerts()

    # -- queries --------------------------------------------------------------------------------------------------
    @property
    def baseline_p99(self) -> float | None:
        """P99 (seconds) of the run's first `baseline_steps` decode steps after `warmup_steps`; None until then."""
        t = self.thresholds
        xs = sorted(self._baseline[t.warmup_steps:])
        return nearest_rank(xs, 0.99) if len(xs) >= t.baseline_steps else None

    @property
    def alert_names(self) -> tuple[str, ...]:
        """The names of every alert rule, firing or not."""
        return tuple(r.name for r in self._rules)

    def histogram_state(self) -> tuple[list[tuple[str, int]], float]:
        """A consistent ``(cumulative buckets, sum of seconds)`` of the step latency histogram, for exporters."""
        with self._lock:
            return self.histogram.cumulative(), self.histogram.sum

    def reset_latency(self) -> None:
        """Forget the latency samples and the baseline (for example after changing the model or the batch)."""
        with self._lock:
            self.histogram = LatencyHistogram(self.histogram.buckets, self.histogram.recent.maxlen)
            self._baseline.clear()
            self._clock.clear()

    def configure(self, **thresholds) -> AlertThresholds:
        """Change alert settings by name (see `AlertThresholds`); returns the new settings.

        Raises:
            ValueError: an unknown setting or a value out of range.
        """
        self.thresholds = self.thresholds.replace(**thresholds)
        self._rules = default_rules(self.thresholds)
        return self.thresholds

    def snapshot(self, window: float | None = None) -> MetricsSnapshot:
        """Counters, rates over the last `window` seconds (defaults to `thresholds.window`) and step percentiles."""
        pool = self._pool()
        if pool is None:
            raise RuntimeError("The BlockPool these metrics belong to was garbage collected.")
        window = self.thresholds.window if window is None else window
        stats = pool.stats()
        now = time.perf_counter()
        counters = (self.num_requests, self.num_failures, stats.lookups, stats.hit_tokens, stats.lookup_tokens,
                    stats.bytes_to_host, stats.bytes_from_host)
        with self._lock:
            self._samples.append((now, counters))
            while len(self._samples) > 2 and self._samples[1][0] <= now - window:
                self._samples.popleft()  # keep one sample at or before the window start
            t0, old = self._samples[0]
            n_window, (p50, p90, p99) = self.histogram.percentiles((0.5, 0.9, 0.99), since=now - window)
            steps = self.histogram.count
        d_req, d_fail, _, d_hit, d_tok, d_to_host, d_from_host = (a - b for a, b in zip(counters, old, strict=True))
        span = now - t0
        if d_tok > 0:  # the pool counts looked-up tokens: a true windowed hit rate
            hit_rate = d_hit / d_tok
        else:
            hit_rate = stats.hit_rate if stats.lookups else None
        return MetricsSnapshot(
            stats=stats,
            window=span,
            occupancy=stats.usage,
            fragmentation=stats.fragmentation,
            peak_blocks_in_use=max(self.peak_blocks_in_use, stats.blocks_in_use),
            allocation_requests=self.num_requests,
            allocation_failures=self.num_failures,
            blocks_allocated=self.num_blocks_allocated,
            failure_rate=d_fail / d_req if d_req else None,
            allocations_per_s=d_req / span if span > 0 else 0.0,
            growable=pool.growable,
            prefix_caching=pool.prefix_caching,
            prefix_lookups=stats.lookups,
            prefix_hit_tokens=stats.hit_tokens,
            prefix_hit_rate=hit_rate,
            cow_copies=stats.cow_copies,
            evictions=stats.evictions,
            decode_steps=steps,
            window_steps=n_window,
            step_p50=p50,
            step_p90=p90,
            step_p99=p99,
            step_baseline_p99=self.baseline_p99,
            host_occupancy=stats.host_usage if stats.host_blocks else None,
            blocks_to_host=stats.blocks_to_host,
            blocks_from_host=stats.blocks_from_host,
            bytes_to_host=stats.bytes_to_host,
            bytes_from_host=stats.bytes_from_host,
            bytes_to_host_per_s=d_to_host / span if span > 0 else 0.0,
            bytes_from_host_per_s=d_from_host / span if span > 0 else 0.0,
            alerts=tuple(r.name for r in self._rules if r.active),
        )

    def check_alerts(self) -> Health:
        """Evaluate every alert rule now (a crossing logs one INFO message on `hf_pagedkv.observe.alerts`) and report (see
        `Health`)."""
        snap = self.snapshot()
        firing = tuple(state for rule in self._rules if (state := rule.update(snap)) is not None)
        snap = dataclasses.replace(snap, alerts=tuple(a.name for a in firing))
        return Health(ok=not firing, alerts=firing, snapshot=snap)

