"""Pool metrics: allocation counters, a decode-step latency histogram, windowed rates, and alerts with hysteresis.

Every `BlockPool` owns one `PoolMetrics` (``pool.metrics``). The pool and the cache call three cheap hooks
(`count_allocation`, `count_failure`, `on_step`); everything else is computed when someone asks
(`snapshot()`, `pool.health()`, a Prometheus scrape, see `prometheus.py`).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .alerts import AlertRule, AlertState, AlertThresholds, default_rules

if TYPE_CHECKING:
    from .block_pool import BlockPool, PoolStats

logger = logging.getLogger(__name__)

#: Upper bounds (seconds) of the decode-step latency histogram buckets, Prometheus style (plus +Inf).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)

#: Counters the prefix-caching pool adds to `PoolStats`; read with defaults so this module works with or without them.
PREFIX_COUNTERS = ("lookups", "hit_tokens", "evictions", "cow_copies")


class LatencyHistogram:
    """Decode-step latencies: cumulative bucket counts (for Prometheus) and a ring of recent samples (percentiles).

    Args:
        buckets (`tuple[float, ...]`): increasing bucket upper bounds in seconds.
        max_samples (`int`): recent samples kept for percentiles; older ones only live in the bucket counts.
    """

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS, max_samples: int = 4096) -> None:
        self.buckets = buckets  # bucket upper bounds, seconds; fixed
        self.counts = [0] * (len(buckets) + 1)  # counts[i]: samples in bucket i (the last is +Inf); not cumulative
        self.sum = 0.0  # seconds, all samples
        self.count = 0  # all samples
        self.recent: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (monotonic time, seconds)

    def observe(self, seconds: float, now: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1
        self.recent.append((now, seconds))

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ..., ("+Inf", count)]`` as Prometheus wants it."""
        out, total = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            total += c
            out.append((le, total))
        return out

    def percentiles(self, qs: tuple[float, ...], since: float | None = None) -> tuple[int, tuple[float | None, ...]]:
        """Number of recent samples taken at or after `since`, and their percentiles `qs` (nearest rank; None
        when there are none)."""
        xs = sorted(s for t, s in self.recent if since is None or t >= since)
        return len(xs), tuple(nearest_rank(xs, q) for q in qs)


def nearest_rank(xs: list[float], q: float) -> float | None:
    """The `q`-quantile of sorted `xs` by the nearest-rank method (None for no samples)."""
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.5) - 1))]


@dataclass(frozen=True)
class MetricsSnapshot:
    """What a pool looks like now and over the last `window` seconds. Ratios are in [0, 1]; None = no data.

    `stats` is the pool's `PoolStats`; counters are totals since the pool was created; `*_rate` fields are
    measured over the window (per second for ``*_per_s``, a fraction otherwise).
    """

    stats: PoolStats
    window: float  # seconds the rates cover (less right after the pool was created)
    occupancy: float  # blocks in use / blocks held
    fragmentation: float  # unused slots inside blocks in use / their slots
    peak_blocks_in_use: int  # most blocks in use at once since creation
    allocation_requests: int  # `BlockPool.allocate` calls plus failed reservations
    allocation_failures: int  # reservations a fixed pool could not satisfy (PoolExhaustedError)
    blocks_allocated: int  # blocks handed out
    failure_rate: float | None  # failures / requests in the window
    allocations_per_s: float  # requests per second in the window
    growable: bool  # the pool grows on demand (occupancy is then no alarm, and allocation never fails)
    prefix_caching: bool  # whether the pool has a prefix index
    prefix_lookups: int
    prefix_hit_tokens: int
    prefix_hit_rate: float | None  # in the window when the pool counts looked-up tokens, else since creation
    cow_copies: int  # blocks copied before a write because they were shared
    evictions: int  # idle cached blocks reclaimed
    decode_steps: int  # decode steps timed (see `PoolMetrics.on_step`)
    window_steps: int  # decode steps timed in the window
    step_p50: float | None  # seconds, decode steps in the window
    step_p90: float | None
    step_p99: float | None
    step_baseline_p99: float | None  # seconds, P99 of the run's first decode steps
    alerts: tuple[str, ...] = field(default=())  # names of the alerts firing

    def to_dict(self) -> dict:
        """A JSON-ready dict (stats flattened under "stats", with its derived byte counts)."""
        out = asdict(self)
        out["stats"].update(bytes_in_use=self.stats.bytes_in_use, bytes_reserved=self.stats.bytes_reserved)
        out["alerts"] = list(self.alerts)
        return out


@dataclass(frozen=True)
class Health:
    """`BlockPool.health()`: `ok` is False while any alert fires; `alerts` describes each firing alert."""

    ok: bool
    alerts: tuple[AlertState, ...]
    snapshot: MetricsSnapshot

    def __str__(self) -> str:
        if self.ok:
            return "ok"
        return "; ".join(a.message for a in self.alerts)


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

    def __init__(self, pool: BlockPool, thresholds: AlertThresholds | None = None) -> None:
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
        """`BlockPool.allocate` handed out `num_blocks` blocks; `blocks_in_use` are in use now."""
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
        counters = (self.num_requests, self.num_failures, *(_counter(stats, n) for n in ("lookups", "hit_tokens")),
                    _counter(stats, "lookup_tokens"))
        with self._lock:
            self._samples.append((now, counters))
            while len(self._samples) > 2 and self._samples[1][0] <= now - window:
                self._samples.popleft()  # keep one sample at or before the window start
            t0, old = self._samples[0]
            n_window, (p50, p90, p99) = self.histogram.percentiles((0.5, 0.9, 0.99), since=now - window)
            steps = self.histogram.count
        d_req, d_fail, _, d_hit, d_tok = (a - b for a, b in zip(counters, old, strict=True))
        span = now - t0
        if d_tok > 0:  # the pool counts looked-up tokens: a true windowed hit rate
            hit_rate = d_hit / d_tok
        else:
            hit_rate = getattr(stats, "hit_rate", None) if _counter(stats, "lookups") else None
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
            prefix_caching=bool(getattr(pool, "prefix_caching", False)),
            prefix_lookups=_counter(stats, "lookups"),
            prefix_hit_tokens=_counter(stats, "hit_tokens"),
            prefix_hit_rate=hit_rate,
            cow_copies=_counter(stats, "cow_copies", self.num_cow_copies),
            evictions=_counter(stats, "evictions"),
            decode_steps=steps,
            window_steps=n_window,
            step_p50=p50,
            step_p90=p90,
            step_p99=p99,
            step_baseline_p99=self.baseline_p99,
            alerts=tuple(r.name for r in self._rules if r.active),
        )

    def check_alerts(self) -> Health:
        """Evaluate every alert rule now (a crossing logs one INFO message on `hf_pagedkv.alerts`) and report (see
        `Health`)."""
        snap = self.snapshot()
        firing = tuple(state for rule in self._rules if (state := rule.update(snap)) is not None)
        snap = dataclasses.replace(snap, alerts=tuple(a.name for a in firing))
        return Health(ok=not firing, alerts=firing, snapshot=snap)


def _counter(stats: object, name: str, default: int = 0) -> int:
    """A counter of `PoolStats` that only some versions have (the prefix-caching ones), or `default`."""
    value = getattr(stats, name, None)
    return default if value is None else int(value)
