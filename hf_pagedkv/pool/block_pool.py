"""`BlockPool`: the public face of a pool of KV blocks, shareable by caches: a face over its layer groups.

Each `BlockGroup` owns its blocks (ids, refcounts, storage, prefix index, tables), the operations on them and their
invariants; the pool adds what spans groups, under one lock: settings (`PoolSettings`), the layers each group holds
and its size (`LayerRegistry`), the owners and their release queue (`PoolOwners`), metrics, the event log, idle
shrinking, the host tier (`HostTiers`) and prefix files (`prefix_persistence.py`).

Exception safety: an operation that fails, by an error (a failed allocation or copy) or an interrupt
(`KeyboardInterrupt`), leaves every invariant holding and loses nothing: it makes the torch calls that may fail
before it changes the bookkeeping (plain Python), or undoes what they did; only releasing freed blocks' storage
(debug poisoning) and trimming the prefix cache come after, and they leave the bookkeeping done
(`tests/property/test_fault_injection.py` injects a failure at every torch call of each operation).

Determinism (tensor parallel ranks must stay in step): which block ids are handed out, when the pool grows and which
cached-idle blocks are evicted depend only on the sequence of calls and on K/V values, never on time, thread timing,
`hash()` of a str or set iteration order: free ids come from a min-heap (the lowest, or ``after + 1``), eviction from
an insertion-ordered LRU, prefix hashes are blake2b of token ids. Ranks running the same `generate` calls keep
identical block tables (`tests/integration/test_tensor_parallel.py` compares their event logs, under different
``PYTHONHASHSEED``s). A cache dropped without `release()` is freed when its last reference goes (it holds no
reference cycle), at the pool's next operation. One thing can still differ between ranks: rows share blocks when
their K/V are bit-identical on this rank's heads, so rows with different tokens whose K/V happen to match on one
rank's heads would share there only. Outputs stay exact either way; only memory differs, so at the limit of a fixed
pool one rank could raise `PoolExhaustedError` where another does not (and the others then wait in their next
collective).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.owner_registry import IdleOwner
from hf_pagedkv.blocks.prefix_index import BlockHash, PrefixIndex
from hf_pagedkv.config import QuantConfig, check_positive_int
from hf_pagedkv.observe.alerts import Health
from hf_pagedkv.observe.events import EventLog
from hf_pagedkv.observe.metrics import PoolMetrics
from hf_pagedkv.observe.pool_stats import PoolStats
from hf_pagedkv.pool.host_tiers import HostTiers
from hf_pagedkv.pool.idle_shrink import IdleShrink
from hf_pagedkv.pool.layer_registry import LayerRegistry
from hf_pagedkv.pool.pool_owners import PoolOwners
from hf_pagedkv.pool.pool_settings import PoolSettings
from hf_pagedkv.pool.staging_budget import compact_within_stages, reserve_error, stages_fit
from hf_pagedkv.pool.stats_snapshot import snapshot_stats
from hf_pagedkv.storage.page_store import LayerSpec

logger = logging.getLogger(__name__)


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

    Layers are split into **layer groups** (`groups`, each a `BlockGroup`: group 0 for full attention, one per
    distinct sliding window), as in vLLM's hybrid KV-cache manager: a sequence needs one block table per group,
    and a sliding-window group frees the blocks that leave its window. Blocks are refcounted: `fork()`, beam
    reordering and `num_return_sequences` share block ids, and a shared block is copied before it is written.

    Args:
        block_size (`int`, *optional*, defaults to 16, 32 when quantized): tokens per block (for a quantized pool,
            also the key quantization group).
        num_blocks (`int`, *optional*): a fixed number of blocks per layer group, preallocated once per layer.
            When a group's blocks are all in use, allocation raises `PoolExhaustedError`.
        max_memory (`int` or `str`, *optional*): a fixed budget in bytes (``"4GiB"``, ``"512MB"``) for all
            layers' keys and values, on all their devices together; turned into `num_blocks` (the same for every
            layer group) when the first cache writes its first layer, which needs the number of layers: create
            that cache with ``PagedCache(pool=pool, config=model.config)``. Each device's share is checked against
            its memory (`device_budget.py`). Under tensor parallel, one rank's budget. Exclusive with `num_blocks`.
        debug (`bool`, *optional*, defaults to `False`): poison freed blocks with NaN.
        prefix_caching (`bool`, *optional*, defaults to `False`): keep a prefix index so that requests sharing a
            prompt prefix share its full blocks (`PagedCache.from_prefix`, `cache.publish`, `hf_pagedkv.generate`).
            Published blocks whose refcount drops to 0 stay cached-idle, within `prefix_cache_memory`.
        quant (`QuantConfig` or `str`, *optional*): store K/V quantized (`QuantConfig`, or a preset such as
            ``"k8v4"``); `None` or ``"fp"`` for full precision. Fixed for the pool's lifetime.
        host_memory (`int` or `str`, *optional*): a host-memory (CPU, pinned under CUDA) tier of this many bytes
            (``"8GiB"``), where `PagedCache.offload()` moves a cache and `prefetch()` brings it back
            (`host_tiers.py`); `pool.stats()` (``host_*``, `bytes_to_host`, ...) tells its occupancy and copies.
        prefix_cache_memory (`int`, `str` or `float`, *optional*): with `prefix_caching`, the budget of cached-idle
            blocks: a size (``"1GiB"``, bytes as an int; all layers, keys + values) or a fraction in ``(0, 1]`` of
            the pool's blocks (`PrefixCacheBudget`). Defaults to 1 GiB for a growable pool, which grows rather than
            evicting within it, and to the whole pool for a fixed one (`stats().prefix_cache_budget`).
        shrink_after (`float`, *optional*): a growable pool gives its free trailing storage segments back by itself
            (`shrink()`, from a daemon timer, `idle_shrink.py`) once this many seconds pass without an allocation;
            None (default): only when `shrink()` is called. Not for tensor-parallel ranks (block ids may differ).

    With neither `num_blocks` nor `max_memory`, the pool grows on demand by chunks (amortised O(1), storage close
    to what is used; `BlockGroup.reserve`). A fixed pool evicts cached-idle blocks before it raises
    `PoolExhaustedError`; a growable one grows instead and evicts only beyond `prefix_cache_memory`.

    Thread safety: every bookkeeping change happens under `lock` (an `RLock`), so several threads may each run
    their own caches on one pool (a cache, one thread at a time). Exception safety, determinism: module docstring.

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
        *,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        debug: bool = False,
        prefix_caching: bool = False,
        quant: QuantConfig | str | None = None,
        host_memory: int | str | None = None,
        prefix_cache_memory: int | str | float | None = None,
        shrink_after: float | None = None,
    ) -> None:
        settings = PoolSettings.of(block_size, num_blocks, max_memory, debug, prefix_caching, quant, host_memory,
                                   prefix_cache_memory, shrink_after)  # ValueError naming a wrong argument
        self.settings = settings  # the checked arguments; fixed
        self.quant = settings.quant  # storage format; fixed
        self.block_size = settings.block_size  # tokens per block; fixed
        self.max_memory = settings.max_memory  # byte budget, or None; fixed
        self.growable = settings.growable  # grow on demand instead of raising; fixed
        # how many cached-idle blocks a group keeps (None without prefix caching); fixed
        self.prefix_budget = settings.prefix_budget
        # gives free segments back after `shrink_after` idle seconds (idle_shrink.py), or None; fixed
        self.idle_shrink = None if settings.shrink_after is None else IdleShrink(self, settings.shrink_after)
        self.lock = threading.RLock()  # guards all bookkeeping; held by a cache for a whole step's extension
        self._prefix_keys: dict[bytes, None] = {}  # keys published blocks were hashed under; note_prefix_key only
        self.last_loaded_blocks = 0  # blocks the last load_prefix_cache published; set by it only
        # the host tier (`cache.offload()`, evicted prefix blocks), or None; fixed
        self.host = None if settings.host_memory is None else HostTiers(self, settings.host_memory)
        # the layer groups, made on first use by `group_for`, the layers each holds, and the blocks each gets
        self.layers = LayerRegistry(settings, self.host)
        self.groups = self.layers.groups  # layer groups; group 0 is full attention; the registry's list; read only
        # owner tokens, their tables in each group, last uses, busy marks, swap hooks (`pool_owners.py`)
        self.owners = PoolOwners(self.groups, self.host, self.lock)
        self.group_for(None)
        self.num_moved_blocks = 0  # blocks moved by `compact`, all groups; changed there only
        self.bytes_returned = 0  # storage bytes given back by `shrink`; changed there only
        self.metrics = PoolMetrics(self)  # counters, step latency, alerts (metrics.py); updated by the hooks below
        # block event log, off by default (events.py); made after group 0, whose refcounts HF_PAGEDKV_EVENTS records
        self.events = EventLog(self)
        self.layers.events = self.events

    # -- configuration ---------------------------------------------------------------------------------------------
    @property
    def debug(self) -> bool:
        """Whether freed blocks are poisoned with NaN."""
        return self.layers.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.layers.set_debug(bool(value))

    @property
    def prefix_caching(self) -> bool:
        """Whether this pool keeps a prefix index (`BlockPool(prefix_caching=True)`)."""
        return self.settings.prefix_caching

    @property
    def allocator(self) -> BlockAllocator:
        """The full-attention group's (group 0: all a model without sliding windows has), as `store`, `prefix_index`."""
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
        """The index of the layer group of layers with this sliding window (`None`: full attention), made on first
        use; `tier` > 0: a group of full-attention layers a tiered retention policy (`PyramidKV`) budgets apart."""
        with self.lock:
            return self.layers.group_for(window, tier)

    def check_layer_group(self, layer_idx: int, group: int) -> None:
        """`ValueError` if another group than `group` holds layer `layer_idx` (`LayerRegistry.check_group`)."""
        with self.lock:
            self.layers.check_group(layer_idx, group)

    def register_layer(self, layer_idx: int, spec: LayerSpec, num_layers: int | None = None, group: int = 0) -> None:
        """`LayerRegistry.register`: storage for `layer_idx` in `group` (a `max_memory` pool is sized by its first
        layer); `ValueError` for a layer of another model or one that does not fit the devices."""
        with self.lock:
            self.layers.register(layer_idx, spec, num_layers, group)

    # -- blocks: each a `BlockGroup` operation under the lock, plus what spans groups: draining the owners collected
    # since the last operation (`PoolOwners.drain`), metrics, idle shrinking --------------------------------------
    def can_reserve(self, n: int, group: int = 0, stages: int = 0) -> bool:
        """Whether `reserve(n, group, stages=stages)` would succeed. No side effects."""
        with self.lock:
            return self.groups[group].can_reserve(n) and stages_fit(self.groups[group].store, stages)

    def reserve(self, n: int, group: int = 0, rows: int = 1, run: int = 0, stages: int = 0) -> None:
        """`BlockGroup.reserve`: `n` free blocks (and `stages` stages) in `group`, else `PoolExhaustedError`."""
        with self.lock:
            self.owners.drain(self.free_groups)
            if self.idle_shrink is not None:
                self.idle_shrink.touch()
            g = self.groups[group]
            if not g.can_reserve(n) or not stages_fit(g.store, stages):
                self.metrics.count_failure(n)
                raise reserve_error(g, n, stages, named=len(self.groups) > 1)
            g.reserve(n, rows, run)  # (the stages are only checked: a step takes them later, in its writes)

    def allocate(self, n: int, after: int | None = None, group: int = 0) -> list[int]:
        """Allocate `n` blocks of `group` (refcount 1 each), growing or raising `PoolExhaustedError` first if needed."""
        with self.lock:
            self.reserve(n, group)
            blocks = self.groups[group].allocate(n, after)
            self.metrics.count_allocation(n, self.num_used_blocks)
            return blocks

    def allocate_rows(self, rows: int, n: int, stride: int, group: int = 0) -> list[list[int]] | None:
        """`BlockGroup.allocate_rows`: rows of `n` blocks `stride` apart, or None (reserve ``run=rows*stride``)."""
        with self.lock:
            out = self.groups[group].allocate_rows(rows, n, stride)
            if out is not None:
                self.metrics.count_allocation(rows * n, self.num_used_blocks)
            return out

    def pad_block(self, group: int = 0) -> int | None:
        """The pad block of `group`, or None if none was reserved yet (see `ensure_pad_block`). No side effects."""
        return self.groups[group].pad_block

    def ensure_pad_block(self, group: int = 0) -> int:
        """The pad block of `group` (`BlockGroup.set_pad_block`), reserved on first use (may raise as `allocate`)."""
        with self.lock:
            g = self.groups[group]
            if g.pad_block is None:
                g.set_pad_block(self.allocate(1, group=group)[0])  # the pool's own reference: never dropped
            return g.pad_block

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use (refcount >= 1), summed over layer groups."""
        return sum(group.allocator.num_used_blocks for group in self.groups)

    def incref(self, blocks: list[int], group: int = 0) -> None:
        with self.lock:
            self.groups[group].incref(blocks)

    def free(self, blocks: list[int], group: int = 0) -> None:
        """`BlockGroup.free` (references dropped first), then the prefix cache trimmed to its budget."""
        with self.lock:
            g = self.groups[group]
            freed = g.free(blocks)
            if g.prefix_index is not None:  # (the budget is computed after: a torch call, which may fail)
                g.trim_prefix_cache(self.max_idle_blocks(group))
            if freed and self.idle_shrink is not None:
                self.idle_shrink.arm()

    def free_groups(self, blocks: dict[int, list[int]]) -> None:
        """`free(blocks[g], g)` for every group `g`, every group's references dropped even when releasing one
        group's storage (the last part of `free`, which may raise) fails: then that error is raised after all."""
        with self.lock, contextlib.ExitStack() as frees:
            for group, ids in reversed(blocks.items()):  # run first in, so in group order
                frees.callback(self.free, ids, group)

    def max_idle_blocks(self, group: int = 0) -> int | None:
        """Cached-idle blocks `group` keeps at most (`LayerRegistry.max_idle_blocks`)."""
        return self.layers.max_idle_blocks(group)

    def mark_written(self, blocks: list[int], fills: list[int], group: int = 0) -> None:
        self.groups[group].mark_written(blocks, fills)

    def copy_on_write(self, src: list[int], dst: list[int], group: int = 0) -> None:
        with self.lock:
            self.groups[group].copy_on_write(src, dst)

    def is_published(self, block: int, group: int = 0) -> bool:
        return self.groups[group].is_published(block)

    def acquire_prefix(self, hashes: list[BlockHash], num_tokens: int, group: int = 0, count: bool = True) -> list[int]:
        with self.lock:
            self.owners.drain(self.free_groups)
            return self.groups[group].acquire_prefix(hashes, num_tokens, count)

    def match_prefix(self, hashes: list[BlockHash], group: int = 0) -> list[int]:
        with self.lock:
            return self.groups[group].match_prefix(hashes)

    def publish_blocks(self, hashes: list[BlockHash], blocks: list[int], group: int = 0) -> int:
        with self.lock:
            return self.groups[group].publish(hashes, blocks)

    # -- compaction and shrinking ------------------------------------------------------------------------------------
    def compact(self, max_blocks: int = 64) -> int:
        """Move up to `max_blocks` live blocks of each layer group to free ids below them, so that rows become
        consecutive (read as views) and free blocks gather at the end, where `shrink` can return their segments;
        exact, all or nothing per group (`BlockGroup.compact`; the groups before a failed one stay compacted, which
        changes no output either). Bounded per call: call it again (e.g. once per step) until it returns 0. Call it
        between forward steps: never while a forward pass runs on a cache of this pool (say, from another thread).

        Returns the blocks moved, all groups (also counted in `stats().blocks_moved`); `ValueError` when
        `max_blocks` is not a positive int.
        """
        check_positive_int("max_blocks", max_blocks)
        with self.lock:
            self.owners.drain(self.free_groups)
            moved = 0
            for g in self.groups:
                n = compact_within_stages(g, max_blocks)
                moved += n
                self.num_moved_blocks += n
            return moved

    def shrink(self) -> int:
        """Give back the storage segments at the end of each layer group whose blocks are all free (a growable
        pool; a fixed one keeps its preallocation and returns 0); `compact` first moves live blocks down. Returns
        the bytes returned (also summed in `stats().bytes_returned`)."""
        with self.lock:
            self.owners.drain(self.free_groups)
            if not self.growable:
                return 0
            returned = sum(g.shrink() for g in self.groups)
            self.bytes_returned += returned
            return returned

    # -- owners (live block tables): `PoolOwners` says what each does ----------------------------------------------
    def register_owner(self, rows: list[BlockTable] | None = None, group: int = 0) -> int:
        """A new owner token; `rows` (a list object the owner keeps filling) are its tables in `group`."""
        with self.lock:
            self.owners.drain(self.free_groups)
            return self.owners.register(rows, group)

    def add_rows(self, token: int, group: int, rows: list[BlockTable], mover=None) -> None:
        self.owners.add_rows(token, group, rows, mover)

    def unregister_owner(self, token: int) -> None:
        self.owners.unregister(token)

    def release_owner(self, token: int) -> None:
        """Queue a released or collected owner; its blocks are freed at the start of the next pool operation."""
        self.owners.release(token)

    def touch_owner(self, token: int) -> None:
        self.owners.touch(token)

    def set_owner_swapper(self, token: int, hook) -> None:
        self.owners.set_swapper(token, hook)

    def owner_busy(self, token: int):
        """``with pool.owner_busy(cache.seq_id):``: `idle_owners` does not offer the cache meanwhile."""
        return self.owners.busy(token)

    def idle_owners(self, exclude=()) -> list[IdleOwner]:
        """The caches that could be swapped out to the host tier now, least recently used first (`PoolOwners.idle`)."""
        with self.lock:
            self.owners.drain(self.free_groups)
            return self.owners.idle(exclude)

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and prefix-cache counters (see `PoolStats`), summed over layer groups,
        with one `GroupStats` per group in `groups`."""
        with self.lock:
            self.owners.drain(self.free_groups)
            return snapshot_stats(self)

    def health(self) -> Health:
        """Check the alerts now (occupancy, allocation failures, prefix hit rate, step latency; see `metrics.py`)."""
        return self.metrics.check_alerts()

    def check_invariants(self) -> None:
        """Check the pool invariants; raise `InvariantError` naming the broken one (by its number), the group and
        the blocks. Each is stated where its state lives (`pool/invariants.py` lists them): 1-6, 8 and 10 in
        `BlockGroup` (checked per group), 9 in `HostTiers`, 11 in `OwnerRegistry` (7, a cache's tables against
        their mirror, is `PagedCache.check_invariants()`'s)."""
        with self.lock:
            self.owners.drain(self.free_groups)
            tiered = any(group.window is None and group.tier for group in self.groups)
            for group in self.groups:
                group.check_invariants(tiered)
            if self.host is not None:
                self.host.check()
            self.owners.check()

    # -- prefix cache on disk (prefix_persistence.py, storage/prefix_file.py) -------------------------------------
    def note_prefix_key(self, key: bytes) -> None:
        """Record the prefix key (`fingerprint.prefix_key`) blocks published here are hashed under (for saving)."""
        with self.lock:
            self._prefix_keys.setdefault(bytes(key))

    def prefix_keys(self) -> list[bytes]:
        """The prefix keys noted so far (one, for a pool used by one model), oldest first."""
        with self.lock:
            return list(self._prefix_keys)

    def save_prefix_cache(self, path, model=None, config=None) -> int:
        """Save every published block (in use or cached-idle, all layer groups, both tiers) with its chain hash, the
        model key and the storage format to one safetensors file (`storage/prefix_file.py`), written atomically.
        Quantized blocks are saved as stored (codes and scales), never re-quantized. See docs/sharing.md.

        Args:
            path (`str` or `os.PathLike`): the file to write (replaced if it exists).
            model (`PreTrainedModel`, *optional*): the model the blocks were computed by; needed only when nothing
                was published through a `PagedCache` here (else checked against the key noted at publish).
            config (`PretrainedConfig`, *optional*): for caches keyed by config alone (`from_prefix(config=...)`).

        Returns the blocks saved. Raises `ValueError` without prefix caching, for an unknown model or one the blocks
        were not published for, or blocks of two model keys; `OSError` when the file cannot be written (the
        previous one is unchanged).
        """
        from hf_pagedkv.pool.prefix_persistence import save_prefix_cache

        return save_prefix_cache(self, path, model, config)

    @_PoolOrClassMethod
    def load_prefix_cache(pool_or_cls, path, model=None, *, config=None, device=None, **pool_kwargs) -> BlockPool:
        """Load a file of `save_prefix_cache` into this pool (``pool.load_prefix_cache(path, model=model)``), or into
        a new pool with the file's block size and quantization (``BlockPool.load_prefix_cache(path, model=model,
        num_blocks=...)``). Its blocks become cached-idle prefix blocks (the overflow goes to the host tier, if any):
        `PagedCache.from_prefix` hits them. A file that is corrupted, or for another format or model, loads nothing.

        Args:
            path (`str` or `os.PathLike`): a file written by `save_prefix_cache`.
            model (`PreTrainedModel`): the model that will run (its fingerprint must match the file's).
            config (`PretrainedConfig`, *optional*): instead of `model`, for caches keyed by config alone.
            device (`torch.device` or `str`, *optional*): where layers this pool does not hold yet get their storage;
                defaults to the model's device.
            pool_kwargs: `BlockPool` arguments for a new pool (`num_blocks`, `max_memory`, `debug`); called on a pool,
                none are allowed.

        Returns this pool, or the new one (`pool.last_loaded_blocks`: blocks published). Raises `FileNotFoundError`,
        `ValueError`, `PoolExhaustedError`: see `prefix_persistence.load_prefix_cache`.
        """
        from hf_pagedkv.pool.prefix_persistence import open_prefix_cache

        return open_prefix_cache(pool_or_cls, path, model, config, device, pool_kwargs)
