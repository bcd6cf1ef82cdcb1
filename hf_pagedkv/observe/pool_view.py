"""`ObservedPool`: what `observe/` reads of a pool. `BlockPool` provides it; `observe/` never imports the pool."""

from __future__ import annotations

from typing import Any, Protocol

from hf_pagedkv.observe.pool_stats import PoolStats


class ObservedPool(Protocol):
    """The narrow interface metrics, alerts, the event log and the Prometheus exporter use (a `BlockPool`)."""

    block_size: int  # tokens per block
    growable: bool  # grows on demand instead of raising PoolExhaustedError
    prefix_caching: bool  # keeps a prefix index
    lock: Any  # the pool's RLock (consistent reads)
    allocator: Any  # the full-attention group's BlockAllocator (refcounts for the event log's header)
    metrics: Any  # its PoolMetrics
    events: Any  # its EventLog

    def stats(self) -> PoolStats: ...

    def health(self) -> Any: ...
