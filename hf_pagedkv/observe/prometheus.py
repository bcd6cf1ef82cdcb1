"""A Prometheus exporter for `BlockPool` metrics, through `prometheus_client` (the `metrics` extra:
``pip install -e '.[metrics]'`` in a clone of hf_pagedkv, or ``pip install prometheus_client``).

Values are read from the pools when Prometheus scrapes (a custom collector), so nothing is updated per step.
Each series carries a ``pool`` label. Names follow the Prometheus conventions (base units, ``_total`` counters)::

    hf_pagedkv_pool_blocks{state="in_use"|"cached"|"free"}  gauge (their sum is the pool's blocks)
    hf_pagedkv_pool_bytes{state="in_use"|"reserved"}     gauge, bytes of keys + values, all layers
    hf_pagedkv_pool_tokens                                gauge, tokens stored (a shared block counts once)
    hf_pagedkv_pool_sequences                             gauge, live block tables
    hf_pagedkv_pool_occupancy_ratio                       gauge, blocks in use / blocks held
    hf_pagedkv_pool_fragmentation_ratio                   gauge, unused slots in blocks in use / their slots
    hf_pagedkv_pool_peak_blocks_in_use                    gauge
    hf_pagedkv_allocation_requests_total                  counter
    hf_pagedkv_allocation_failures_total                  counter
    hf_pagedkv_blocks_allocated_total                     counter
    hf_pagedkv_cow_copies_total                           counter
    hf_pagedkv_evictions_total                            counter
    hf_pagedkv_prefix_lookups_total                       counter
    hf_pagedkv_prefix_hit_tokens_total                    counter
    hf_pagedkv_prefix_hit_ratio                           gauge (only when the pool reports one)
    hf_pagedkv_decode_step_seconds                        histogram
    hf_pagedkv_alert_active{alert=...}                    gauge, 1 while the alert fires

and, for a pool with a host tier (`BlockPool(host_memory=...)`)::

    hf_pagedkv_host_blocks{state="in_use"|"cached"|"free"}     gauge (their sum is the host tier's capacity)
    hf_pagedkv_host_bytes{state="reserved"|"budget"}           gauge, host memory allocated / `host_memory`
    hf_pagedkv_host_blocks_moved_total{direction="to_host"|"from_host"}  counter
    hf_pagedkv_host_bytes_moved_total{direction="to_host"|"from_host"}   counter, bytes of K/V copied
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from hf_pagedkv.errors import install_hint

if TYPE_CHECKING:
    from hf_pagedkv.observe.pool_view import ObservedPool

logger = logging.getLogger(__name__)

_INSTALL = install_hint("metrics", "'prometheus_client>=0.20'")


def _prometheus():
    try:
        import prometheus_client
        from prometheus_client import core
    except ImportError as e:
        raise ImportError(f"The Prometheus exporter needs prometheus_client; install it with {_INSTALL}.") from e
    return prometheus_client, core


class PoolCollector:
    """A `prometheus_client` collector reading `BlockPool` metrics at scrape time (see the module docstring).

    Pools are held by weak reference: a pool that is garbage collected disappears from the output.
    """

    def __init__(self) -> None:
        self._pools: weakref.WeakValueDictionary[str, ObservedPool] = weakref.WeakValueDictionary()  # label -> pool

    def add(self, pool: ObservedPool, name: str | None = None) -> str:
        """Export `pool` with the label ``pool=name`` (defaults to ``"pool<N>"``); return the label.

        Raises:
            ValueError: `name` is already used by another pool.
        """
        name = name if isinstance(name, str) else f"pool{len(self._pools)}"
        known = self._pools.get(name)
        if known is not None and known is not pool:
            raise ValueError(f"A pool is already exported as pool={name!r}; pass another `name`.")
        self._pools[name] = pool
        return name

    def collect(self):
        _, core = _prometheus()
        gauge, counter = core.GaugeMetricFamily, core.CounterMetricFamily
        fams = {
            "blocks": gauge("hf_pagedkv_pool_blocks", "Blocks of the pool by state.", labels=["pool", "state"]),
            "bytes": gauge("hf_pagedkv_pool_bytes", "Bytes of keys and values (all layers) by state.",
                           labels=["pool", "state"]),
            "tokens": gauge("hf_pagedkv_pool_tokens", "Tokens stored; a shared block counts once.", labels=["pool"]),
            "seqs": gauge("hf_pagedkv_pool_sequences", "Live block tables (batch rows).", labels=["pool"]),
            "occ": gauge("hf_pagedkv_pool_occupancy_ratio", "Blocks in use / blocks held.", labels=["pool"]),
            "frag": gauge("hf_pagedkv_pool_fragmentation_ratio", "Unused slots in blocks in use / their slots.",
                          labels=["pool"]),
            "peak": gauge("hf_pagedkv_pool_peak_blocks_in_use", "Most blocks in use at once.", labels=["pool"]),
            "req": counter("hf_pagedkv_allocation_requests", "Block allocation requests.", labels=["pool"]),
            "fail": counter("hf_pagedkv_allocation_failures", "Allocation requests a full pool refused.",
                            labels=["pool"]),
            "alloc": counter("hf_pagedkv_blocks_allocated", "Blocks handed out.", labels=["pool"]),
            "cow": counter("hf_pagedkv_cow_copies", "Shared blocks copied before a write.", labels=["pool"]),
            "evict": counter("hf_pagedkv_evictions", "Idle cached blocks reclaimed.", labels=["pool"]),
            "lookups": counter("hf_pagedkv_prefix_lookups", "Prefix cache lookups.", labels=["pool"]),
            "hits": counter("hf_pagedkv_prefix_hit_tokens", "Tokens served from the prefix cache.", labels=["pool"]),
            "hit_rate": gauge("hf_pagedkv_prefix_hit_ratio", "Prefix cache hit rate.", labels=["pool"]),
            "alert": gauge("hf_pagedkv_alert_active", "1 while the alert fires.", labels=["pool", "alert"]),
            "host_blocks": gauge("hf_pagedkv_host_blocks", "Blocks of the host tier by state.",
                                 labels=["pool", "state"]),
            "host_bytes": gauge("hf_pagedkv_host_bytes", "Host tier memory: allocated, and its budget.",
                                labels=["pool", "state"]),
            "host_moved": counter("hf_pagedkv_host_blocks_moved", "Blocks copied between the device and host tiers.",
                                  labels=["pool", "direction"]),
            "host_moved_bytes": counter("hf_pagedkv_host_bytes_moved",
                                        "Bytes of K/V copied between the device and host tiers.",
                                        labels=["pool", "direction"]),
        }
        hist = core.HistogramMetricFamily("hf_pagedkv_decode_step_seconds",
                                          "Time between consecutive decode steps of a cache.", labels=["pool"])
        for name, pool in sorted(self._pools.items()):
            m = pool.metrics
            health = m.check_alerts()
            snap, st = health.snapshot, health.snapshot.stats
            fams["blocks"].add_metric([name, "in_use"], st.blocks_in_use)
            fams["blocks"].add_metric([name, "cached"], st.blocks_cached)
            fams["blocks"].add_metric([name, "free"], st.blocks_free)
            fams["bytes"].add_metric([name, "in_use"], st.bytes_in_use)
            fams["bytes"].add_metric([name, "reserved"], st.bytes_reserved)
            for key, value in (("tokens", st.tokens_stored), ("seqs", st.num_sequences), ("occ", snap.occupancy),
                               ("frag", snap.fragmentation), ("peak", snap.peak_blocks_in_use),
                               ("req", snap.allocation_requests), ("fail", snap.allocation_failures),
                               ("alloc", snap.blocks_allocated), ("cow", snap.cow_copies),
                               ("evict", snap.evictions), ("lookups", snap.prefix_lookups),
                               ("hits", snap.prefix_hit_tokens)):
                fams[key].add_metric([name], value)
            if snap.prefix_hit_rate is not None:
                fams["hit_rate"].add_metric([name], snap.prefix_hit_rate)
            firing = set(snap.alerts)
            for alert in m.alert_names:
                fams["alert"].add_metric([name, alert], 1.0 if alert in firing else 0.0)
            if st.host_memory is not None:
                for state, value in (("in_use", st.host_blocks_in_use), ("cached", st.host_blocks_cached),
                                     ("free", st.host_blocks_free)):
                    fams["host_blocks"].add_metric([name, state], value)
                fams["host_bytes"].add_metric([name, "reserved"], st.host_bytes_reserved)
                fams["host_bytes"].add_metric([name, "budget"], st.host_memory)
                for direction, blocks, nbytes in (("to_host", st.blocks_to_host, st.bytes_to_host),
                                                  ("from_host", st.blocks_from_host, st.bytes_from_host)):
                    fams["host_moved"].add_metric([name, direction], blocks)
                    fams["host_moved_bytes"].add_metric([name, direction], nbytes)
            hist.add_metric([name], *m.histogram_state())
        yield from fams.values()
        yield hist


class PrometheusExporter:
    """An HTTP endpoint serving `BlockPool` metrics for Prometheus (from `start_prometheus_server`).

    Attributes:
        port (`int`): the port it listens on (the one the OS chose when started with ``port=0``).
        url (`str`): ``http://addr:port/metrics``.
        collector (`PoolCollector`): add more pools with ``exporter.collector.add(pool, name)``.
    """

    def __init__(self, server, thread, collector: PoolCollector, registry) -> None:
        self._server, self._thread = server, thread
        self.collector = collector
        self.registry = registry
        self.addr, self.port = server.server_address[:2]
        self.url = f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_prometheus_server(pools, port: int = 0, addr: str = "127.0.0.1") -> PrometheusExporter:
    """Serve the metrics of `pools` over HTTP for Prometheus, from a daemon thread.

    Args:
        pools (`BlockPool`, `dict[str, BlockPool]` or a list of pools): what to export; a dict gives the
            ``pool`` labels, otherwise they are ``pool0``, ``pool1``, ...
        port (`int`, *optional*, defaults to 0): TCP port; 0 lets the OS pick a free one (see `.port`).
        addr (`str`, *optional*, defaults to ``"127.0.0.1"``): the address to bind; loopback unless you mean
            to expose it.

    Returns:
        `PrometheusExporter`: close it (or use it as a context manager) to stop serving.

    Raises:
        ImportError: prometheus_client is not installed (``pip install -e '.[metrics]'`` in a clone of
            hf_pagedkv, or ``pip install prometheus_client``).
        ValueError: `port` not in 0..65535.

    Example:

    ```python
    >>> from hf_pagedkv.observe.prometheus import start_prometheus_server
    >>> exporter = start_prometheus_server({"main": cache.pool}, port=9400)
    >>> exporter.url                     # 'http://127.0.0.1:9400/metrics'
    ```
    """
    prometheus_client, _ = _prometheus()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"`port` must be an int in 0..65535 (0 picks a free port), got {port!r}.")
    collector = PoolCollector()
    if not isinstance(pools, dict):
        pools = {None: pools} if not isinstance(pools, (list, tuple)) else dict(enumerate(pools))
    for name, pool in pools.items():
        collector.add(pool, name)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    exporter = PrometheusExporter(server, thread, collector, registry)
    logger.info("Serving hf_pagedkv metrics at %s", exporter.url)
    return exporter
