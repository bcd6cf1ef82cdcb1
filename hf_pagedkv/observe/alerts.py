"""Alert rules on pool metrics: a threshold, a direction, and hysteresis so a crossing logs one message.

An alert fires when its value crosses the threshold (logged once, at INFO, on the `hf_pagedkv.observe.alerts` logger) and
clears only when the value is back past the threshold by the hysteresis margin (logged at INFO too), so a value
hovering around the threshold does not log on every step::

    occupancy  0.70  0.86  0.90  0.84  0.86  0.76  0.87
    alert      -     FIRE  on    on    on    clear FIRE      (threshold 0.85, clears at or below 0.765)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hf_pagedkv.observe.metrics_snapshot import MetricsSnapshot

# NOTE: INFO, not WARNING: an alert is for an operator who watches a serving pool (`pool.health()`, Prometheus, or
# `logging.getLogger("hf_pagedkv.observe.alerts").setLevel(logging.INFO)` with a handler); a one-off pool that fills, or a
# slow step during an eval, is no misuse, so by default nothing reaches stderr.
logger = logging.getLogger("hf_pagedkv.observe.alerts")


@dataclass(frozen=True)
class AlertThresholds:
    """Alert settings of one pool (`pool.metrics.configure(occupancy=0.9)` changes them).

    Args:
        occupancy (`float`, defaults to 0.85): fire when blocks in use / blocks held exceeds this; only for a
            fixed-size pool (a growable pool is often exactly full, and grows).
        failure_rate (`float`, defaults to 0.001): fire when failed / all allocation requests in the window
            exceeds this.
        hit_rate (`float`, defaults to 0.8): fire when the prefix hit rate falls below this; only for a pool
            with prefix caching on, after `min_lookups` lookups.
        latency_factor (`float`, defaults to 2.0): fire when the window's P99 decode-step latency exceeds this
            many times the run's own baseline P99 (the first `baseline_steps` decode steps after `warmup_steps`).
        hysteresis (`float`, defaults to 0.1): an alert clears once its value is back past the threshold by this
            fraction of the threshold (occupancy 0.85 clears at 0.765; hit rate 0.8 clears at 0.88).
        window (`float`, defaults to 60.0): seconds the rates and percentiles cover.
        check_interval (`float`, defaults to 1.0): seconds between alert checks made from decode steps.
        baseline_steps (`int`, defaults to 32), warmup_steps (`int`, defaults to 4): see `latency_factor`.
        min_lookups (`int`, defaults to 20): prefix lookups needed before the hit-rate alert can fire.
        min_window_steps (`int`, defaults to 16): decode steps in the window needed before the latency alert
            can fire.
    """

    occupancy: float = 0.85
    failure_rate: float = 0.001
    hit_rate: float = 0.8
    latency_factor: float = 2.0
    hysteresis: float = 0.1
    window: float = 60.0
    check_interval: float = 1.0
    baseline_steps: int = 32
    warmup_steps: int = 4
    min_lookups: int = 20
    min_window_steps: int = 16

    def __post_init__(self) -> None:
        for name in ("occupancy", "failure_rate", "hit_rate", "hysteresis"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"AlertThresholds.{name} must be a number in [0, 1], got {value!r}.")
        for name in ("latency_factor", "window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"AlertThresholds.{name} must be a positive number, got {value!r}.")
        if not isinstance(self.check_interval, (int, float)) or self.check_interval < 0:
            raise ValueError(f"AlertThresholds.check_interval must be >= 0 seconds, got {self.check_interval!r}.")
        for name in ("baseline_steps", "warmup_steps", "min_lookups", "min_window_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AlertThresholds.{name} must be an int >= 0, got {value!r}.")
        if self.baseline_steps == 0:
            raise ValueError("AlertThresholds.baseline_steps must be at least 1.")

    def replace(self, **changes) -> AlertThresholds:
        """A copy with some settings changed.

        Raises:
            ValueError: an unknown setting name, or a value out of range.
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"Unknown alert setting(s) {unknown}; known: {sorted(known)}.")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AlertState:
    """A firing alert: its name, the value that crossed, the threshold and a readable message."""

    name: str
    value: float
    threshold: float
    message: str


