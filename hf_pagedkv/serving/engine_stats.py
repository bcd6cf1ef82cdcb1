"""`EngineStats`: a snapshot of an `Engine`'s queues, counters, latencies and KV memory (`Engine.stats()`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hf_pagedkv.observe.latency_histogram import nearest_rank


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles (nearest rank, seconds) of one latency over finished requests; None when there are none."""

    count: int
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, samples) -> LatencySummary:
        xs = sorted(samples)
        return cls(len(xs), *(nearest_rank(xs, q) for q in (0.5, 0.95, 0.99)))


@dataclass(frozen=True)
class EngineStats:
    """What an `Engine` has done and holds now.

    Latencies are over finished requests (status FINISHED, the last 100,000), in seconds: `ttft` from `add_request`
    to the first generated token, `tpot` the time per output token after the first (requests with at least two),
    `e2e` from `add_request` to the last token.
    """

    num_waiting: int  # requests waiting for admission (new or preempted)
    num_running: int  # requests holding blocks
    num_finished: int  # finished normally (stop token or max_new_tokens)
    num_failed: int  # failed (too large for the pool, or an exception in their step)
    num_cancelled: int
    num_preemptions: int  # times a running request's blocks were freed for another request
    num_swaps: int  # of those, swapped out to the pool's host tier (the others were recomputed)
    num_allocation_failures: int  # times a request's next blocks were not free (it or a later request waited)
    num_steps: int  # forward steps run
    num_tokens_computed: int  # tokens through the model (prompt chunks, decode tokens, recomputation)
    num_tokens_generated: int  # tokens sampled
    ttft: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary
    kv_bytes_in_use: int  # bytes of the pool's blocks in use now (all its caches, not only the engine's)
    kv_bytes_peak: int  # the most `kv_bytes_in_use` seen after an engine step
    prefix_lookup_tokens: int  # prompt tokens looked up in the prefix index at first admission
    prefix_hit_tokens: int  # of those, tokens served from cached blocks

    @property
    def prefix_hit_rate(self) -> float:
        """prefix_hit_tokens / prefix_lookup_tokens, in [0, 1] (0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0


class LatencyLog:
    """Per-request latencies of finished requests (the last `max_samples` of each kind), for `EngineStats`."""

    def __init__(self, max_samples: int = 100_000) -> None:
        self.ttft: deque[float] = deque(maxlen=max_samples)  # seconds; appended by `record` only
        self.tpot: deque[float] = deque(maxlen=max_samples)
        self.e2e: deque[float] = deque(maxlen=max_samples)

    def record(self, created: float, timestamps: list[float], finished: float) -> None:
        """One finished request: when it was added, when each token came, when it finished (perf_counter)."""
        if not timestamps:
            return
        self.ttft.append(timestamps[0] - created)
        if len(timestamps) > 1:
            self.tpot.append((timestamps[-1] - timestamps[0]) / (len(timestamps) - 1))
        self.e2e.append(finished - created)


__all__ = ["EngineStats", "LatencyLog", "LatencySummary"]
