"""`MetricsSnapshot`: a pool's stats plus windowed rates and step-latency percentiles, at one moment."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_pagedkv.observe.pool_stats import PoolStats


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
    allocation_requests: int  # `BlockPool._allocate` calls plus failed reservations
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
    # the host tier (all 0 / None without one; `stats` has its occupancy in blocks)
    host_occupancy: float | None = None  # host blocks in use or cached / host blocks (None: no sized host tier)
    blocks_to_host: int = 0  # blocks copied device -> host since creation (offloaded + demoted)
    blocks_from_host: int = 0  # blocks copied host -> device since creation (prefetched + promoted)
    bytes_to_host: int = 0  # bytes of K/V copied device -> host since creation
    bytes_from_host: int = 0  # bytes of K/V copied host -> device since creation
    bytes_to_host_per_s: float = 0.0  # in the window
    bytes_from_host_per_s: float = 0.0  # in the window
    alerts: tuple[str, ...] = field(default=())  # names of the alerts firing

    def to_dict(self) -> dict:
        """A JSON-ready dict (stats flattened under "stats", with its derived byte counts)."""
        out = asdict(self)
        out["stats"].update(bytes_in_use=self.stats.bytes_in_use, bytes_reserved=self.stats.bytes_reserved)
        out["alerts"] = list(self.alerts)
        return out