class AlertRule:
    """One alert: reads a value from a `MetricsSnapshot`, fires above (or below) a threshold, clears with hysteresis.

    Args:
        name (`str`): the alert's name (`occupancy`, `allocation_failure_rate`, `prefix_hit_rate`, `step_latency`).
        value (`Callable[[MetricsSnapshot], float | None]`): the observed value; None when there is no data yet
            (the alert then keeps its state).
        threshold (`Callable[[MetricsSnapshot], float | None]`): the threshold (may depend on the snapshot, as the
            latency baseline does); None disables the rule for now.
        above (`bool`): fire when the value exceeds the threshold (True) or falls below it (False).
        hysteresis (`float`): fraction of the threshold the value must move back before the alert clears.
        describe (`str`): message template with ``{value}`` and ``{threshold}``.
    """

    def __init__(self, name: str, value: Callable, threshold: Callable, above: bool, hysteresis: float,
                 describe: str) -> None:
        self.name = name
        self._value = value
        self._threshold = threshold
        self.above = above
        self.hysteresis = hysteresis
        self.describe = describe
        self.active = False  # firing now; changed by `update` only
        self.num_fired = 0  # times the alert started firing (each logged once)

    def update(self, snap: MetricsSnapshot) -> AlertState | None:
        """Re-evaluate on `snap`; log a crossing once; return the alert's state while it fires, else None."""
        value, threshold = self._value(snap), self._threshold(snap)
        if value is None or threshold is None:
            return self._state(value, threshold) if self.active else None
        if self.above:
            crossed, cleared = value > threshold, value <= threshold * (1 - self.hysteresis)
        else:
            crossed, cleared = value < threshold, value >= threshold * (1 + self.hysteresis)
        if not self.active and crossed:
            self.active = True
            self.num_fired += 1
            logger.info("hf_pagedkv alert %s: %s", self.name, self.describe.format(value=value, threshold=threshold))
        elif self.active and cleared:
            self.active = False
            logger.info("hf_pagedkv alert %s cleared: %s", self.name,
                        self.describe.format(value=value, threshold=threshold))
        return self._state(value, threshold) if self.active else None

    def _state(self, value: float | None, threshold: float | None) -> AlertState:
        value = float("nan") if value is None else value
        threshold = float("nan") if threshold is None else threshold
        return AlertState(self.name, value, threshold, self.describe.format(value=value, threshold=threshold))


def default_rules(t: AlertThresholds) -> list[AlertRule]:
    """The four alerts of a pool: occupancy, allocation failure rate, prefix hit rate, P99 step latency."""

    def hit_rate(s: MetricsSnapshot) -> float | None:
        return s.prefix_hit_rate if s.prefix_caching and s.prefix_lookups >= t.min_lookups else None

    def occupancy(s: MetricsSnapshot) -> float | None:
        return None if s.growable else s.occupancy

    def latency(s: MetricsSnapshot) -> float | None:
        return s.step_p99 if s.window_steps >= t.min_window_steps else None

    def latency_limit(s: MetricsSnapshot) -> float | None:
        return None if s.step_baseline_p99 is None else t.latency_factor * s.step_baseline_p99

    h = t.hysteresis
    return [
        AlertRule("occupancy", occupancy, lambda s: t.occupancy, True, h,
                  "pool occupancy {value:.1%} > {threshold:.1%}: raise num_blocks / max_memory or admit fewer "
                  "sequences"),
        AlertRule("allocation_failure_rate", lambda s: s.failure_rate, lambda s: t.failure_rate, True, h,
                  "allocation failure rate {value:.4f} > {threshold:.4f} over the window: the pool is too small"),
        AlertRule("prefix_hit_rate", hit_rate, lambda s: t.hit_rate, False, h,
                  "prefix hit rate {value:.1%} < {threshold:.1%}: shared prefixes are evicted or not shared"),
        AlertRule("step_latency", latency, latency_limit, True, h,
                  "P99 decode step {value:.4f} s > {threshold:.4f} s (" + f"{t.latency_factor:g}"
                  + "x the run's baseline P99)"),
    ]


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
