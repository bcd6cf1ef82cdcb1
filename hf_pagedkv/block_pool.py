"""`BlockPool`: the public face of a pool of KV blocks (bookkeeping plus its page store), shareable by caches."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque

import torch

from .block_allocator import BlockAllocator
from .block_table import BlockTable
from .config import DEFAULT_BLOCK_SIZE, DEFAULT_QUANT_BLOCK_SIZE, QuantConfig, check_positive_int, parse_bytes
from .errors import PoolExhaustedError
from .events import EventLog
from .invariants import check_pool_invariants
from .metrics import Health, PoolMetrics
from .page_store import LayerSpec, PageStore
from .pool_stats import PoolStats
from .prefix_index import BlockHash, PrefixIndex
from .quantized_store import QuantizedPageStore

logger = logging.getLogger(__name__)

_MIN_GROWTH_BLOCKS = 64  # a growable pool never grows by less than this many blocks at once


class BlockPool:
    """A pool of fixed-size KV blocks shared by one or more `PagedCache` objects of the same model.

    A block holds `block_size` consecutive tokens of one sequence, in every layer (one block id names the same
    slot range in each layer, as in vLLM), so a sequence needs one block table, not one per layer. Blocks are
    refcounted: `fork()`, beam reordering and `num_return_sequences` share block ids, and a shared block is
    copied before it is written (copy-on-write).

    Args:
        block_size (`int`, *optional*, defaults to 16, 32 when quantized): tokens per block (for a quantized pool,
            also the key quantization group).
        num_blocks (`int`, *optional*): a fixed number of blocks, preallocated once per layer. When they are
            all in use, allocation raises `PoolExhaustedError`.
        max_memory (`int` or `str`, *optional*): a fixed budget in bytes (``"4GiB"``, ``"512MB"``) for all
            layers' keys and values; turned into `num_blocks` when the first cache writes its first layer, which
            needs the number of layers: create that cache with ``PagedCache(pool=pool, config=model.config)``
            (without `config` its first `update` raises `ValueError`). Exclusive with `num_blocks`.
        debug (`bool`, *optional*, defaults to `False`): poison freed blocks with NaN.
        prefix_caching (`bool`, *optional*, defaults to `False`): keep a prefix index (`PrefixIndex`) so that
            requests sharing a prompt prefix share its full blocks (`PagedCache.from_prefix`, `cache.publish`,
            `hf_pagedkv.generate`). Published blocks whose refcount drops to 0 stay cached-idle until space is
            needed, then are evicted least-recently-used.
        quant (`QuantConfig` or `str`, *optional*): store K/V quantized (`QuantConfig`, or a preset such as
            ``"k8v4"``); `None` or ``"fp"`` for full precision. Fixed for the pool's lifetime.

    With neither `num_blocks` nor `max_memory`, the pool grows on demand by chunks: what is needed plus a headroom
    of half its size (at least 64 blocks), copying its storage once per growth, so growth is amortised O(1).
    Cached-idle blocks are evicted before the pool grows or raises `PoolExhaustedError`.

    Thread safety: every bookkeeping change happens under `lock` (an `RLock`), so several threads may each run
    their own caches on one pool. A cache itself is used by one thread at a time.

    Raises:
        ValueError: `block_size` or `num_blocks` not a positive int; both `num_blocks` and `max_memory`
            given; `max_memory` not a size; an invalid `quant`.

    Example:

    ```python
    >>> from hf_pagedkv import BlockPool, PagedCache
    >>> pool = BlockPool(block_size=16)
    >>> a = PagedCache(pool=pool)
    >>> out = model.generate(input_ids, past_key_values=a, max_new_tokens=8)
    >>> b = a.fork()                  # shares every block of `a`
    >>> pool.stats().blocks_in_use    # the same as before the fork
    ```
    """

    def __init__(
        self,
        block_size: int | None = None,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        debug: bool = False,
        prefix_caching: bool = False,
        quant: QuantConfig | str | None = None,
    ) -> None:
        self.quant = QuantConfig.resolve(quant)  # storage format; fixed
        if block_size is None:
            block_size = DEFAULT_QUANT_BLOCK_SIZE if self.quant.is_quantized else DEFAULT_BLOCK_SIZE
        check_positive_int("block_size", block_size)
        if num_blocks is not None:
            check_positive_int("num_blocks", num_blocks)
        if num_blocks is not None and max_memory is not None:
            raise ValueError("Give `num_blocks` or `max_memory`, not both.")
        self.block_size = block_size  # tokens per block; fixed
        self.max_memory = None if max_memory is None else parse_bytes(max_memory)  # byte budget, or None
        self.growable = num_blocks is None and max_memory is None  # grow on demand instead of raising
        self.lock = threading.RLock()  # guards all bookkeeping; held by a cache for a whole step's extension
        self.allocator = BlockAllocator()  # block ids and refcounts
        self.store = (QuantizedPageStore(block_size, self.quant, debug=debug) if self.quant.is_quantized
                      else PageStore(block_size, debug=debug))  # the tensors
        self._tables: dict[int, list[BlockTable]] = {}  # owner token -> that cache's rows; for checks and stats
        self._tokens = itertools.count()  # owner tokens
        self._pending_release: deque[int] = deque()  # owners garbage-collected without release(); freed by _drain
        self.prefix_index = PrefixIndex() if prefix_caching else None  # full-block hashes -> blocks, or None
        self.num_cow_copies = 0  # blocks copied before a write (copy-on-write); changed by copy_on_write only
        self.metrics = PoolMetrics(self)  # counters, step latency, alerts (metrics.py); updated by the hooks below
        self.events = EventLog(self)  # block event log, off by default (events.py)
        if num_blocks is not None:
            self._add_blocks(num_blocks)

    # -- configuration ---------------------------------------------------------------------------------------------
    @property
    def debug(self) -> bool:
        """Whether freed blocks are poisoned with NaN."""
        return self.store.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.store.debug = bool(value)

    @property
    def prefix_caching(self) -> bool:
        """Whether this pool keeps a prefix index (`BlockPool(prefix_caching=True)`)."""
        return self.prefix_index is not None

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def _add_blocks(self, n: int) -> None:
        self.store.grow(self.allocator.num_blocks + n)
        self.allocator.add_blocks(n)

    def register_layer(self, layer_idx: int, spec: LayerSpec, num_layers: int | None = None) -> None:
        """Make sure the pool has storage for `layer_idx` with this spec.

        Raises:
            ValueError: the pool already holds this layer with another shape, dtype or device (a pool shared
                between different models), or `max_memory` cannot be resolved without the number of layers.
        """
        with self.lock:
            known = self.store.specs.get(layer_idx)
            if known is not None:
                if known != spec:
                    raise ValueError(
                        f"This BlockPool holds layer {layer_idx} as {_describe(known)}, but got {_describe(spec)}. "
                        "A pool is shared only by caches of one model (same layer shapes and dtype); use a "
                        "separate BlockPool for each model."
                    )
                return
            if self.max_memory is not None and self.allocator.num_blocks == 0:
                total = device_memory(spec.device)
                if total is not None and self.max_memory > total:
                    raise ValueError(
                        f"max_memory={self.max_memory} bytes is more than {spec.device} has ({total} bytes in all); "
                        "preallocating it would fail or get the process killed. Lower max_memory."
                    )
                if num_layers is None:
                    raise ValueError(
                        "BlockPool(max_memory=...) needs the number of layers to size itself: create the cache "
                        "as PagedCache(config=model.config, pool=pool), or use num_blocks= instead."
                    )
                per_block = self.store.block_bytes(spec) * num_layers
                n = self.max_memory // per_block
                if n == 0:
                    raise ValueError(
                        f"max_memory={self.max_memory} bytes is less than one block ({per_block} bytes for "
                        f"{num_layers} layers); raise max_memory or lower block_size."
                    )
                self._add_blocks(n)
            self.store.add_layer(layer_idx, spec)

    # -- allocation --------------------------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Make sure `n` blocks are free: evict cached-idle blocks (LRU), then grow a growable pool, else raise.
        Changes no refcount.

        Raises:
            PoolExhaustedError: a fixed pool has fewer than `n` free plus cached-idle blocks (nothing changed).
        """
        with self.lock:
            self._drain()
            free = self.allocator.num_free_blocks
            if n <= free:
                return
            idle = self.allocator.num_idle_blocks
            if not self.growable and n > free + idle:
                idle_note = f" and {idle} cached-idle" if self.prefix_index is not None else ""
                self.metrics.count_failure(n)
                raise PoolExhaustedError(
                    f"BlockPool is full: {n} blocks needed, {free} free{idle_note} of {self.num_blocks} "
                    f"(block_size={self.block_size}). Raise num_blocks / max_memory, release finished caches, "
                    "or use num_blocks=None to let the pool grow."
                )
            if idle:  # evict before growing or raising: idle blocks are only a cache
                self._evict(min(n - free, idle))
                free = self.allocator.num_free_blocks
                if n <= free:
                    return
            cur = self.num_blocks
            self._add_blocks(n - free + max(cur // 2, _MIN_GROWTH_BLOCKS))  # headroom: next steps need no copy
            logger.debug("BlockPool grew from %d to %d blocks", cur, self.num_blocks)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Allocate `n` blocks (refcount 1 each), growing or raising `PoolExhaustedError` first if needed."""
        with self.lock:
            self.reserve(n)
            blocks = self.allocator.allocate(n, after)
            assert blocks is not None
            self.metrics.count_allocation(n, self.allocator.num_used_blocks)
            self.events.emit("allocate", blocks)
            return blocks

    def incref(self, blocks: list[int]) -> None:
        with self.lock:
            self.events.emit("fork", blocks)
            self.allocator.incref(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks that reach refcount 0 return to the free set (and are
        poisoned in debug mode), or, when published in the prefix index, become cached-idle."""
        with self.lock:
            self.events.emit("free", blocks)
            if self.prefix_index is None:
                freed = self.allocator.decref(blocks)
            else:
                freed = self.prefix_index.release(blocks, self.allocator)
            self.store.release(freed)

    def copy_on_write(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer (before writing to a shared or published block)."""
        with self.lock:
            self.store.copy_blocks(src, dst)
            self.num_cow_copies += len(src)

    # -- prefix caching --------------------------------------------------------------------------------------------
    def is_published(self, block: int) -> bool:
        """Whether `block` holds a published full prefix (it must then be copied before any write)."""
        return self.prefix_index is not None and block in self.prefix_index

    def acquire_prefix(self, hashes: list[BlockHash], num_tokens: int) -> list[int]:
        """Take one reference to each block of the longest published prefix of `hashes` (reviving idle ones).

        Args:
            hashes (`list[BlockHash]`): chain hashes of the full blocks a request may reuse.
            num_tokens (`int`): tokens of the request (for `hit_rate`).

        Returns:
            `list[int]`: the hit blocks, in order; the caller's block table must name them (one reference each).
        """
        with self.lock:
            self._drain()
            blocks = self.prefix_index.acquire(hashes, self.allocator, num_tokens)
            self.events.emit("hit", blocks, tokens=num_tokens)
            return blocks

    def publish_blocks(self, hashes: list[BlockHash], blocks: list[int]) -> int:
        """Publish `blocks[i]` under `hashes[i]` (blocks held by the caller, fully written in every layer).

        Returns:
            `int`: blocks newly published (a hash already published by another block is skipped).
        """
        with self.lock:
            rc = self.allocator.refcount
            assert all(rc(b) > 0 for b in blocks), "publish of a block the caller does not hold"
            self.events.emit("publish", blocks)
            return sum(self.prefix_index.publish(h, b) for h, b in zip(hashes, blocks))

    def _evict(self, n: int) -> None:
        evicted = self.prefix_index.evict(n, self.allocator)
        self.events.emit("evict", evicted)
        self.store.release(evicted)
        logger.debug("BlockPool evicted %d cached-idle blocks", n)

    # -- owners (live block tables) --------------------------------------------------------------------------------
    def _register(self, rows: list[BlockTable]) -> int:
        with self.lock:
            self._drain()
            token = next(self._tokens)
            self._tables[token] = rows
            return token

    def _unregister(self, token: int) -> None:
        """Forget an owner whose rows are already empty (an explicit `PagedCache.release()`)."""
        with self.lock:
            rows = self._tables.pop(token, None)
            assert not rows, "unregister of an owner that still holds blocks"

    def _release_owner(self, token: int) -> None:
        """Free every block of one owner's rows and forget them (the cache was released or garbage collected).

        NOTE: this runs from a `weakref.finalize`, which the garbage collector may call in any thread at any point,
        even inside a pool method holding `lock` (an RLock lets it in). So it only queues the owner; the blocks are
        freed at the start of the next pool operation (`_drain`), never in the middle of one.
        """
        self._pending_release.append(token)  # deque.append is atomic

    def _drain(self) -> None:
        """Free the blocks of owners queued by `_release_owner`. Called with `lock` held."""
        while self._pending_release:
            rows = self._tables.pop(self._pending_release.popleft(), None)
            if rows:
                self.free([b for row in rows for b in row.blocks])
                rows.clear()

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and prefix-cache counters (see `PoolStats`)."""
        with self.lock:
            self._drain()
            index = self.prefix_index
            fill: dict[int, int] = {}
            rows = [row for rows in self._tables.values() for row in rows]
            for row in rows:
                for j, b in enumerate(row.blocks):
                    fill[b] = max(fill.get(b, 0), min(self.block_size, row.num_tokens - j * self.block_size))
            return PoolStats(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                blocks_in_use=self.allocator.num_used_blocks,
                blocks_free=self.allocator.num_free_blocks,
                tokens_stored=sum(fill.values()),
                bytes_per_block=self.store.bytes_per_block,
                num_sequences=len(rows),
                bytes_in_use=self.store.bytes_in_use(self.allocator.num_used_blocks),
                bytes_reserved=self.store.bytes_reserved(),
                blocks_cached=self.allocator.num_idle_blocks,
                lookups=index.num_lookups if index is not None else 0,
                lookup_tokens=index.num_lookup_tokens if index is not None else 0,
                hit_tokens=index.num_hit_tokens if index is not None else 0,
                evictions=index.num_evictions if index is not None else 0,
                cow_copies=self.num_cow_copies,
            )

    def health(self) -> Health:
        """Check the alerts now (occupancy, allocation failures, prefix hit rate, step latency; see `metrics.py`)."""
        return self.metrics.check_alerts()

    def check_invariants(self) -> None:
        """Check the pool invariants of DESIGN.md; raise `InvariantError` naming the broken one and the blocks.

        1. every block is in exactly one state: free (refcount 0, in the free set), in use (refcount >= 1), or
           cached-idle (refcount 0, published in the prefix index and in its idle LRU); the prefix index is
           consistent (hash <-> block maps inverse) and names no free block;
        2. `refcount[b]` equals the number of live block-table entries naming `b`;
        3. a table holding `n` tokens has exactly ``ceil(n / block_size)`` blocks and names no block twice;
        5. the free queue has no duplicates and names no block in use (a set, so no duplicates by construction);
        6. with no live tables, no block is in use (a leak) -- implied by 2.
        """
        check_pool_invariants(self)


def _describe(spec: LayerSpec) -> str:
    return (f"[num_kv_heads={spec.num_kv_heads}, head_dim={spec.key_dim}/{spec.value_dim}] "
            f"{str(spec.dtype).removeprefix('torch.')} on {spec.device}")


def device_memory(device: torch.device) -> int | None:
    """Total bytes of memory on `device` (physical RAM for the CPU), or None when it cannot be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None
