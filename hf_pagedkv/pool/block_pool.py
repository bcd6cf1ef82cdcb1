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

from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.owner_registry import IdleOwner
from hf_pagedkv.blocks.prefix_index import BlockHash
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
        block_size (`int`, *optional*, defaults to 16, 32 when any layer group is quantized): tokens per block, the
            same in every group (for a quantized group, also the key quantization group).
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
        quant (`QuantConfig`, `str` or `dict`, *optional*): fixed K/V format: a `QuantConfig`, a preset (``"k8v4"``;
            `None`, ``"fp"``: full precision), or one per kind of layer group: ``{"sliding": None, "full": "k4v4"}``.
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

    Its public methods and properties are what a user calls; the pool's collaborators (`PagedCache`'s parts, the
    serving engine) work on its parts under `lock`: `groups[g]` (blocks), `owners` (`PoolOwners`), `layers`
    (`LayerRegistry`), and the underscored block operations that also need the pool (owner draining, metrics).

    Raises:
        ValueError: `block_size` or `num_blocks` not a positive int; `block_size` over `MAX_BLOCK_SIZE` (65,536
            tokens); `num_blocks` whose bookkeeping (128 bytes of host memory per block) exceeds the machine's RAM
            (at the first layer, when its storage would not fit the device: `LayerRegistry.register`); both
            `num_blocks` and `max_memory` given; `max_memory` not a size; `host_memory` more than the machine's
            RAM; an invalid `quant`; `prefix_cache_memory` without `prefix_caching`, or neither a size nor a
            fraction in (0, 1]; `shrink_after` not a number of seconds > 0, or given for a fixed pool.

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
        quant: QuantConfig | str | dict | None = None,
        host_memory: int | str | None = None,
        prefix_cache_memory: int | str | float | None = None,
        shrink_after: float | None = None,
    ) -> None:
        settings = PoolSettings.of(block_size, num_blocks, max_memory, debug, prefix_caching, quant, host_memory,
                                   prefix_cache_memory, shrink_after)  # ValueError naming a wrong argument
        self.settings = settings  # the checked arguments; fixed
        self.quant = settings.quant.pool_quant  # storage format: `QuantConfig`, or `GroupQuant` if kinds differ; fixed
        self.block_size = settings.block_size  # tokens per block; fixed
        self.max_memory = settings.max_memory  # byte budget, or None; fixed
        self.growable = settings.growable  # grow on demand instead of raising; fixed
        # how many cached-idle blocks a group keeps (None without prefix caching); fixed
        self.prefix_budget = settings.prefix_budget
        # gives free segments back after `shrink_after` idle seconds (idle_shrink.py), or None; fixed
        self.idle_shrink = None if settings.shrink_after is None else IdleShrink(self, settings.shrink_after)
        self.lock = threading.RLock()  # guards all bookkeeping; held by a cache for a whole step's extension
        # the prefix keys (`fingerprint.prefix_key`) published blocks were hashed under, oldest first (one, for a pool
        # used by one model), for `save_prefix_cache`; added under `lock` by `CacheRows.publish`, `load_prefix_cache`
        self.prefix_keys: dict[bytes, None] = {}
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
    def num_blocks(self) -> int:
        """Blocks the pool holds storage for, summed over its layer groups."""
        return sum(group.allocator.num_blocks for group in self.groups)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use (refcount >= 1), summed over layer groups."""
        return sum(group.allocator.num_used_blocks for group in self.groups)

    def group_for(self, window: int | None, tier: int = 0) -> int:
        """The index of the layer group of layers with this sliding window (`None`: full attention), made on first
        use; `tier` > 0: a group of full-attention layers a tiered retention policy (`PyramidKV`) budgets apart."""
        with self.lock:
            return self.layers.group_for(window, tier)

    # -- blocks, for the pool's collaborators (`PagedCache`'s parts, `HostTiers`, prefix files): the `BlockGroup`
    # operations that also need what spans groups: draining the owners collected since the last operation
    # (`PoolOwners.drain`), metrics, idle shrinking, the prefix-cache budget, a quantized budget's stages. A group's
    # other operations are called on it (``with pool.lock: pool.groups[g].incref(blocks)``) --------------------------
    def _can_reserve(self, n: int, group: int = 0, stages: int = 0) -> bool:
        """Whether `_reserve(n, group, stages=stages)` would succeed. No side effects."""
        with self.lock:
            return self.groups[group].can_reserve(n) and stages_fit(self.groups[group].store, stages)

    def _reserve(self, n: int, group: int = 0, rows: int = 1, run: int = 0, stages: int = 0) -> None:
        """`BlockGroup.reserve`: `n` free blocks (and `stages` stages) in `group`, evicting or growing, else
        `PoolExhaustedError`."""
        with self.lock:
            self.owners.drain(self._free_groups)
            if self.idle_shrink is not None:
                self.idle_shrink.touch()
            g = self.groups[group]
            if not g.can_reserve(n) or not stages_fit(g.store, stages):
                self.metrics.count_failure(n)
                raise reserve_error(g, n, stages, named=len(self.groups) > 1)
            g.reserve(n, rows, run)  # (the stages are only checked: a step takes them later, in its writes)

    def _allocate(self, n: int, after: int | None = None, group: int = 0) -> list[int]:
        """Allocate `n` blocks of `group` (refcount 1 each), growing or raising `PoolExhaustedError` first if needed."""
        with self.lock:
            self._reserve(n, group)
            blocks = self.groups[group].allocate(n, after)
            self.metrics.count_allocation(n, self.num_used_blocks)
            return blocks

    def _allocate_rows(self, rows: int, n: int, stride: int, group: int = 0) -> list[list[int]] | None:
        """`BlockGroup.allocate_rows`: rows of `n` blocks `stride` apart, or None (reserve ``run=rows*stride``)."""
        with self.lock:
            out = self.groups[group].allocate_rows(rows, n, stride)
            if out is not None:
                self.metrics.count_allocation(rows * n, self.num_used_blocks)
            return out

    def _ensure_pad_block(self, group: int = 0) -> int:
        """The pad block of `group` (`BlockGroup.set_pad_block`), reserved on first use (may raise as `allocate`)."""
        with self.lock:
            g = self.groups[group]
            if g.pad_block is None:
                g.set_pad_block(self._allocate(1, group=group)[0])  # the pool's own reference: never dropped
            return g.pad_block

    def _free(self, blocks: list[int], group: int = 0) -> None:
        """`BlockGroup.free` (references dropped first), then the prefix cache trimmed to its budget."""
        with self.lock:
            g = self.groups[group]
            freed = g.free(blocks)
            if g.prefix_index is not None:  # (the budget is computed after: a torch call, which may fail)
                g.trim_prefix_cache(self.layers.max_idle_blocks(group))
            if freed and self.idle_shrink is not None:
                self.idle_shrink.arm()

    def _free_groups(self, blocks: dict[int, list[int]]) -> None:
        """`_free(blocks[g], g)` for every group `g`, every group's references dropped even when releasing one
        group's storage (the last part of `_free`, which may raise) fails: then that error is raised after all."""
        with self.lock, contextlib.ExitStack() as frees:
            for group, ids in reversed(blocks.items()):  # run first in, so in group order
                frees.callback(self._free, ids, group)

    def _acquire_prefix(self, hashes: list[BlockHash], num_tokens: int, group: int = 0,
                        count: bool = True) -> list[int]:
        """`BlockGroup.acquire_prefix` (one reference to each cached block of the prefix), owners drained first."""
        with self.lock:
            self.owners.drain(self._free_groups)
            return self.groups[group].acquire_prefix(hashes, num_tokens, count)

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
            self.owners.drain(self._free_groups)
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
            self.owners.drain(self._free_groups)
            if not self.growable:
                return 0
            returned = sum(g.shrink() for g in self.groups)
            self.bytes_returned += returned
            return returned

    # -- owners (live block tables): `PoolOwners` says what each does ----------------------------------------------
    def _register_owner(self, rows: list[BlockTable] | None = None, group: int = 0) -> int:
        """A new owner token; `rows` (a list object the owner keeps filling) are its tables in `group`."""
        with self.lock:
            self.owners.drain(self._free_groups)
            return self.owners.register(rows, group)

    def owner_busy(self, token: int):
        """``with pool.owner_busy(cache.seq_id):``: `idle_owners` does not offer the cache meanwhile."""
        return self.owners.busy(token)

    def idle_owners(self, exclude=()) -> list[IdleOwner]:
        """The caches that could be swapped out to the host tier now, least recently used first (`PoolOwners.idle`)."""
        with self.lock:
            self.owners.drain(self._free_groups)
            return self.owners.idle(exclude)

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A consistent snapshot of occupancy and prefix-cache counters (see `PoolStats`), summed over layer groups,
        with one `GroupStats` per group in `groups`."""
        with self.lock:
            self.owners.drain(self._free_groups)
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
            self.owners.drain(self._free_groups)
            tiered = any(group.window is None and group.tier for group in self.groups)
            for group in self.groups:
                group.check_invariants(tiered)
            if self.host is not None:
                self.host.check()
            self.owners.check()

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
