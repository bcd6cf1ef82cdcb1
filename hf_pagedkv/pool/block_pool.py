"""`BlockPool`: the public face of a pool of KV blocks (its layer groups: bookkeeping plus storage), shareable by caches."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections import Counter, deque

import torch

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.pool.block_group import BlockGroup
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.config import DEFAULT_BLOCK_SIZE, DEFAULT_QUANT_BLOCK_SIZE, QuantConfig, check_positive_int, parse_bytes
from hf_pagedkv.storage.device_budget import blocks_for_budget, check_device_share
from hf_pagedkv.errors import InvariantError, PoolExhaustedError, counted
from hf_pagedkv.observe.events import EventLog
from hf_pagedkv.pool.host_tiers import HostTiers
from hf_pagedkv.pool.idle_shrink import IdleShrink
from hf_pagedkv.pool.invariants import check_group_invariants
from hf_pagedkv.blocks.owner_registry import IdleOwner, OwnerRegistry
from hf_pagedkv.observe.alerts import Health
from hf_pagedkv.observe.metrics import PoolMetrics
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.observe.pool_stats import GroupStats, PoolStats
from hf_pagedkv.blocks.compaction import num_trapped_free, plan_moves
from hf_pagedkv.blocks.prefix_budget import PrefixCacheBudget
from hf_pagedkv.blocks.prefix_index import BlockHash, PrefixIndex

logger = logging.getLogger(__name__)

# A growable pool grows by what a step is missing plus a headroom of a quarter of its size, at least
# _MIN_GROWTH_BLOCKS: sized to need (a pool that one prefill sized holds about that prefill), and still amortised.
_MIN_GROWTH_BLOCKS = 16
_GROWTH_FRACTION = 4  # headroom = num_blocks // _GROWTH_FRACTION
_MAX_SHRINK_AFTER = 1e9  # seconds (about 30 years): a timer's delay must fit the platform's time_t


class _PoolOrClassMethod:
    """A method callable on an instance (``pool.f(...)``: the pool) or on the class (``BlockPool.f(...)``: the class),
    for `load_prefix_cache`, which loads into a given pool or into a new one."""

    def __init__(self, func) -> None:
        self.func = func  # f(pool_or_cls, ...); fixed
        self.__doc__ = func.__doc__

    def __get__(self, obj, cls):
        return functools.partial(self.func, cls if obj is None else obj)


class BlockPool:
    """A pool of fixed-size KV blocks shared by one or more `PagedCache` objects of the same model.

    Layers are split into **layer groups** by how much history they keep (`groups`: group 0 for full attention,
    one per distinct sliding window), as in vLLM's hybrid KV-cache manager. A block of a group holds `block_size`
    consecutive tokens of one sequence in every layer of that group (one block id names the same slot range in
    each of them), so a sequence needs one block table per group, not one per layer; a sliding-window group frees
    the blocks that leave its window, so hybrid models (Gemma 2/3, gpt-oss, ...) hold only their windows there.
    Blocks are refcounted: `fork()`, beam reordering and `num_return_sequences` share block ids, and a shared block
    is copied before it is written (copy-on-write).

    Args:
        block_size (`int`, *optional*, defaults to 16, 32 when quantized): tokens per block (for a quantized pool,
            also the key quantization group).
        num_blocks (`int`, *optional*): a fixed number of blocks per layer group, preallocated once per layer.
            When a group's blocks are all in use, allocation raises `PoolExhaustedError`.
        max_memory (`int` or `str`, *optional*): a fixed budget in bytes (``"4GiB"``, ``"512MB"``) for all
            layers' keys and values, on all the devices they sit on together (`device_map`); turned into
            `num_blocks` (the same for every layer group) when the first cache writes its first layer, which needs
            the number of layers: create that cache with ``PagedCache(pool=pool, config=model.config)`` (without
            `config` its first `update` raises `ValueError`). Each device holds every block of the layers on it,
            and that share is checked against the device's memory (`device_budget.py`). Under tensor parallel it
            is one rank's budget, for that rank's KV heads. Exclusive with `num_blocks`.
        debug (`bool`, *optional*, defaults to `False`): poison freed blocks with NaN.
        prefix_caching (`bool`, *optional*, defaults to `False`): keep a prefix index (`PrefixIndex`) so that
            requests sharing a prompt prefix share its full blocks (`PagedCache.from_prefix`, `cache.publish`,
            `hf_pagedkv.generate`). Published blocks whose refcount drops to 0 stay cached-idle, within
            `prefix_cache_memory`, evicted least-recently-used beyond it (and, in a fixed pool, when an allocation
            needs their space).
        quant (`QuantConfig` or `str`, *optional*): store K/V quantized (`QuantConfig`, or a preset such as
            ``"k8v4"``); `None` or ``"fp"`` for full precision. Fixed for the pool's lifetime.
        host_memory (`int` or `str`, *optional*): a host-memory (CPU, pinned under CUDA) tier of this many bytes
            (``"8GiB"``), where `PagedCache.offload()` moves a cache and `prefetch()` brings it back
            (`host_tiers.py`); sized at the first offload, when the layers are known. `pool.stats()` (its
            ``host_*`` fields, `blocks_to_host`, `bytes_to_host`, ...) and `pool.host.stats()` tell its occupancy
            and the copies made.
        prefix_cache_memory (`int`, `str` or `float`, *optional*): with `prefix_caching`, the budget of cached-idle
            blocks: a size (``"1GiB"``, bytes as an int; all layers, keys + values) or a fraction in ``(0, 1]`` of
            the pool's blocks (`PrefixCacheBudget`). Defaults to 1 GiB for a growable pool, which grows rather than
            evicting within it, and to the whole pool for a fixed one. `stats().bytes_cached` and
            `stats().prefix_cache_budget` report it.
        shrink_after (`float`, *optional*): a growable pool gives its free trailing storage segments back by itself
            (`shrink()`, from a daemon timer, `idle_shrink.py`) once this many seconds pass without an allocation;
            None (default): only when `shrink()` is called. Not for tensor-parallel ranks (block ids may differ).

    With neither `num_blocks` nor `max_memory`, the pool grows on demand by chunks: what is needed plus a headroom
    of a quarter of its size (at least 16 blocks), so growth is amortised O(1) and the storage stays close to what
    is used.
    A fixed pool evicts cached-idle blocks before it raises `PoolExhaustedError`; a growable one grows instead
    and evicts only beyond `prefix_cache_memory`.

    Thread safety: every bookkeeping change happens under `lock` (an `RLock`), so several threads may each run
    their own caches on one pool. A cache itself is used by one thread at a time.

    Exception safety: an operation that fails, by an error (a failed allocation or copy) or an interrupt
    (`KeyboardInterrupt`), leaves every invariant holding and loses nothing: it makes the torch calls that may fail
    before it changes the bookkeeping (plain Python), or undoes what they did; only releasing freed blocks'
    storage (debug poisoning) and trimming the prefix cache come after, and they leave the bookkeeping done
    (`tests/property/test_fault_injection.py` injects a failure at every torch call of each operation).

    Determinism (tensor parallel ranks must stay in step): which block ids are handed out, when the pool grows and
    which cached-idle blocks are evicted depend only on the sequence of calls and on K/V values, never on time,
    thread timing, `hash()` of a str or set iteration order: free ids come from a min-heap (the lowest, or
    ``after + 1``), eviction from an insertion-ordered LRU, prefix hashes are blake2b of token ids. Ranks running the
    same `generate` calls keep identical block tables (`tests/integration/test_tensor_parallel.py` compares their
    event logs, under different ``PYTHONHASHSEED``s). A cache dropped without `release()` is freed when its last
    reference goes (it holds no reference cycle), at the pool's next operation. One thing can still differ between
    ranks: rows share blocks when their K/V are bit-identical on this rank's heads, so rows with different tokens
    whose K/V happen to match on one rank's heads would share there only. Outputs stay exact either way; only memory differs, so at the limit
    of a fixed pool one rank could raise `PoolExhaustedError` where another does not (and the others then wait in
    their next collective).

    Raises:
        ValueError: `block_size` or `num_blocks` not a positive int; both `num_blocks` and `max_memory`
            given; `max_memory` not a size; an invalid `quant`; `prefix_cache_memory` without `prefix_caching`,
            or neither a size nor a fraction in (0, 1]; `shrink_after` not a number of seconds > 0, or given for a
            fixed pool.

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
        host_memory: int | str | None = None,
        prefix_cache_memory: int | str | float | None = None,
        shrink_after: float | None = None,
    ) -> None:
        for name, flag in (("debug", debug), ("prefix_caching", prefix_caching)):
            if not isinstance(flag, bool):
                raise ValueError(f"BlockPool({name}={flag!r}): give True or False.")
        self.quant = QuantConfig.resolve(quant)  # storage format; fixed
        if prefix_cache_memory is not None and not prefix_caching:
            raise ValueError(f"prefix_cache_memory={prefix_cache_memory!r} sizes the prefix cache; it needs "
                             "BlockPool(prefix_caching=True).")
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
        if shrink_after is not None:
            if (isinstance(shrink_after, bool) or not isinstance(shrink_after, (int, float))
                    or not 0 < shrink_after <= _MAX_SHRINK_AFTER):
                raise ValueError(f"shrink_after={shrink_after!r}: give the idle time in seconds, a number > 0 and at "
                                 f"most {_MAX_SHRINK_AFTER:.0e} (or None to shrink only when pool.shrink() is called).")
            if not self.growable:
                raise ValueError("shrink_after= is for a growable pool (num_blocks=None and max_memory=None): a fixed "
                                 "pool keeps its preallocation.")
        # gives free segments back after `shrink_after` idle seconds (idle_shrink.py), or None; fixed
        self.idle_shrink = None if shrink_after is None else IdleShrink(self, float(shrink_after))
        self.lock = threading.RLock()  # guards all bookkeeping; held by a cache for a whole step's extension
        self._fixed_blocks = num_blocks  # blocks each layer group gets when it is created, or None
        self._budget_blocks: int | None = None  # with max_memory: the blocks per group, once the first layer sized it
        self._prefix_caching = prefix_caching  # whether groups keep a prefix index; fixed
        # how many cached-idle blocks a group keeps (None without prefix caching); fixed
        self.prefix_budget = PrefixCacheBudget(prefix_cache_memory, self.growable) if prefix_caching else None
        self._debug = debug  # poison freed blocks; applied to every group's store
        self.groups: list[BlockGroup] = []  # layer groups; group 0 is full attention; appended by group_for only
        # sliding window (None: full attention), or (window, tier) for a retention tier > 0 -> group index
        self._group_of: dict = {}
        self.owners = OwnerRegistry()  # live owner tokens, their last use, busy marks, swap hooks; the methods below
        self._pending_release: deque[int] = deque()  # owners garbage-collected without release(); freed by _drain
        self._prefix_keys: dict[bytes, None] = {}  # keys published blocks were hashed under; note_prefix_key only
        self.last_loaded_blocks = 0  # blocks the last load_prefix_cache published; set by it only
        # the host tier (`cache.offload()`, evicted prefix blocks), or None; fixed
        self.host = None if host_memory is None else HostTiers(self, parse_bytes(host_memory, name="host_memory"))
        self.group_for(None)
        self.num_moved_blocks = 0  # blocks moved by `compact`, all groups; changed there only
        self.bytes_returned = 0  # storage bytes given back by `shrink`; changed there only
        self.metrics = PoolMetrics(self)  # counters, step latency, alerts (metrics.py); updated by the hooks below
        self.events = EventLog(self)  # block event log, off by default (events.py)

    # -- configuration ---------------------------------------------------------------------------------------------
    @property
    def debug(self) -> bool:
        """Whether freed blocks are poisoned with NaN."""
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = bool(value)
        for group in self.groups:
            group.store.debug = self._debug

    @property
    def prefix_caching(self) -> bool:
        """Whether this pool keeps a prefix index (`BlockPool(prefix_caching=True)`)."""
        return self._prefix_caching

    # The full-attention group (group 0): what a pool of a model without sliding windows consists of.
    @property
    def allocator(self) -> BlockAllocator:
        return self.groups[0].allocator

    @property
    def store(self):
        return self.groups[0].store

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.groups[0].prefix_index

    @property
    def num_cow_copies(self) -> int:
        return sum(group.num_cow_copies for group in self.groups)

    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds storage for, summed over its layer groups."""
        return sum(group.allocator.num_blocks for group in self.groups)

    def group_for(self, window: int | None, tier: int = 0) -> int:
        """The index of the layer group of layers with this sliding window (`None`: full attention), created on
        first use; a fixed pool gives a new group its `num_blocks` blocks. `tier` > 0 names a separate group of
        full-attention layers that a tiered retention policy (`PyramidKV`) gives its own budget."""
        key = window if not tier else (window, tier)
        with self.lock:
            gi = self._group_of.get(key)
            if gi is None:
                gi = len(self.groups)
                group = BlockGroup(gi, window, self.block_size, self.quant, self._debug, self._prefix_caching,
                                   tier=tier)
                self.groups.append(group)
                self._group_of[key] = gi
                sized = self._fixed_blocks if self._fixed_blocks is not None else self._budget_blocks
                if sized is not None:
                    self._add_blocks(group, sized)
                if gi and self.events.enabled:
                    logger.debug("BlockPool: new layer group %d (%s)", gi, group.name)
            return gi

    def _add_blocks(self, group: BlockGroup, n: int) -> None:
        group.store.grow(group.allocator.num_blocks + n)
        group.allocator.add_blocks(n)

    def check_layer_group(self, layer_idx: int, group: int) -> None:
        """Raise `ValueError` if the pool already holds layer `layer_idx` in a layer group other than `group` (a cache
        of another model, or with other retention tiers). No side effects."""
        with self.lock:
            target = self.groups[group]
            for other in self.groups:
                if other is target or layer_idx not in other.store.specs:
                    continue
                if (other.tier or target.tier) and other.window == target.window:
                    raise ValueError(
                        f"This BlockPool holds layer {layer_idx} in its {other.name} layer group, but a cache uses "
                        f"it as {target.name}: a tiered retention policy (PyramidKV, KVzip with global layer budgets) "
                        "gives each tier of layers its own layer group, so the caches sharing a pool must all use the same tiers; use a separate "
                        "BlockPool for caches with other tiers."
                    )
                raise ValueError(
                    f"This BlockPool holds layer {layer_idx} in its {other.name} layer group, but a cache uses "
                    f"it as {target.name}; a pool is shared only by caches of one model (build each cache with "
                    "the same config=, or none)."
                )

    def register_layer(self, layer_idx: int, spec: LayerSpec, num_layers: int | None = None, group: int = 0) -> None:
        """Make sure the pool has storage for `layer_idx` with this spec in layer group `group`.

        With `max_memory`, the first layer sizes the pool (`device_budget.blocks_for_budget`) and every layer's
        device share is checked against that device's memory before its storage is allocated
        (`device_budget.check_device_share`): with `device_map`, layers on different devices count against their
        own device.

        Raises:
            ValueError: the pool already holds this layer with another shape, dtype or device (a pool shared
                between different models) or in another group; `max_memory` cannot be resolved without the number of layers, is
                below one block, is more than the devices have, or would put more on this layer's device than it
                has (nothing is allocated for this layer then).
        """
        with self.lock:
            target = self.groups[group]
            for other in self.groups:
                known = other.store.specs.get(layer_idx)
                if known is None:
                    continue
                if known != spec:
                    raise ValueError(
                        f"This BlockPool holds layer {layer_idx} as {_describe(known)}, but got {_describe(spec)}. "
                        "A pool is shared only by caches of one model (same layer shapes and dtype); use a "
                        "separate BlockPool for each model."
                    )
                self.check_layer_group(layer_idx, group)
                return
            if self.max_memory is not None:  # sized by the first layer; each layer's device share checked
                # NOTE: every group gets the same number of blocks, so the groups together stay within the budget
                # (each layer belongs to one group); a sliding group rarely needs them all.
                n = self._budget_blocks or blocks_for_budget(self.max_memory, spec, num_layers,
                                                             target.store.block_bytes, device_memory)
                known = [s for g in self.groups for s in g.store.specs.values()]
                check_device_share(layer_idx, spec, known, target.store.block_bytes, n, self.max_memory,
                                   device_memory)
                if self._budget_blocks is None:  # every group gets its blocks now: a step reserves in all of them
                    self._budget_blocks = n
                    for g in self.groups:
                        if g.allocator.num_blocks == 0:
                            self._add_blocks(g, n)
            target.store.add_layer(layer_idx, spec)
            if target.pad_block is not None:  # the new layer's storage of the pad block holds zeros too
                target.store.zero_blocks([target.pad_block], layer_idx)

    # -- allocation --------------------------------------------------------------------------------------------------
    def can_reserve(self, n: int, group: int = 0) -> bool:
        """Whether `reserve(n, group)` would succeed. No side effects."""
        with self.lock:
            alloc = self.groups[group].allocator
            return self.growable or n <= alloc.num_free_blocks + alloc.num_idle_blocks

    def reserve(self, n: int, group: int = 0, rows: int = 1, run: int = 0) -> None:
        """Make sure `n` blocks of `group` are free: a fixed pool evicts cached-idle blocks (LRU) or raises, a
        growable one grows (its idle blocks stay, within the prefix cache's budget). Changes no refcount.
        `rows`: how many rows the blocks are for; a growth keeps at least one more free block per row, so that the
        rows' next blocks come from the same storage segment (a batch gather from one segment copies once).
        `run`: when a growable pool grows, its new segment also holds `run` consecutive free blocks (for
        `allocate_rows`) unless a segment has them already; it never grows for that alone.

        Raises:
            PoolExhaustedError: a fixed pool has fewer than `n` free plus cached-idle blocks (nothing changed).
        """
        with self.lock:
            self._drain()
            if self.idle_shrink is not None:
                self.idle_shrink.touch()
            g = self.groups[group]
            free = g.allocator.num_free_blocks
            if n <= free:
                return
            idle = g.allocator.num_idle_blocks
            if not self.growable and n > free + idle:
                idle_note = f" and {idle} cached-idle" if g.prefix_index is not None else ""
                where = "" if len(self.groups) == 1 else f" in its {g.name} layer group"
                self.metrics.count_failure(n)
                raise PoolExhaustedError(
                    f"BlockPool is full{where}: {counted(n, 'block')} needed, {free} free{idle_note} of "
                    f"{g.allocator.num_blocks} (block_size={self.block_size}). Raise num_blocks / max_memory, release "
                    "finished caches, or use num_blocks=None to let the pool grow."
                )
            if idle and not self.growable:  # evict before raising: idle blocks are only a cache
                self._evict(g, min(n - free, idle))
                return
            # NOTE: a growable pool grows rather than evicting: its idle blocks are within the prefix cache's
            # budget (`free` trims them to it), and evicting them first would keep no prefix across requests.
            cur = g.allocator.num_blocks
            headroom = max(cur // _GROWTH_FRACTION, _MIN_GROWTH_BLOCKS, rows)
            want_run = run > n - free + headroom and self._free_run(g, run) is None
            self._add_blocks(g, (run if want_run else n - free) + headroom)
            logger.debug("BlockPool %s group grew from %d to %d blocks", g.name, cur, g.allocator.num_blocks)

    def allocate(self, n: int, after: int | None = None, group: int = 0) -> list[int]:
        """Allocate `n` blocks of `group` (refcount 1 each), growing or raising `PoolExhaustedError` first if needed."""
        with self.lock:
            self.reserve(n, group)
            blocks = self.groups[group].allocator.allocate(n, after)
            assert blocks is not None
            self.metrics.count_allocation(n, self.num_used_blocks)
            self.events.emit("allocate", blocks, **_group_field(group))
            return blocks

    def allocate_rows(self, rows: int, n: int, stride: int, group: int = 0) -> list[list[int]] | None:
        """Allocate `n` blocks for each of `rows` new rows, laid out evenly: row `r` gets the consecutive ids
        ``s + r * stride .. s + r * stride + n - 1`` of the lowest free run ``s .. s + rows * stride - 1`` that lies
        in one storage segment, and the ``stride - n`` ids after each row stay free for its next blocks
        (`BlockAllocator.allocate` prefers them). Rows so placed are read by a page store as one strided view
        (`PageStore.read`) instead of a gather. Returns the blocks per row (refcount 1 each), or `None` (nothing
        changed) when no such run is free: the caller allocates row by row instead. Call `reserve` first (with
        ``run=rows * stride``, so that a growth makes room for the run)."""
        assert 0 < n <= stride
        with self.lock:
            g = self.groups[group]
            start = self._free_run(g, rows * stride)
            if start is None:
                return None
            out = [list(range(start + r * stride, start + r * stride + n)) for r in range(rows)]
            flat = [b for row in out for b in row]
            g.allocator.allocate_ids(flat)
            self.metrics.count_allocation(len(flat), self.num_used_blocks)
            self.events.emit("allocate", flat, **_group_field(group))
            return out

    @staticmethod
    def _free_run(g: BlockGroup, length: int) -> int | None:
        """The lowest start of `length` consecutive free blocks of group `g` inside one storage segment, or None."""
        ranges, lo = [], 0
        for size in g.store.segment_blocks:
            ranges.append((lo, lo + size))
            lo += size
        return g.allocator.free_run(length, (r for r in ranges if r[1] - r[0] >= length))

    def pad_block(self, group: int = 0) -> int | None:
        """The pad block of `group`, or None if none was reserved yet (see `ensure_pad_block`). No side effects."""
        return self.groups[group].pad_block

    def ensure_pad_block(self, group: int = 0) -> int:
        """The pad block of `group`, reserved on first use: one block of zeros (finite, in every layer of the group)
        that every whole block of a row's left padding names instead of a block of its own, as vLLM's null block.

        The pool holds one reference to it, so it is never freed (refcount = table entries naming it + 1); it is
        never written (a step drops the writes of padding tokens that fall in it, and copies it before writing a
        real token into it after a crop), never published, never moved to the host tier, and holds no token (fill
        0). Reads gather it like any block: attention masks its positions, and zeros keep the masked softmax exact.
        Counted once in `stats().blocks_in_use` and `bytes_in_use`. Invariant 10 (`pool/invariants.py`).

        Raises:
            PoolExhaustedError: a fixed pool has no free (or cached-idle) block for it (nothing changed).
        """
        with self.lock:
            g = self.groups[group]
            if g.pad_block is None:
                block = self.allocate(1, group=group)[0]  # the pool's own reference: never dropped
                g.store.zero_blocks([block])
                g.pad_block = block
                logger.debug("BlockPool: block %d is the pad block of its %s group", block, g.name)
            return g.pad_block

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use (refcount >= 1), summed over layer groups."""
        return sum(group.allocator.num_used_blocks for group in self.groups)

    def incref(self, blocks: list[int], group: int = 0) -> None:
        with self.lock:
            self.events.emit("fork", blocks, **_group_field(group))
            self.groups[group].allocator.incref(blocks)

    def free(self, blocks: list[int], group: int = 0) -> None:
        """Drop one reference from each block of `group`; blocks that reach refcount 0 return to the free set (and
        are poisoned in debug mode), or, when published in the prefix index, become cached-idle. The references are
        dropped first, in plain Python: an error raised later (releasing the freed blocks' storage, trimming the
        prefix cache) leaves them dropped and every invariant holding."""
        with self.lock:
            g = self.groups[group]
            self.events.emit("free", blocks, **_group_field(group))
            if g.prefix_index is None:
                freed = g.allocator.decref(blocks)
            else:
                freed = g.prefix_index.release(blocks, g.allocator)
            g.store.release(freed)
            if g.prefix_index is not None:
                self._trim_prefix_cache(g)
            if freed and self.idle_shrink is not None:
                self.idle_shrink.arm()

    def free_groups(self, blocks: dict[int, list[int]]) -> None:
        """`free(blocks[g], g)` for every group `g`, every group's references dropped even when releasing one
        group's storage (the last part of `free`, which may raise) fails: then that error is raised after all."""
        with self.lock, contextlib.ExitStack() as frees:
            for group, ids in reversed(blocks.items()):  # run first in, so in group order
                frees.callback(self.free, ids, group)

    def max_idle_blocks(self, group: int = 0) -> int | None:
        """Cached-idle blocks `group` keeps at most (`prefix_cache_memory`); None without prefix caching, or before
        any layer is known (a size budget needs the bytes of a block)."""
        if self.prefix_budget is None:
            return None
        per_block = sum(g.store.bytes_per_block for g in self.groups)
        return self.prefix_budget.max_idle_blocks(self.groups[group].allocator.num_blocks, per_block)

    def _trim_prefix_cache(self, g: BlockGroup) -> None:
        """Evict the least recently used idle blocks of `g` beyond the prefix cache's budget."""
        limit = self.max_idle_blocks(g.index)
        excess = 0 if limit is None else g.allocator.num_idle_blocks - limit
        if excess > 0:
            self._evict(g, excess)

    def mark_written(self, blocks: list[int], fills: list[int], group: int = 0) -> None:
        """`blocks[i]` of `group` now hold their first `fills[i]` slots (for `stats().tokens_stored`, kept O(1))."""
        alloc = self.groups[group].allocator
        for b, n in zip(blocks, fills):
            alloc.set_fill(b, n)

    def copy_on_write(self, src: list[int], dst: list[int], group: int = 0) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer of `group` (before writing to a shared or published
        block)."""
        with self.lock:
            g = self.groups[group]
            g.store.copy_blocks(src, dst)
            for s, d in zip(src, dst):
                g.allocator.set_fill(d, g.allocator.fill(s))
            g.num_cow_copies += len(src)

    # -- prefix caching --------------------------------------------------------------------------------------------
    def is_published(self, block: int, group: int = 0) -> bool:
        """Whether `block` holds a published full prefix (it must then be copied before any write)."""
        index = self.groups[group].prefix_index
        return index is not None and block in index

    def acquire_prefix(self, hashes: list[BlockHash], num_tokens: int, group: int = 0, count: bool = True) -> list[int]:
        """Take one reference to each block of the longest published prefix of `hashes` (reviving idle ones).

        Args:
            hashes (`list[BlockHash]`): chain hashes of the full blocks a request may reuse.
            num_tokens (`int`): tokens of the request (for `hit_rate`).
            group (`int`, *optional*, defaults to 0): the layer group.
            count (`bool`, *optional*, defaults to `True`): count the lookup and its hit (once per request: the
                other layer groups of the same request pass `False`).

        Returns:
            `list[int]`: the hit blocks, in order; the caller's block table must name them (one reference each).
        """
        with self.lock:
            self._drain()
            blocks = self.groups[group].prefix_index.acquire(hashes, self.groups[group].allocator, num_tokens, count)
            self.events.emit("hit", blocks, tokens=num_tokens, **_group_field(group))
            return blocks

    def match_prefix(self, hashes: list[BlockHash], group: int = 0) -> list[int]:
        """The blocks of `group` of the longest published prefix of `hashes`. Changes nothing."""
        with self.lock:
            return self.groups[group].prefix_index.match(hashes)

    def publish_blocks(self, hashes: list[BlockHash], blocks: list[int], group: int = 0) -> int:
        """Publish `blocks[i]` of `group` under `hashes[i]` (blocks held by the caller, fully written in every layer).

        Returns:
            `int`: blocks newly published (a hash already published by another block is skipped).
        """
        with self.lock:
            g = self.groups[group]
            assert all(g.allocator.refcount(b) > 0 for b in blocks), "publish of a block the caller does not hold"
            assert g.pad_block is None or g.pad_block not in blocks, "publish of the pad block (padding)"
            self.events.emit("publish", blocks, **_group_field(group))
            return sum(g.prefix_index.publish(h, b) for h, b in zip(hashes, blocks))

    def _evict(self, group: BlockGroup, n: int) -> None:
        if self.host is not None:  # the host tier keeps what the device drops (host_tiers.py)
            self.host.demote(group.index, group.prefix_index.oldest_idle(n))
        evicted = group.prefix_index.evict(n, group.allocator)
        self.events.emit("evict", evicted, **_group_field(group.index))
        group.store.release(evicted)
        logger.debug("BlockPool evicted %d cached-idle blocks of its %s group", n, group.name)

    # -- compaction and shrinking ------------------------------------------------------------------------------------
    def compact(self, max_blocks: int = 64) -> int:
        """Move up to `max_blocks` live blocks (in use or cached-idle) of each layer group to free ids below them
        (`blocks/compaction.py`): each row whole to the lowest place where its blocks are consecutive in one storage
        segment (a single-row cache then reads views, not gathers), then blocks no row names to the lowest free
        ids, so the free blocks gather at the end, where `shrink` can return their segments. Bounded per call: call
        it again (e.g. once per step) until it returns 0.

        Exact: a moved block's storage is copied whole (K/V, or codes, scales, its stage and sink stage), its
        refcount, fill, prefix hash and LRU place move with it, and every block table naming it is renamed (a
        `PagedCache` renames its tables and their mirror through the hook it registered), so outputs are unchanged
        for live caches, forks, beams, prefix-cached and quantized blocks. Call it between forward steps: never
        while a forward pass runs on a cache of this pool (say, from another thread). Each layer group's moves are
        all or nothing: an error or interrupt while a group is compacted leaves that group as it was (the groups
        before it stay compacted, which changes no output either).

        Raises:
            ValueError: `max_blocks` not a positive int.

        Returns:
            `int`: blocks moved, all groups (also counted in `stats().blocks_moved`).
        """
        check_positive_int("max_blocks", max_blocks)
        with self.lock:
            self._drain()
            moved = 0
            for g in self.groups:
                # the pad block is shared by every padded row: not part of any row's run (it may pack down loose)
                rows = [[b for b in row.blocks if b != g.pad_block] for row in g.rows()]
                moves = plan_moves(g.allocator, max_blocks, rows, g.store.segment_blocks)
                if not moves:
                    continue
                src, dst = list(moves), list(moves.values())
                # NOTE: all or nothing per group: what may fail (torch calls: the storage copy, the caches' new
                # mirrors) comes first and changes no bookkeeping; then plain Python renames everything at once
                try:
                    g.store.copy_blocks(src, dst)  # storage first: dst are free, src stay valid until renamed
                    renames = [self._renamer(g, token, rows, moves) for token, rows in g.tables.items()]
                except BaseException:
                    g.store.release(dst)  # still free: drop what the copy gave them (a quantized block's stages)
                    raise
                for s, d in moves.items():
                    g.allocator.move(s, d)
                if g.prefix_index is not None:
                    g.prefix_index.rename(moves)
                if g.pad_block in moves:  # its zeros were copied with it
                    g.pad_block = moves[g.pad_block]
                for rename in renames:
                    rename()
                moved += len(moves)
                self.num_moved_blocks += len(moves)
                g.store.release(src)  # now free: stages returned, state dropped, poisoned in debug mode
                logger.debug("BlockPool compacted %d blocks of its %s group", len(moves), g.name)
            return moved

    @staticmethod
    def _renamer(g: BlockGroup, token: int, rows: list[BlockTable], moves: dict[int, int]):
        """For `compact`: the function (plain Python) that renames owner `token`'s tables in group `g`; the cache
        builds its new mirror here, through its hook (which may fail)."""
        mover = g.movers.get(token)
        rename = mover() if mover is not None else None
        if rename is not None:
            return rename(g.index, moves)  # the cache renames its rows and their mirror

        def rename_rows() -> None:  # an owner without a hook (or collected, not yet drained): its rows only
            for row in rows:
                row.rename(moves)

        return rename_rows

    def shrink(self) -> int:
        """Give back the storage segments at the end of each layer group whose blocks are all free (a growable
        pool; a fixed one keeps its preallocation and returns 0). Free blocks below a live one stay; `compact`
        first moves live blocks down.

        Returns:
            `int`: bytes returned (also summed in `stats().bytes_returned`).
        """
        with self.lock:
            self._drain()
            if not self.growable:
                return 0
            returned = 0
            for g in self.groups:
                free = g.allocator.free_blocks()
                top = next((b for b in range(g.allocator.num_blocks - 1, -1, -1) if b not in free), -1)
                before = g.store.bytes_reserved()
                kept = g.store.shrink(top + 1)
                g.allocator.remove_blocks(g.allocator.num_blocks - kept)
                returned += before - g.store.bytes_reserved()
            self.bytes_returned += returned
            return returned

    # -- owners (live block tables) --------------------------------------------------------------------------------
    def register_owner(self, rows: list[BlockTable] | None = None, group: int = 0) -> int:
        """A new owner token; `rows` (a list object the owner keeps filling) are its tables in `group`."""
        with self.lock:
            self._drain()
            token = self.owners.new()
            if rows is not None:
                self.groups[group].tables[token] = rows
            return token

    def add_rows(self, token: int, group: int, rows: list[BlockTable], mover=None) -> None:
        """Register an owner's tables in another layer group; `mover` (a `weakref.WeakMethod`, optional) is called
        as ``mover()(group, {old: new})`` when `compact` moves blocks they name: it prepares what may fail (a new
        mirror) and returns a function, plain Python, that renames the tables and swaps the mirror in."""
        with self.lock:
            assert token in self.owners.live and token not in self.groups[group].tables
            self.groups[group].tables[token] = rows
            if mover is not None:
                self.groups[group].movers[token] = mover

    def unregister_owner(self, token: int) -> None:
        """Forget an owner whose rows are already empty (an explicit `PagedCache.release()`)."""
        with self.lock:
            self.owners.forget(token)
            for group in self.groups:
                rows = group.tables.pop(token, None)
                group.movers.pop(token, None)
                assert not rows, "unregister of an owner that still holds blocks"

    def release_owner(self, token: int) -> None:
        """Free every block of one owner's rows and forget them (the cache was released or garbage collected).

        NOTE: this runs from a `weakref.finalize`, which the garbage collector may call in any thread at any point,
        even inside a pool method holding `lock` (an RLock lets it in). So it only queues the owner; the blocks are
        freed at the start of the next pool operation (`_drain`), never in the middle of one.
        """
        self._pending_release.append(token)  # deque.append is atomic

    def touch_owner(self, token: int) -> None:
        """Record a use of owner `token` now (`PagedCache` calls it at each forward step, attach and prefetch); the
        order of uses is what `idle_owners` sorts by."""
        with self.lock:
            self.owners.touch(token)

    def set_owner_swapper(self, token: int, hook) -> None:
        """Let `idle_owners` offer owner `token` for swapping out: `hook()` returns a function that moves it to the
        host tier (``weakref.WeakMethod(cache.offload)``), or None once the owner is gone."""
        with self.lock:
            self.owners.set_swapper(token, hook)

    @contextlib.contextmanager
    def owner_busy(self, token: int):
        """``with pool.owner_busy(cache.seq_id):`` marks the cache busy (a request is running it), so
        `idle_owners` does not offer it for swapping out meanwhile. Marks nest."""
        with self.lock:
            self.owners.mark(token)
        try:
            yield
        finally:
            with self.lock:
                self.owners.unmark(token)

    def idle_owners(self, exclude=()) -> list[IdleOwner]:
        """The caches of this pool that could be swapped out to the host tier now, least recently used first: live,
        not busy (`owner_busy`), not offloaded, holding device blocks, and not in `exclude` (owner tokens).

        Returns:
            `list[IdleOwner]`: each with its token, last use (a logical clock, and `time.monotonic()` seconds), the
            device blocks it names (and how many of them no other owner names) and its `offload` function.
        """
        with self.lock:
            self._drain()
            out = []
            for token, tick, seconds, offload in self.owners.idle(set(exclude)):
                held = Counter((g.index, b) for g in self.groups for row in g.tables.get(token, ()) for b in row.blocks)
                if held:  # a block is exclusive when every reference to it is one of this owner's table entries
                    mine = sum(self.groups[gi].allocator.refcount(b) == n for (gi, b), n in held.items())
                    out.append(IdleOwner(token, tick, seconds, len(held), mine, offload))
            return out

    def _drain(self) -> None:
        """Free the blocks of owners queued by `release_owner`. Called with `lock` held. Each owner's tables and
        references are all dropped before the first call that may fail (releasing the freed blocks' storage)."""
        while self._pending_release:
            token = self._pending_release.popleft()
            self.owners.forget(token)
            if self.host is not None:  # an offloaded cache holds host blocks instead
                self.host.release(token)
            held = {}
            for group in self.groups:
                rows = group.tables.pop(token, None)
                group.movers.pop(token, None)
                if rows:
                    held[group.index] = [b for row in rows for b in row.blocks]
                    rows.clear()
            self.free_groups(held)

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and prefix-cache counters (see `PoolStats`), summed over layer groups,
        with one `GroupStats` per group in `groups`."""
        with self.lock:
            self._drain()
            per_group = tuple(
                GroupStats(
                    window=g.window,
                    layers=tuple(g.layers),
                    num_blocks=g.allocator.num_blocks,
                    blocks_in_use=g.allocator.num_used_blocks,
                    tokens_stored=g.allocator.num_filled_slots,
                    bytes_per_block=g.store.bytes_per_block,
                    bytes_in_use=g.store.bytes_in_use(g.allocator.num_used_blocks),
                    bytes_reserved=g.store.bytes_reserved(),
                )
                for g in self.groups
            )
            indexes = [g.prefix_index for g in self.groups if g.prefix_index is not None]
            host = self.host.stats() if self.host is not None else None
            return PoolStats(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                blocks_in_use=self.num_used_blocks,
                blocks_free=sum(g.allocator.num_free_blocks for g in self.groups),
                tokens_stored=sum(g.tokens_stored for g in per_group),
                bytes_per_block=sum(g.bytes_per_block for g in per_group),
                num_sequences=max(g.num_rows() for g in self.groups),
                bytes_in_use=sum(g.bytes_in_use for g in per_group),
                bytes_reserved=sum(g.bytes_reserved for g in per_group),
                blocks_cached=sum(g.allocator.num_idle_blocks for g in self.groups),
                bytes_cached=sum(g.allocator.num_idle_blocks * g.store.bytes_per_block for g in self.groups),
                prefix_cache_budget=self._prefix_budget_bytes(),
                blocks_trapped=sum(num_trapped_free(g.allocator) for g in self.groups),
                num_segments=sum(len(g.store.segment_blocks) for g in self.groups),
                blocks_moved=self.num_moved_blocks,
                bytes_returned=self.bytes_returned,
                # NOTE: each request's lookup is counted by one group's index (its cache's first), so these add up
                lookups=sum(i.num_lookups for i in indexes),
                lookup_tokens=sum(i.num_lookup_tokens for i in indexes),
                hit_tokens=sum(i.num_hit_tokens for i in indexes),
                evictions=sum(i.num_evictions for i in indexes),
                cow_copies=self.num_cow_copies,
                groups=per_group,
                **({} if host is None else dict(
                    host_memory=host.host_memory, host_blocks=host.num_blocks,
                    host_blocks_in_use=host.blocks_in_use, host_blocks_cached=host.blocks_cached,
                    host_blocks_free=host.blocks_free, host_bytes_reserved=host.bytes_reserved,
                    blocks_to_host=host.blocks_to_host, blocks_from_host=host.blocks_from_host,
                    bytes_to_host=host.bytes_to_host, bytes_from_host=host.bytes_from_host)),
            )

    def _prefix_budget_bytes(self) -> int | None:
        """Bytes the cached-idle blocks may take, all groups (None without prefix caching or before a layer)."""
        limits = [self.max_idle_blocks(g.index) for g in self.groups]
        if self.prefix_budget is None or None in limits:
            return None
        return sum(n * g.store.bytes_per_block for n, g in zip(limits, self.groups))

    def health(self) -> Health:
        """Check the alerts now (occupancy, allocation failures, prefix hit rate, step latency; see `metrics.py`)."""
        return self.metrics.check_alerts()

    def check_invariants(self) -> None:
        """Check the pool invariants in every layer group; raise `InvariantError` naming the broken one (by its
        number), the group and the blocks. The list, with what each checks, is in `pool/invariants.py`: 1 block
        states, 2 refcounts, 3 blocks per table, 4 encode-once, 5 the free queue, 6 quantized stages, 8 the
        written-slot counter, 9 the host tier, 10 the pad block, 11 the owner registry (7, a cache's tables against
        their mirror, is `PagedCache.check_invariants()`'s)."""
        with self.lock:
            self._drain()
            tiered = any(group.window is None and group.tier for group in self.groups)
            for group in self.groups:
                check_group_invariants(group, tiered)
            if self.host is not None:
                self.host.check()
            problems = self.owners.check()
            if problems:
                raise InvariantError(f"invariant 11 (owner registry) broken: {'; '.join(problems)}")

    # -- prefix cache on disk (prefix_persistence.py, storage/prefix_file.py) -------------------------------------
    def note_prefix_key(self, key: bytes) -> None:
        """Record the prefix key (`pool/fingerprint.py` `prefix_key`: model fingerprint + storage format) that
        blocks published in this pool are hashed under; `PagedCache.publish` calls it, `save_prefix_cache` reads it."""
        with self.lock:
            self._prefix_keys.setdefault(bytes(key))

    def prefix_keys(self) -> list[bytes]:
        """The prefix keys noted so far (one, for a pool used by one model), oldest first."""
        with self.lock:
            return list(self._prefix_keys)

    def save_prefix_cache(self, path, model=None, config=None) -> int:
        """Save every published block (in use or cached-idle, all layer groups) with its chain hash, the model key
        and the storage format to one safetensors file whose header holds a JSON index (`storage/prefix_file.py`),
        written atomically: an interrupted save leaves the previous file intact. Quantized blocks are saved as
        stored (codes and scales), never re-quantized.

        Args:
            path (`str` or `os.PathLike`): the file to write (replaced if it exists).
            model (`PreTrainedModel`, *optional*): the model the blocks were computed by; needed only when nothing
                was published through a `PagedCache` here (else checked against the key noted at publish).
            config (`PretrainedConfig`, *optional*): for caches keyed by config alone (`from_prefix(config=...)`).

        Returns:
            `int`: blocks saved.

        Raises:
            ValueError: no prefix caching; the model unknown or not the one the blocks were published for; blocks
                of two model keys in this pool.
            OSError: the file cannot be written (the previous one is unchanged).

        Example:

        ```python
        >>> pool.save_prefix_cache("prompts.safetensors")      # process 1, after serving requests
        >>> pool = BlockPool.load_prefix_cache("prompts.safetensors", model=model)   # process 2
        >>> cache = PagedCache.from_prefix(pool, input_ids, model=model)         # hits the loaded blocks
        ```
        """
        from hf_pagedkv.pool.prefix_persistence import save_prefix_cache

        return save_prefix_cache(self, path, model, config)

    @_PoolOrClassMethod
    def load_prefix_cache(pool_or_cls, path, model=None, *, config=None, device=None, **pool_kwargs) -> BlockPool:
        """Load a file of `save_prefix_cache` into this pool (``pool.load_prefix_cache(path, model=model)``), or into
        a new pool with the file's block size and quantization (``BlockPool.load_prefix_cache(path, model=model,
        num_blocks=...)``). Its blocks become cached-idle prefix blocks: `PagedCache.from_prefix` hits them. Those
        the device tier has no room for go to the host tier when the pool has one (`host_memory`).

        Nothing is loaded, and the error says why, when the file is truncated or corrupted (checksums), of another
        format, block size or quantization, for another architecture, or for other weights (model fingerprint).

        Args:
            path (`str` or `os.PathLike`): a file written by `save_prefix_cache`.
            model (`PreTrainedModel`): the model that will run (its fingerprint must match the file's).
            config (`PretrainedConfig`, *optional*): instead of `model`, for caches keyed by config alone.
            device (`torch.device` or `str`, *optional*): where layers this pool does not hold yet get their storage;
                defaults to the model's device.
            pool_kwargs: `BlockPool` arguments for a new pool (`num_blocks`, `max_memory`, `debug`); called on a pool,
                none are allowed.

        Returns:
            `BlockPool`: this pool, or the new one. `pool.last_loaded_blocks` tells how many blocks were published.

        Raises:
            FileNotFoundError, ValueError, PoolExhaustedError: see `prefix_persistence.load_prefix_cache`.
        """
        from hf_pagedkv.pool.prefix_persistence import load_prefix_cache
        from hf_pagedkv.storage.prefix_file import read_prefix_index

        if isinstance(pool_or_cls, BlockPool):
            if pool_kwargs:
                raise ValueError(f"pool.load_prefix_cache got pool settings {sorted(pool_kwargs)}; they size a new "
                                 "pool (BlockPool.load_prefix_cache(path, ..., num_blocks=...)).")
            pool = pool_or_cls
        else:
            index = read_prefix_index(path)
            try:
                quant = QuantConfig(**index["quant_fields"]) if index.get("quant_fields") else None
            except (TypeError, ValueError):
                raise ValueError(f"{path}: the index records an unreadable quantization "
                                 f"{index.get('quant_fields')!r}.") from None
            pool = pool_or_cls(block_size=index.get("block_size"), prefix_caching=True, quant=quant, **pool_kwargs)
        pool.last_loaded_blocks = load_prefix_cache(pool, path, model, config, device)
        return pool


def _group_field(group: int) -> dict:
    """Event fields naming a layer group other than the full-attention one (group 0 events stay as before)."""
    return {} if group == 0 else {"group": group}


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
