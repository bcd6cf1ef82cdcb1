"""`LatencyHistogram`: decode-step latencies as Prometheus-style buckets plus a ring of recent samples."""

from __future__ import annotations

import bisect
from collections import deque

#: Upper bounds (seconds) of the decode-step latency histogram buckets, Prometheus style (plus +Inf).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)



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
