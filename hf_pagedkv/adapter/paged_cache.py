"""`PagedCache`: the drop-in `transformers.Cache` that stores K/V in the refcounted blocks of a `BlockPool`."""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable

import torch

from hf_pagedkv._compat import Cache, DummyLayer, layer_plan, seq_length_layer_idx
from hf_pagedkv.adapter import prefix_cache
from hf_pagedkv.adapter.cache_retention import CacheRetention
from hf_pagedkv.adapter.cache_rows import CacheRows
from hf_pagedkv.adapter.evictor import Evictor
from hf_pagedkv.adapter.left_padding import LeftPadding
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.adapter.step_runner import StepRunner
from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.pool.group_quant import GroupQuant
from hf_pagedkv.retention.retention_stats import RetentionStats
from hf_pagedkv.storage.heap import trim_after_step

logger = logging.getLogger(__name__)


class PagedCache(Cache):
    """A paged, refcounted KV cache for `generate()` and `forward()`, exact against `DynamicCache`.

    Each batch row has a block table into a `BlockPool`; on each forward step the first layer's `update`
    extends every row's table (allocating at block boundaries, copy-on-write when the last block is shared)
    and each layer writes its new K/V into those slots. Beam reordering, `fork()`, `batch_select_indices` and
    `batch_repeat_interleave` move block ids and refcounts, never tensors. Identical rows of a prefill (those
    `num_return_sequences` and `num_beams` expand the prompt into) are detected from their K/V, layer by layer, and
    stored once; a cache pre-filled with `b` rows then given `k * b` rows expands itself by forking its rows. With a
    `BlockPool(prefix_caching=True)`, `from_prefix` and `publish` share prompt prefixes across requests.

    This class is the transformers face; the parts it owns do the work, and its collaborators use them: `rows`
    (`CacheRows`: the block tables, one `RowTables` per layer group, padding, prefix attach), `runner` (`StepRunner`:
    plans each step, makes room, writes and reads each layer's K/V; every `PagedLayer` talks to it) and `retention`
    (`CacheRetention`, or None: evictions, and KVzip's context scoring, which `hf_pagedkv.compress_context` runs).

    Args:
        config (`PretrainedConfig`, *optional*): the model config; builds the layers up front with their
            sliding windows (like `DynamicCache(config=...)`) and lets `max_memory` size the pool.
        pool (`BlockPool`, *optional*): a pool to share with other caches of the same model; a new growable
            pool by default.
        debug (`bool`, *optional*, defaults to `False`): check `pool.check_invariants()` after every step and
            poison freed blocks with NaN, so a stale read shows up at once.
        retention (`RetentionPolicy` or `str`, *optional*): evict tokens before each forward step and give their
            blocks back (`SinkWindow`, `KeyNorm`, `KeyDiff`, `SnapKV`, `PyramidKV`, `KVzip` in `hf_pagedkv.retention`,
            or a spec such as ``"sink_window:4:1024"``, parsed as `hf-pagedkv generate --retention` parses it;
            `SnapKV`, `PyramidKV` and `KVzip` need ``attn_implementation="hf_pagedkv"``, `KVzip` compresses only
            through `hf_pagedkv.compress_context`); `get_seq_length()` counts every token seen, `retention_stats()`
            those held. A tiered policy (`PyramidKV`) gives each tier of full-attention layers a layer group.
        pool_settings: the new pool's settings, given to `BlockPool` as they are: `block_size` (16, 32 when
            quantized), `num_blocks` or `max_memory` (which needs `config` too: the budget is divided over the
            layers), `quant` (``"k8v4"``, ``QuantConfig(key_bits=8, value_bits=4)``: the last, partial block of each
            row stays in full precision; a dict ``{"sliding": None, "full": "k4v4"}`` per kind of layer group),
            `prefix_caching`, `host_memory`, ... With `pool`, only its own
            `block_size` and `quant` are accepted.

    Raises:
        ValueError: `pool` not a `BlockPool`; a pool setting with `pool` (but its own `block_size` or `quant`), or
            one `BlockPool` refuses; `max_memory` without `config`; `debug` not a bool; `config` not a transformers
            config; a layer type it does not store (by name); at the first `update`, a passed
            `BlockPool(max_memory=...)` not sized yet and no `config`; `retention` not a policy, `KVzip` with
            sliding-window layers, a tiered one without `config` or whose tiers the model's layers do not fit.
        TypeError: a keyword that is no `BlockPool` setting.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> cache = PagedCache()
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    >>> cache.pool.stats().bytes_in_use     # bytes of the blocks this cache holds
    >>> cache.release()                     # or use `with PagedCache() as cache:`
    ```
    """

    def __init__(self, *, config=None, pool: BlockPool | None = None, debug: bool = False, retention=None,
                 **pool_settings) -> None:
        if not isinstance(debug, bool):
            raise ValueError(f"`debug` must be True or False, got {debug!r}.")
        pool = _pool_for(pool, debug, config, pool_settings)
        evictor = None if retention is None else Evictor(retention)  # parses a spec; raises ValueError for neither
        plan = [] if config is None else layer_plan(config)  # raises ValueError for what is not a config
        if debug:
            pool.debug = True
        self.pool = pool  # the BlockPool holding this cache's blocks; fixed
        self.block_size = pool.block_size  # tokens per block; fixed
        self.debug = debug  # check invariants after every step; fixed
        self.seq_id = pool._register_owner()  # this cache's token in the pool's registry; names it in the event log
        self._finalizer = weakref.finalize(self, pool.owners.release, self.seq_id)  # frees blocks if never released
        # `hf_pagedkv.generate(..., swap_on_exhaustion=True)` may swap this cache out while it is idle
        pool.owners.set_swapper(self.seq_id, weakref.WeakMethod(self.offload))
        self.rows = CacheRows(pool, self.seq_id)  # the rows' block tables, per layer group; fixed
        layers = []  # the model's layers, built below; the runner runs the list `Cache` keeps
        self.runner = StepRunner(self.rows, layers, debug=debug, config=config, num_layers=len(plan) or None,
                                 evictor=evictor)  # runs the forward steps; fixed
        layers += _model_layers(config, plan, evictor and evictor.policy, self.rows, self.runner)
        super().__init__(layers=layers)
        self.runner.layers = self.layers  # (the list itself: the layers `update` appends are run too)

    # -- transformers entry points -----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new K/V of layer `layer_idx` and return the K/V attention reads (`PagedLayer.update`):
        `key_states`, `value_states` `[batch, num_kv_heads, num_new_tokens, head_dim]` in, keys and values
        `[batch, num_kv_heads, seq_len, head_dim]` out."""
        if layer_idx < 0 or (self.runner.num_layers is not None and layer_idx >= len(self.layers)):
            raise IndexError(f"layer_idx={layer_idx} is out of range: this PagedCache was built for "
                             f"{counted(len(self.layers), 'layer')} (config=).")
        while len(self.layers) <= layer_idx:  # a cache built without config: full-attention layers, as DynamicCache
            self.layers.append(PagedLayer(self.runner, len(self.layers), group=self.rows.tables_for(None).group))
        out = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        trim_after_step(key_states.shape[-2], key_states.device)  # the previous layer's temporaries are freed
        retention = self.runner.retention
        if retention is not None and not self.layers[layer_idx].is_sliding:  # a query-aware policy asks
            retention.offer_queries(out[0], layer_idx)  # this full-attention layer's attention for its queries
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen per row (layer `layer_idx`): cached ones, plus those a retention policy evicted; for a
        `DummyLayer` 0, the first layer with attention (`_compat.seq_length_layer_idx`). Raises `ValueError` for a
        `layer_idx` other than 0 that names a layer without attention, `CacheReleasedError` after `release()`."""
        self.rows.check_not_released()  # (0 would let a forward on a released cache start over instead of failing)
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[seq_length_layer_idx(self.layers, layer_idx)].get_seq_length()

    def activate_past_recording(self, **kwargs) -> None:
        """Nothing to switch on: before drafting tokens it may take back, `generate` calls this; every layer group
        keeps the last step's tokens until the next step, so `crop` can take them back. Takes any keyword
        (`_compat.PAST_RECORDING_KWARGS`: transformers 5.25's ``recurrent_states_to_keep``)."""

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Declare the left padding of the prompt this (empty) cache is about to store, so that padding costs
        nothing: each whole block of a row's leading padding names the pool's one shared pad block (zeros, never
        written; `BlockGroup.set_pad_block`) instead of a block of its own. `generate()` gives the mask to the
        model, not to the cache, so pass it here first. Outputs are unchanged (see `LeftPadding`); padding is still
        counted by `get_seq_length()` and never published. It applies until the coming steps covered the padding,
        and is forgotten by `reset()`, `crop()` and row selections; with a `retention` policy it has no effect.

        Args:
            attention_mask (`torch.Tensor` of shape `[batch, seq_len]`): the mask given to `generate`, 1 (or True)
                for real tokens, 0 for left padding.

        Raises:
            ValueError: the mask is not 2-D, not left padding (0s then 1s in each row), or has a row without a
                real token; the cache already holds tokens (nothing changed then). At the prefill (by its first
                step, nothing stored): more tokens per row than the mask's columns (NOTE: a first step with fewer
                tokens is read as a chunk of a chunked prefill: pass the mask of the very prompt).
            CacheReleasedError: the cache was released.

        Example:

        ```python
        >>> cache = PagedCache(config=model.config)
        >>> cache.set_padding(attention_mask)
        >>> out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=20)
        ```
        """
        self.rows.check_usable()
        padding = LeftPadding.from_mask(attention_mask)  # raises ValueError
        if self.rows.num_tokens:
            raise ValueError(f"set_padding: this PagedCache already holds {counted(self.rows.num_tokens, 'token')} "
                             "per row; declare the padding of a prompt before its prefill, on an empty cache (or "
                             "reset() it first).")
        if self.retention is not None:
            logger.debug("PagedCache.set_padding: ignored with a retention policy (padding is stored)")
            return
        self.rows.padding = padding if padding.num_tokens else None

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of layer `layer_idx` for a step of `query_length` tokens (see
        `PagedLayer.get_mask_sizes`). With a retention policy, the step's eviction happens here, between steps
        (`CacheRetention.mask_sizes`)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        sizes = None if self.retention is None else self.retention.mask_sizes(query_length, layer)
        return super().get_mask_sizes(query_length, layer_idx) if sizes is None else sizes

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens from every row (a negative int, as `DynamicCache`): blocks
        past ``ceil(new_len / block_size)`` are freed; a shared last block is kept and copied on the next write.

        Raises:
            ValueError: `tokens_to_remove` is not an int or is positive, or reaches before what sliding-window
                layers (or a retention policy's last eviction) still hold.
            CacheReleasedError: the cache was released.
        """
        self.runner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes a copy of row `beam_idx[i]` (`beam_idx` may also have another length, as
        with `DynamicCache`). Moves block ids and refcounts, not tensors. Raises `ValueError` for an index out of
        range, `CacheReleasedError` after `release()` (even for an index that would change nothing)."""
        self.runner.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (refcounts follow)."""
        self.runner.select(torch.as_tensor(indices).reshape(-1).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times, sharing its blocks (a fork per copy).

        Raises:
            ValueError: `repeats` is not a non-negative int (as `DynamicCache`).
        """
        self.runner.repeat_rows(repeats)

    def reset(self) -> None:
        """Free every block this cache holds; the cache stays usable (empty); a no-op on a released cache. Every
        reference is dropped before the first call that may fail (releasing the freed blocks' storage)."""
        self.runner.reset()

    # -- hf_pagedkv API -----------------------------------------------------------------------------------------
    def fork(self) -> PagedCache:
        """A new cache holding the same tokens, sharing every block (copy-on-write); O(blocks), no tensor copy.

        `copy.deepcopy(cache)` and `copy.copy(cache)` fork too, so transformers' "re-use a prompt cache" recipe
        (``copy.deepcopy(prompt_cache)`` per question) costs no tensor copy. Release each fork when done.

        Raises:
            CacheReleasedError: this cache was released.
        """
        self.rows.check_usable()
        other = PagedCache(pool=self.pool, debug=self.debug)
        self.runner.copy_into(other.runner)
        return other

    @classmethod
    def from_prefix(cls, pool: BlockPool, input_ids, model=None, **kwargs) -> PagedCache:
        """A cache attached to the longest cached full-block prefix of `input_ids` in `pool`: one row of
        ``hit_blocks * block_size`` tokens.

        At least one token is always left to compute (the model needs it to produce logits): a prompt of exactly
        ``k * block_size`` tokens hits at most ``k - 1`` blocks. Pass the whole prompt to `model.generate` (or
        `model(...)` the tokens from `cache.get_seq_length()` on): transformers skips the cached part.

        Args:
            pool (`BlockPool`): a pool created with `prefix_caching=True`.
            input_ids (`torch.LongTensor` of shape `[1, seq_len]` or `[seq_len]`, or a list of ints): the prompt,
                without padding.
            model (`PreTrainedModel`, *optional*): the model that will run; its weights' fingerprint keys the index
                (so two models never share blocks) and its config builds the layers. Without it, pass `config=`,
                which then alone identifies the model (share the pool with no other model of the same config).
            kwargs: passed to `PagedCache` (`config`, `debug`).

        Raises:
            ValueError: the pool has no prefix caching; neither `model` nor `config`; `input_ids` not one row, or
                empty.

        Example:

        ```python
        >>> pool = BlockPool(prefix_caching=True)
        >>> cache = PagedCache.from_prefix(pool, input_ids, model=model)
        >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
        >>> cache.publish(out)      # later requests sharing this prefix skip it
        >>> cache.release()
        ```
        """
        if not getattr(pool, "prefix_caching", False):
            raise ValueError("from_prefix needs a pool created with BlockPool(prefix_caching=True).")
        if model is not None:
            kwargs.setdefault("config", model.config)
        if kwargs.get("config") is None:
            raise ValueError("from_prefix needs `model=` (or `config=`) to build the cache's layers up front.")
        ids = prefix_cache.one_prompt(input_ids, "PagedCache.from_prefix")
        cache = cls(pool=pool, **kwargs)
        try:  # all or nothing: on an error or interrupt the cache is released and every reference dropped
            cache.rows.prefix_key = prefix_cache.prefix_key(pool, model, kwargs["config"])
            cache.runner.attach_prefix(ids)
        except BaseException:
            cache.release()
            raise
        return cache

    def publish(self, input_ids, model=None) -> int:
        """Publish this cache's full blocks in the pool's prefix index, so later requests can attach to them;
        returns the number of blocks newly published.

        Row `r` must hold the K/V of ``input_ids[r][:n]`` (no padding), e.g. the prompt, or the sequences
        `generate` returned (the cache holds all but their last token). A single row of ids with a cache of
        several rows (beams, `num_return_sequences`) publishes row 0. Only blocks whose tokens every layer has
        written are published, so an exception in the middle of a forward pass publishes nothing half-written.

        Args:
            input_ids (`torch.LongTensor` of shape `[rows, seq_len]` or `[seq_len]`, or lists of ints).
            model (`PreTrainedModel`, *optional*): for a cache not made by `from_prefix`, the model that filled it.

        Raises:
            ValueError: the pool has no prefix caching; the cache was not built with a config (its layer count is
                unknown); the number of rows does not match; a block already published for other tokens.
        """
        return self.runner.publish(input_ids, model)

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(cache)`: a fork, as independent as a deep copy (shared blocks are copied before a write);
        copying the pool itself would give a second pool per copy."""
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
        if self.rows.released:
            return
        try:
            self.reset()  # raises, if at all, after the rows are empty and their references dropped
        finally:
            self._finalizer.detach()
            self.pool.owners.unregister(self.seq_id)  # the rows are empty now
            self.rows.released = True

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def num_rows(self) -> int:
        """Batch rows this cache holds (each has one block table per layer group)."""
        return self.rows.num_rows

    @property
    def num_layer_groups(self) -> int:
        """Sets of block tables this cache holds: one per layer group (full attention, each sliding window) and
        retention tier (`PyramidKV`; one per layer for `KVzip(scoring="global")`); 0 before the first step."""
        return len(self.rows.groups)

    @property
    def last_step_tokens(self) -> int:
        """New tokens per row of the last forward step (a sliding group holds them too)."""
        return self.runner.last_step_tokens

    @property
    def on_exhausted(self) -> Callable[[PoolExhaustedError], bool] | None:
        """Called with the `PoolExhaustedError` when a step's blocks do not fit; True: it made room (the step is
        planned again), False: raise; None (default): raise. `hf_pagedkv.generate(swap_on_exhaustion=True)` sets it."""
        return self.runner.on_exhausted

    @on_exhausted.setter
    def on_exhausted(self, handler: Callable[[PoolExhaustedError], bool] | None) -> None:
        self.runner.on_exhausted = handler

    @property
    def retention(self) -> CacheRetention | None:
        """The retention policy at work (`CacheRetention`), or None without one."""
        return self.runner.retention

    @property
    def retention_policy(self):
        """The cache's `RetentionPolicy`, or None."""
        return None if self.retention is None else self.retention.policy

    def retention_stats(self) -> RetentionStats:
        """Tokens seen vs held per row, and what the retention policy evicted (`RetentionStats`)."""
        if self.retention is None:
            return RetentionStats(None, self.rows.num_tokens, self.rows.num_tokens, 0, 0)
        return self.retention.stats()

    def block_tables(self, window: int | None = ...) -> list[list[int]]:
        """A copy of each row's held block ids, in token order, in one layer group: the first (full attention when
        the model has it) by default, or the group of layers with sliding window `window` (`None`: full)."""
        return self.rows.block_tables(window)

    def check_invariants(self) -> None:
        """Check the pool's and this cache's invariants (`StepRunner.check_invariants`). Raises `InvariantError`."""
        self.runner.check_invariants()

    def __repr__(self) -> str:
        quant = f", quant={self.pool.quant.name}" if self.pool.quant.is_quantized else ""
        quant += f", retention={self.retention.policy!r}" if self.retention is not None else ""
        return (f"PagedCache(rows={self.num_rows}, tokens={self.rows.num_tokens}, block_size={self.block_size}, "
                f"layers={len(self.layers)}{quant}{', released' if self.rows.released else ''})")

    # -- host tier: swap the whole cache out and in (adapter/offload.py) ----------------------------------------
    @property
    def is_offloaded(self) -> bool:
        """Whether this cache's blocks are in the pool's host tier (`offload()`), not on the device."""
        return self.rows.offloaded is not None

    def offload(self, layer_idx: int | None = None, only_non_sliding: bool = True) -> None:
        """Move this cache to the pool's host tier (`BlockPool(host_memory=...)`) and free its device blocks, so a
        server can preempt a long request instead of losing it; `prefetch()` brings it back and generation continues
        exactly (see `adapter/offload.py`). Until then it cannot run a step; `release()` frees its host blocks. All
        or nothing, and one decision with any other thread's offload of this cache: the second one raises.

        Raises:
            ValueError: a `layer_idx` (only whole caches move); the pool has no host tier.
            PoolExhaustedError: the host tier is full (nothing changed).
            CacheReleasedError, CacheOffloadedError: the cache was released, or is offloaded already (by this
                thread or another; nothing changed).
        """
        if layer_idx is not None:
            raise ValueError(f"offload(layer_idx={layer_idx}): a PagedCache moves whole, with all its layers "
                             "(call cache.offload()).")
        self.rows.offload()

    def prefetch(self, layer_idx: int | None = None, only_non_sliding: bool = True) -> None:
        """Bring an offloaded cache back to the device (new block ids, the same K/V); a no-op when not offloaded.
        All or nothing (the cache stays offloaded on an error).

        Raises:
            ValueError: a `layer_idx` (only whole caches move).
            PoolExhaustedError: too few free device blocks (the cache stays offloaded; nothing changed).
        """
        if layer_idx is not None:
            raise ValueError(f"prefetch(layer_idx={layer_idx}): a PagedCache moves whole (call cache.prefetch()).")
        if self.rows.prefetch():
            self.runner.after_change()


def _pool_for(pool: BlockPool | None, debug: bool, config, settings: dict) -> BlockPool:
    """The cache's pool: a new `BlockPool(**settings)`, or `pool` when it agrees with `settings`.

    Raises:
        ValueError: `pool` not a `BlockPool`; settings of a new pool with `pool`; `max_memory` without `config`.
        TypeError: a keyword that is no `BlockPool` setting.
    """
    known = set(inspect.signature(BlockPool).parameters) - {"debug"} if settings else set()
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"PagedCache got {', '.join(map(repr, unknown))}: neither a PagedCache argument (config, "
                        f"pool, debug, retention) nor a BlockPool setting ({', '.join(sorted(known))}).")
    if pool is None:
        max_memory = settings.get("max_memory")
        if max_memory is not None and config is None:  # (said here, not at the first forward)
            raise ValueError(f"PagedCache(max_memory={max_memory!r}) divides the budget over the model's layers, so "
                             "it needs their number: build it as PagedCache(config=model.config, "
                             f"max_memory={max_memory!r}), or size the pool in blocks with num_blocks= instead.")
        return BlockPool(debug=debug, **settings)
    if not isinstance(pool, BlockPool):
        raise ValueError(f"`pool` must be a hf_pagedkv.BlockPool, got {type(pool).__name__}.")
    others = sorted(name for name, value in settings.items()
                    if value is not None and name not in ("block_size", "quant"))
    if others:
        raise ValueError(f"`{'`/`'.join(others)}` configure a new pool; set them on the BlockPool you pass.")
    block_size, quant = settings.get("block_size"), settings.get("quant")
    if block_size is not None and block_size != pool.block_size:
        raise ValueError(f"block_size={block_size} differs from the pool's block_size={pool.block_size}.")
    if quant is not None and (quant := GroupQuant.resolve(quant).pool_quant) != pool.quant:
        raise ValueError(f"quant={quant.name} ({quant}) differs from the pool's quant={pool.quant.name} "
                         f"({pool.quant}); the quantization is a property of the pool's storage: pass "
                         "quant=None to use the pool's, or create a BlockPool(quant=...) for this setting.")
    return pool


def _model_layers(config, plan: list, retention, rows: CacheRows, runner: StepRunner) -> list:
    """The layers of a model whose `layer_plan` is `plan` (`(kind, sliding window)` per layer), each in its layer
    group: a `DummyLayer` where the model holds no attention.

    Raises:
        ValueError: a layer group of another model in a shared pool; a sliding-window layer with a `retention`
            policy that reconstructs (`KVzip`); a tiered `retention` without `config`.
    """
    if config is None and retention is not None and retention.is_tiered():
        raise ValueError(f"retention={retention!r} splits the model's full-attention layers into tiers (layer "
                         "groups of their own), so the cache must know them up front: build it with "
                         "config=model.config.")
    full = [idx for idx, (kind, window) in enumerate(plan) if kind != "dummy" and window is None]
    # a tiered policy (PyramidKV, KVzip's global budgets) gives each tier of full-attention layers its own layer group
    tier_of = {} if retention is None else dict(zip(full, retention.layer_tiers(len(full))))
    layers = []
    for idx, (kind, window) in enumerate(plan):
        if kind == "dummy":
            layers.append(DummyLayer())
            continue
        if window is not None and retention is not None and retention.reconstructs:
            # NOTE: the reconstruction pass (as long as the context) moves the sliding windows past the
            # context, and the crop after it cannot bring their blocks back
            raise ValueError(f"retention={retention!r} is not supported yet on models with "
                             f"sliding-window layers (window {window}): its reconstruction pass would move "
                             "their windows. Use SnapKV, PyramidKV, KeyDiff, KeyNorm or SinkWindow there.")
        rt = rows.tables_for(window, tier_of.get(idx, 0))
        with rows.pool.lock:  # a shared pool's layers: same groups (raises ValueError)
            rows.pool.layers.check_group(idx, rt.group)
        layers.append(PagedLayer(runner, idx, window, group=rt.group))
    return layers
