"""`PagedCache`: the drop-in `transformers.Cache` that stores K/V in the refcounted blocks of a `BlockPool`."""

from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch

from hf_pagedkv._compat import Cache, DummyLayer, layer_plan
from hf_pagedkv.block_pool import BlockPool
from hf_pagedkv.pool.block_table import BlockTable, num_blocks_for
from hf_pagedkv.config import QuantConfig, check_positive_int
from hf_pagedkv.errors import CacheReleasedError, InvariantError
from hf_pagedkv.adapter.in_place_reads import InPlaceReads
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.adapter.prefix_cache import PrefixMixin
from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.adapter.step import StepMixin, _Step

logger = logging.getLogger(__name__)


class PagedCache(StepMixin, PrefixMixin, Cache):
    """A paged, refcounted KV cache for `generate()` and `forward()`, exact against `DynamicCache`.

    Each batch row has a block table into a `BlockPool`; on each forward step the first layer's `update`
    extends every row's table (allocating at block boundaries, copy-on-write when the last block is shared)
    and each layer writes its new K/V into those slots. Beam reordering, `fork()`, `batch_select_indices` and
    `batch_repeat_interleave` move block ids and refcounts, never tensors. At a prefill, rows whose tokens are
    identical (the rows `num_return_sequences` and `num_beams` expand the prompt into) are detected from their
    K/V, checked layer by layer, and stored once. A cache pre-filled with `b` rows that is then given `k * b`
    rows (for example `generate(num_beams=k)` after a prompt was cached) expands itself by forking its rows.
    With a `BlockPool(prefix_caching=True)`, `from_prefix` and `publish` share prompt prefixes across requests
    (see `PrefixMixin`).

    Args:
        block_size (`int`, *optional*, defaults to 16 (32 when quantized), or the pool's): tokens per block.
        pool (`BlockPool`, *optional*): a pool to share with other caches of the same model; a new growable
            pool by default.
        debug (`bool`, *optional*, defaults to `False`): check `pool.check_invariants()` after every step and
            poison freed blocks with NaN, so a stale read shows up at once.
        config (`PretrainedConfig`, *optional*): the model config; builds the layers up front with their
            sliding windows (like `DynamicCache(config=...)`) and lets `max_memory` size the pool.
        num_blocks (`int`, *optional*), max_memory (`int` or `str`, *optional*): size of the new pool (see
            `BlockPool`); not allowed together with `pool`. `max_memory` needs `config` too: the budget is divided
            over the layers, so their number must be known (``PagedCache(config=model.config, max_memory="4GiB")``).
        quant (`QuantConfig` or `str`, *optional*): quantized storage, e.g. ``"k8v4"`` or
            ``QuantConfig(key_bits=8, value_bits=4)`` (see `QuantConfig`); ``"fp"`` for full precision. `None`
            (default) means the pool's setting, full precision for a new pool. The last, partial block of each row
            stays in full precision; `layers[i].keys` / `.values` return de-quantized tensors.

    Raises:
        ValueError: `block_size` not a positive int or different from the pool's; `pool` not a `BlockPool`;
            `num_blocks`/`max_memory` given with `pool`; `quant` invalid or different from the pool's; a layer
            type it does not store (by name); at the first `update`, a `max_memory` pool not sized yet and no
            `config` (the number of layers is unknown).

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> cache = PagedCache()
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    >>> cache.pool.stats().bytes_in_use     # bytes of the blocks this cache holds
    >>> cache.release()                     # or use `with PagedCache() as cache:`
    ```
    """

    def __init__(
        self,
        block_size: int | None = None,
        pool: BlockPool | None = None,
        debug: bool = False,
        config=None,
        *,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        quant: QuantConfig | str | None = None,
    ) -> None:
        if block_size is not None:
            check_positive_int("block_size", block_size)
        if quant is not None:
            quant = QuantConfig.resolve(quant)
        if pool is None:
            pool = BlockPool(block_size, num_blocks=num_blocks, max_memory=max_memory, debug=debug, quant=quant)
        elif not isinstance(pool, BlockPool):
            raise ValueError(f"`pool` must be a hf_pagedkv.BlockPool, got {type(pool).__name__}.")
        elif num_blocks is not None or max_memory is not None:
            raise ValueError("`num_blocks`/`max_memory` size a new pool; set them on the BlockPool you pass.")
        elif block_size is not None and block_size != pool.block_size:
            raise ValueError(f"block_size={block_size} differs from the pool's block_size={pool.block_size}.")
        elif quant is not None and quant != pool.quant:
            raise ValueError(f"quant={quant.name} ({quant}) differs from the pool's quant={pool.quant.name} "
                             f"({pool.quant}); the quantization is a property of the pool's storage: pass "
                             "quant=None to use the pool's, or create a BlockPool(quant=...) for this setting.")
        if debug:
            pool.debug = True
        self.pool = pool  # the BlockPool holding this cache's blocks; fixed
        self.block_size = pool.block_size  # tokens per block; fixed
        self.debug = debug  # check invariants after every step
        self._groups: list[RowTables] = []  # one per layer group this cache's layers use; full attention first
        self._by_group: dict[int, RowTables] = {}  # pool group index -> its RowTables
        self._num_tokens = 0  # tokens held by every row (rows of a batch have equal lengths, padding included)
        self._step: _Step | None = None  # the current forward step, set by its first layer
        self.last_step_tokens = 0  # new tokens per row of the last forward step (a sliding group holds them too)
        self._maybe_dups = False  # rows were just forked, so identical rows may be deduplicated next step
        self._in_place = InPlaceReads()  # which step's attention reads the pool in place (hf_pagedkv.attention)
        self._released = False
        self._owner = pool._register()  # this cache's token in the pool's table registry
        self.seq_id = self._owner  # names this cache in the block event log
        self._finalizer = weakref.finalize(self, pool._release_owner, self._owner)  # frees blocks if never released
        layers = []
        if config is not None:
            for idx, (kind, window) in enumerate(layer_plan(config)):
                if kind == "dummy":
                    layers.append(DummyLayer())
                else:
                    layers.append(PagedLayer(self, idx, window, group=self._tables_for(window).group))
        super().__init__(layers=layers)
        self._num_layers = len(layers) or None  # known when built from a config (sizes max_memory pools)

    # -- transformers entry points -----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new K/V of layer `layer_idx` and return the K/V attention reads.

        Args:
            key_states, value_states (`torch.Tensor` of shape `[batch, num_kv_heads, num_new_tokens, head_dim]`).
            layer_idx (`int`): the model layer.

        Returns:
            keys, values of shape `[batch, num_kv_heads, seq_len, head_dim]`.
        """
        if layer_idx < 0 or (self._num_layers is not None and layer_idx >= len(self.layers)):
            raise IndexError(f"layer_idx={layer_idx} is out of range: this PagedCache was built for "
                             f"{len(self.layers)} layers (config=).")
        while len(self.layers) <= layer_idx:  # a cache built without config: full-attention layers, as DynamicCache
            self.layers.append(PagedLayer(self, len(self.layers), group=self._tables_for(None).group))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached per row (layer `layer_idx`)."""
        return super().get_seq_length(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens from every row (a negative int, as `DynamicCache`).

        Blocks past ``ceil(new_len / block_size)`` are freed; a shared last block is kept and copied on the next
        write.

        Raises:
            ValueError: `tokens_to_remove` is positive, or reaches before what sliding-window layers still hold.
            CacheReleasedError: the cache was released.
        """
        self.check_usable()
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as with DynamicCache."
            )
        if tokens_to_remove == 0 or self._num_tokens == 0:
            return
        new_len = max(0, self._num_tokens + tokens_to_remove)
        for rt in self._groups:  # a sliding group must still hold the window the next step reads
            if rt.droppable(new_len) < rt.num_dropped:
                raise ValueError(
                    f"crop({tokens_to_remove}) to {new_len} tokens reaches before what the sliding-window layers "
                    f"(window {rt.window}) still hold: they keep the last window - 1 tokens plus the last step's "
                    f"new tokens ({(rt.num_dropped * self.block_size)} tokens onward here). Crop at most the tokens "
                    "of the last forward step, as assisted decoding does."
                )
        keep, kept = num_blocks_for(new_len, self.block_size), new_len % self.block_size  # kept: of the last block
        with self.pool.lock:
            for rt in self._groups:
                group = self.pool.groups[rt.group]
                for row in rt.rows:
                    self.pool.free(row.truncate(keep), rt.group)
                    row.num_tokens = new_len
                if not kept:
                    continue
                # a last block only this cache's rows hold now holds what they kept (all rows crop together); a
                # published block keeps its content
                lasts = Counter(row.blocks[-1] for row in rt.rows if row.blocks)
                mine = [b for b, holders in lasts.items()
                        if group.allocator.refcount(b) == holders and not self.pool.is_published(b, rt.group)]
                for b in mine:
                    group.allocator.set_fill(b, kept)
                if self.pool.debug:  # stale tokens past the crop must never be read (blocks one row holds alone)
                    B = self.block_size
                    group.store.poison_slots([b * B + i for b in mine if group.allocator.refcount(b) == 1
                                              for i in range(kept, B)])
        for layer in self._paged_layers():
            layer.num_tokens = min(layer.num_tokens, new_len)
        self._num_tokens = new_len
        self._step = None
        self._after_change()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes a copy of row `beam_idx[i]` (`beam_idx` may also have another length, as
        with `DynamicCache`). Moves block ids and refcounts, not tensors.

        Raises:
            ValueError: an index out of range.
        """
        beam_idx = torch.as_tensor(beam_idx)
        if beam_idx.is_floating_point() or beam_idx.dtype == torch.bool:
            raise ValueError(f"reorder_cache: beam_idx must hold integer row indices, got {beam_idx.dtype}.")
        idx = beam_idx.reshape(-1).tolist()
        if idx == list(range(self.num_rows)):
            return
        # as many rows after as before: leading blocks every row shares keep their counts
        self._select(idx, common=len(idx) == self.num_rows and bool(idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (refcounts follow)."""
        self._select(torch.as_tensor(indices).reshape(-1).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times, sharing its blocks (a fork per copy).

        Raises:
            ValueError: `repeats` is not a non-negative int (as `DynamicCache`).
        """
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
            raise ValueError(f"batch_repeat_interleave: repeats must be a non-negative int, got {repeats!r}.")
        self._select([r for r in range(self.num_rows) for _ in range(repeats)])
        self._maybe_dups = True

    def reset(self) -> None:
        """Free every block this cache holds; the cache stays usable (empty)."""
        with self.pool.lock:
            for rt in self._groups:
                self.pool.free([b for row in rt.rows for b in row.blocks], rt.group)
                rt.reset()
        self._num_tokens = 0
        self._step = None
        self._grad_history = False
        for layer in self._paged_layers():
            layer.num_tokens = 0

    # -- hf_pagedkv API -----------------------------------------------------------------------------------------
    def fork(self) -> PagedCache:
        """A new cache holding the same tokens, sharing every block (copy-on-write); O(blocks), no tensor copy.

        `copy.deepcopy(cache)` and `copy.copy(cache)` return a fork too, so code written for `DynamicCache` (such as
        transformers' "re-use a prompt cache" recipe, ``past_key_values = copy.deepcopy(prompt_cache)`` per
        question) works unchanged and costs no tensor copy. Release each fork when done (or use `with`).

        Raises:
            CacheReleasedError: this cache was released.
        """
        self.check_usable()
        other = PagedCache(pool=self.pool, debug=self.debug)
        other.layers = [DummyLayer() if isinstance(layer, DummyLayer) else self._clone_layer(layer, other)
                        for layer in self.layers]
        other._num_layers = self._num_layers
        other._prefix_key = self._prefix_key  # same model, same tokens: a fork may publish them too
        other._grad_history = self._grad_history
        with self.pool.lock:
            for mine, rt in [(other._tables_for(rt.window), rt) for rt in self._groups]:  # all groups, then rows
                for row in rt.rows:
                    self.pool.incref(row.blocks, rt.group)
                    mine.rows.append(row.copy())
                mine.table = rt.table.clone()
        other._num_tokens = self._num_tokens
        other._after_change()
        return other

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(cache)`: an independent cache sharing this one's blocks copy-on-write (see `fork`)."""
        # NOTE: a fork, not a tensor copy: the blocks are immutable once shared (a write copies first), so the two
        # caches are as independent as two deep copies. Copying the pool itself would give a second pool per copy.
        other = self.fork()
        memo[id(self)] = other
        return other

    def __copy__(self) -> PagedCache:
        """`copy.copy(cache)`: a fork too (a shallow copy sharing the block tables would corrupt both caches)."""
        return self.fork()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "A PagedCache cannot be pickled: its K/V live in a BlockPool shared with other caches of this process. "
            "Use cache.fork() (or copy.deepcopy(cache), which forks) for an independent copy in this process; "
            "cache.layers[i].keys / .values give plain tensors to save."
        )

    def release(self) -> None:
        """Return every block to the pool. Idempotent; the cache cannot be used afterwards."""
        if self._released:
            return
        self.reset()
        self._finalizer.detach()
        self.pool._unregister(self._owner)  # the rows are empty now
        self._released = True

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def num_rows(self) -> int:
        """Batch rows this cache holds (each has one block table per layer group)."""
        return len(self._groups[0].rows) if self._groups else 0

    @property
    def _rows(self) -> list[BlockTable]:
        """The rows' block tables in the first layer group (full attention when the model has it)."""
        return self._groups[0].rows if self._groups else []

    def block_tables(self, window: int | None = ...) -> list[list[int]]:
        """A copy of each row's held block ids, in token order, in one layer group: the first (full attention when
        the model has it) by default, or the group of layers with sliding window `window` (`None`: full)."""
        if window is ...:
            rt = self._groups[0] if self._groups else None
        else:
            rt = next((rt for rt in self._groups if rt.window == window), None)
        return [list(row.blocks) for row in rt.rows] if rt is not None else []

    def __repr__(self) -> str:
        quant = f", quant={self.pool.quant.name}" if self.pool.quant.is_quantized else ""
        return (f"PagedCache(rows={self.num_rows}, tokens={self._num_tokens}, block_size={self.block_size}, "
                f"layers={len(self.layers)}{quant}{', released' if self._released else ''})")

    # -- internals: layers ----------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self._released:
            raise CacheReleasedError("This PagedCache was released; create a new one (or fork() before release()).")

    def _paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def register_layer(self, layer: PagedLayer, spec: LayerSpec) -> None:
        self.pool.register_layer(layer.layer_idx, spec, self._num_layers, group=layer.group)

    def _tables_for(self, window: int | None) -> RowTables:
        """This cache's tables in the pool's layer group for `window`, created (and registered) on first use."""
        group = self.pool.group_for(window)
        rt = self._by_group.get(group)
        if rt is None:
            if self._num_tokens:
                raise RuntimeError("A layer of a new layer group appeared after this PagedCache stored tokens; "
                                   "build the cache with config=model.config so every layer is known up front.")
            rt = RowTables(group, window, self.block_size)
            rt.reset(self.num_rows)
            self.pool._add_rows(self._owner, group, rt.rows)
            self._groups.insert(0 if window is None else len(self._groups), rt)  # full attention first
            self._by_group[group] = rt
        return rt

    @staticmethod
    def _clone_layer(layer: PagedLayer, owner: PagedCache) -> PagedLayer:
        new = PagedLayer(owner, layer.layer_idx, layer.sliding_window, group=layer.group)
        new.num_tokens, new.spec, new.is_initialized = layer.num_tokens, layer.spec, layer.is_initialized
        if layer.is_initialized:
            new.dtype, new.device = layer.dtype, layer.device
        return new

    def _after_change(self) -> None:
        if self.debug:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Check the pool's invariants and this cache's own: per layer group, rows in step and the block tables'
        tensor mirror equal to the tables. Raises `InvariantError`."""
        self.pool.check_invariants()
        for rt in self._groups:
            problems = rt.check()
            if len(rt.rows) != self.num_rows or any(row.num_tokens != self._num_tokens for row in rt.rows):
                problems.append(f"group rows/tokens out of step with the cache ({self.num_rows} rows of "
                                f"{self._num_tokens} tokens)")
            if problems:
                raise InvariantError(f"invariant 7 (block tables and their mirror agree) broken in the cache's "
                                     f"group {rt.group}: {'; '.join(problems)}")

    # -- internals: rows ------------------------------------------------------------------------------------------
    def _select(self, idx: list[int], common: bool = False) -> None:
        """Rows become copies of rows `idx`. With `common`, refcounts move only for block positions after the
        leading ones every row shares (a permutation leaves their counts unchanged)."""
        self.check_usable()
        if any(not 0 <= i < self.num_rows for i in idx):
            raise ValueError(f"row indices {idx} out of range for a cache of {self.num_rows} rows.")
        with self.pool.lock:
            for rt in self._groups:
                c = rt.common_prefix(self._num_tokens) if common else 0
                new_rows = [rt.rows[i].copy() for i in idx]
                for row in new_rows:
                    self.pool.incref(row.after(c), rt.group)
                self.pool.free([b for row in rt.rows for b in row.after(c)], rt.group)
                rt.rows[:] = new_rows
                rt.select(idx)
        self._step = None
        self._after_change()

    def _match_batch(self, batch: int) -> None:
        """Make the cache hold `batch` rows: new empty rows, or `k` forks of each row when `batch = k * rows`."""
        if batch == self.num_rows:
            return
        if self._num_tokens == 0:
            self.reset()
            for rt in self._groups:
                rt.reset(batch)
        elif self.num_rows and batch % self.num_rows == 0:
            logger.debug("PagedCache: expanding %d rows to %d by forking", self.num_rows, batch)
            self.batch_repeat_interleave(batch // self.num_rows)
        else:
            raise ValueError(
                f"This PagedCache holds {self.num_rows} rows of {self._num_tokens} tokens but got a batch of "
                f"{batch}; the batch must equal the rows, or be a multiple of them (rows are then forked)."
            )
