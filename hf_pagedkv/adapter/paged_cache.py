"""`PagedCache`: the drop-in `transformers.Cache` that stores K/V in the refcounted blocks of a `BlockPool`."""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable

import torch

from hf_pagedkv._compat import Cache, DummyLayer, layer_plan, seq_length_layer_idx
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.pool.group_quant import GroupQuant
from hf_pagedkv.blocks.block_table import BlockTable, num_blocks_for
from hf_pagedkv.config import QuantConfig, check_positive_int
from hf_pagedkv.errors import CacheOffloadedError, CacheReleasedError, InvariantError, PoolExhaustedError
from hf_pagedkv.adapter.in_place_reads import InPlaceReads
from hf_pagedkv.adapter.left_padding import LeftPadding
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.adapter import prefix_cache
from hf_pagedkv.adapter.grad import attach_step_grad, needs_grad
from hf_pagedkv.adapter.offload import drop_device_blocks, offload_cache, prefetch_cache
from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.adapter.step_plan import StepPlan
from hf_pagedkv.adapter.step_planner import StepPlanner
from hf_pagedkv.adapter.step_tensors import StepTensors
from hf_pagedkv.errors import EMPTY_PROMPT
from hf_pagedkv.adapter.evictor import Evictor
from hf_pagedkv.retention.retention_stats import RetentionStats
from hf_pagedkv.storage.heap import TRIM_MIN_TOKENS, trim_heap
from hf_pagedkv.storage.read_request import ReadRequest

logger = logging.getLogger(__name__)


class PagedCache(Cache):
    """A paged, refcounted KV cache for `generate()` and `forward()`, exact against `DynamicCache`.

    Each batch row has a block table into a `BlockPool`; on each forward step the first layer's `update`
    extends every row's table (allocating at block boundaries, copy-on-write when the last block is shared)
    and each layer writes its new K/V into those slots. Beam reordering, `fork()`, `batch_select_indices` and
    `batch_repeat_interleave` move block ids and refcounts, never tensors. At a prefill, rows whose tokens are
    identical (the rows `num_return_sequences` and `num_beams` expand the prompt into) are detected from their
    K/V, checked layer by layer, and stored once. A cache pre-filled with `b` rows that is then given `k * b`
    rows (for example `generate(num_beams=k)` after a prompt was cached) expands itself by forking its rows.
    With a `BlockPool(prefix_caching=True)`, `from_prefix` and `publish` share prompt prefixes across requests.
    `set_padding(attention_mask)` before a left-padded prefill makes whole blocks of padding name the pool's one pad
    block instead of blocks of their own.

    A forward step: the first layer to see tokens past the cache's length asks the `StepPlanner` to extend every
    row's table in every layer group (the only part that can fail, all or nothing); the planner returns an
    immutable `StepPlan`. When a fixed pool has too few blocks for it, `on_exhausted` (if set) may make room and the
    step is planned again, so the request goes on where it was. Every layer of the step then writes its K/V
    through its group's store (`prepare_write` / `write`) and reads its rows back (`read` with a `ReadRequest`).
    Under grad mode the rows read back are differentiable with respect to the step's own K/V (`grad.py`).

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
            ``QuantConfig(key_bits=8, value_bits=4)`` (see `QuantConfig`); ``"fp"`` for full precision; a dict
            ``{"sliding": None, "full": "k4v4"}`` per kind of layer group (`BlockPool`'s `quant`). `None`
            (default) means the pool's setting, full precision for a new pool. The last, partial block of each row
            stays in full precision; `layers[i].keys` / `.values` return de-quantized tensors.
        retention (`RetentionPolicy`, *optional*): evict tokens before each forward step and give their blocks
            back (`SinkWindow`, `KeyNorm`, `KeyDiff`, `SnapKV`, `PyramidKV`, `KVzip` in `hf_pagedkv.retention`;
            `SnapKV`, `PyramidKV` and `KVzip` need ``attn_implementation="hf_pagedkv"``, and `KVzip` compresses
            only through `hf_pagedkv.compress_context`); `get_seq_length()` keeps counting
            every token seen, `retention_stats()` says how many are held. Full-attention models only for now. A
            tiered policy (`PyramidKV`) splits the full-attention layers into layer groups of their own, one per
            tier (`RetentionPolicy.layer_tiers`), so each tier's budget frees its own blocks.

    Raises:
        ValueError: `block_size` not a positive int or different from the pool's; `pool` not a `BlockPool`;
            `num_blocks`/`max_memory` given with `pool`; `max_memory` without `config`; `quant` invalid or
            different from the pool's; `debug` not a bool; `config` not a transformers config; a layer type it does
            not store (by name); at the first `update`, a passed `BlockPool(max_memory=...)` not sized yet and no
            `config` (the number of layers is unknown);
            `retention` not a policy, or `KVzip` for a model with sliding-window layers; a tiered `retention`
            without `config`, or that the model's layers do not fit.

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
        quant: QuantConfig | str | dict | None = None,
        retention=None,
    ) -> None:
        if block_size is not None:
            check_positive_int("block_size", block_size)
        if not isinstance(debug, bool):
            raise ValueError(f"`debug` must be True or False, got {debug!r}.")
        if quant is not None:
            quant = GroupQuant.resolve(quant).pool_quant
        if pool is None and max_memory is not None and config is None:  # (said here, not at the first forward)
            raise ValueError(f"PagedCache(max_memory={max_memory!r}) divides the budget over the model's layers, so "
                             "it needs their number: build it as PagedCache(config=model.config, "
                             f"max_memory={max_memory!r}), or size the pool in blocks with num_blocks= instead.")
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
        self._planner = StepPlanner(pool)  # extends the tables at each step's first layer; fixed
        self._plan: StepPlan | None = None  # the current forward step, set by its first layer
        self._step_tensors: StepTensors | None = None  # the current step's index tensors, per group and device
        self._grad_history = False  # holds tokens written from K/V that required grad; cleared by reset()
        self._prefix_key: bytes | None = None  # model + format identity for the prefix index; set once
        self._publish_at_next_step: list[int] | None = None  # a prompt to publish before sliding groups free it
        self.last_step_tokens = 0  # new tokens per row of the last forward step (a sliding group holds them too)
        self._maybe_dups = False  # rows were just forked, so identical rows may be deduplicated next step
        # leading padding tokens per row of the coming prefill (`set_padding`), until its steps planned them; or None
        self._padding: LeftPadding | None = None
        self._evictor = None if retention is None else Evictor(retention)  # retention policy state, or None
        self._released = False
        # while offloaded: its blocks in the host tier (adapter/offload.py); read to decide and changed only under the
        # pool's lock, so the cache is offloaded once however many threads try
        self._offloaded: list | None = None
        # called with the `PoolExhaustedError` when a step's blocks do not fit; returns True when it made room (say,
        # by offloading idle caches: then the step is planned again), False to raise the error; None: raise it. Set
        # by the cache's user (`hf_pagedkv.generate(swap_on_exhaustion=True)` does)
        self.on_exhausted: Callable[[PoolExhaustedError], bool] | None = None
        self._owner = pool.register_owner()  # this cache's token in the pool's table registry
        self.seq_id = self._owner  # names this cache in the block event log
        self._finalizer = weakref.finalize(self, pool.release_owner, self._owner)  # frees blocks if never released
        # `hf_pagedkv.generate(..., swap_on_exhaustion=True)` may swap this cache out while it is idle
        pool.set_owner_swapper(self._owner, weakref.WeakMethod(self.offload))
        layers = []
        if config is None and retention is not None and retention.is_tiered():
            raise ValueError(f"retention={retention!r} splits the model's full-attention layers into tiers (layer "
                             "groups of their own), so the cache must know them up front: build it with "
                             "config=model.config.")
        if config is not None:
            plan = layer_plan(config)
            full = [idx for idx, (kind, window) in enumerate(plan) if kind != "dummy" and window is None]
            # a tiered policy (PyramidKV, KVzip's global budgets) gives each tier of full-attention layers its own layer group
            tier_of = {} if retention is None else dict(zip(full, retention.layer_tiers(len(full))))
            for idx, (kind, window) in enumerate(plan):
                if kind == "dummy":
                    layers.append(DummyLayer())
                else:
                    rt = self._tables_for(window, tier_of.get(idx, 0))
                    pool.check_layer_group(idx, rt.group)  # a shared pool's layers: same groups (raises ValueError)
                    layers.append(PagedLayer(self, idx, window, group=rt.group))
        super().__init__(layers=layers)
        self._num_layers = len(layers) or None  # known when built from a config (sizes max_memory pools)
        # which step's attention reads the pool in place (hf_pagedkv.attention)
        self._in_place = InPlaceReads(config, self._num_layers)

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
        out = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] >= TRIM_MIN_TOKENS and key_states.device.type == "cpu":
            trim_heap()  # the previous layer's temporaries are freed: give their pages back (storage/heap.py)
        if self._evictor is not None and not self.layers[layer_idx].is_sliding:  # a query-aware policy asks
            self._evictor.offer_queries(out[0], layer_idx)  # this full-attention layer's attention for its queries
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen per row (layer `layer_idx`): cached ones, plus those a retention policy evicted. When layer 0
        holds no attention (a `DummyLayer`), the first layer that does answers, on every supported transformers
        (`_compat.seq_length_layer_idx`). 0 after `release()` (a released cache holds nothing; its next `update`
        raises `CacheReleasedError`).

        Raises:
            ValueError: `layer_idx` is not 0 and names a layer without attention.
        """
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[seq_length_layer_idx(self.layers, layer_idx)].get_seq_length()

    def activate_past_recording(self, **kwargs) -> None:
        """Nothing to switch on: `generate` calls this before it drafts tokens it may take back (assisted and
        prompt-lookup decoding), and every layer group already keeps the last step's tokens until the next step starts,
        so `crop` can take them back. Takes any keyword: transformers 5.25 passes ``recurrent_states_to_keep``
        (`_compat.PAST_RECORDING_KWARGS`), for the recurrent states of linear-attention layers, which a PagedCache
        does not hold.
        """

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Declare the left padding of the prompt this (empty) cache is about to store, so that padding costs
        nothing: each whole block of a row's leading padding names the pool's one shared pad block (zeros, never
        written; `BlockPool.ensure_pad_block`) instead of a block of its own. A left-padded batch then stores its
        real tokens plus at most one block per row (the block of a row's first real token, which also holds some
        padding, is stored normally).

        `generate()` gives the attention mask to the model, not to the cache, so pass it here first. Outputs are
        unchanged (bit-identical to `DynamicCache` in fp32: attention masks padding, and zeros keep the masked
        softmax exact; `layers[i].keys` read zeros at those positions where `DynamicCache` holds the model's pad
        K/V; with ``attn_implementation="eager"``, whose mask is a finite minimum, only the logits at padding
        positions, which nothing reads, may differ); `get_seq_length()` still counts padding, as `DynamicCache` does; padding is never published to the
        prefix index (`publish` skips rows that hold it). Rows expanded by `generate` (`num_return_sequences`,
        `num_beams`) take the padding of the row they copy. It applies to the coming forward steps until they
        covered the padding, and is forgotten by `reset()`, `crop()` and row selections. With a `retention` policy
        it has no effect (padding is stored, as before: policies pick kept tokens from what is stored).

        Args:
            attention_mask (`torch.Tensor` of shape `[batch, seq_len]`): the mask given to `generate`, 1 (or True)
                for real tokens, 0 for left padding.

        Raises:
            ValueError: the mask is not 2-D, not left padding (0s then 1s in each row), or has a row without a
                real token; the cache already holds tokens (nothing changed then). At the prefill (raised by its first
                step, nothing stored): more tokens per row than the mask's columns. NOTE: a first step with fewer
                tokens is read as the first chunk of a chunked prefill, so a mask of another, longer prompt is not
                caught: pass the mask of the very prompt.
            CacheReleasedError: the cache was released.

        Example:

        ```python
        >>> cache = PagedCache(config=model.config)
        >>> cache.set_padding(attention_mask)
        >>> out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=20)
        ```
        """
        self.check_usable()
        padding = LeftPadding.from_mask(attention_mask)  # raises ValueError
        if self._num_tokens:
            raise ValueError(f"set_padding: this PagedCache already holds {self._num_tokens} tokens per row; declare "
                             "the padding of a prompt before its prefill, on an empty cache (or reset() it first).")
        if self._evictor is not None:
            logger.debug("PagedCache.set_padding: ignored with a retention policy (padding is stored)")
            return
        self._padding = padding if padding.num_tokens else None

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of layer `layer_idx` for a step of `query_length` tokens (see
        `PagedLayer.get_mask_sizes`). With a retention policy, the step's eviction happens here, between steps:
        transformers builds the mask from these sizes before any layer runs, so they must describe what stays."""
        layers = self._paged_layers()
        if self._evictor is not None and query_length and all(layer.num_tokens == self._num_tokens for layer in layers):
            with self.pool.lock:
                self._evictor.evict(self, query_length)
            self._after_change()
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        tiers = self.retention_tables()
        if isinstance(layer, PagedLayer) and not layer.is_sliding and len(tiers) > 1 and layer.is_initialized:
            # NOTE: transformers builds one mask for every full-attention layer from these sizes, so they describe
            # the retention tier that holds the most (each tier holds the last positions of the same span; the
            # "hf_pagedkv" attention reads the mask's last columns for a tier holding fewer)
            lo = min(rt.window_start(layer.num_tokens) for rt in tiers)
            return layer.num_tokens - lo + query_length, layer.num_evicted + lo
        return super().get_mask_sizes(query_length, layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens from every row (a negative int, as `DynamicCache`).

        Blocks past ``ceil(new_len / block_size)`` are freed; a shared last block is kept and copied on the next
        write.

        Raises:
            ValueError: `tokens_to_remove` is not an int or is positive, or reaches before what sliding-window
                layers still hold.
            CacheReleasedError: the cache was released.
        """
        self.check_usable()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"crop({tokens_to_remove!r}): pass an int, the negative number of tokens to remove "
                             "(as with DynamicCache).")
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as with DynamicCache."
            )
        if tokens_to_remove == 0 or self._num_tokens == 0:
            return
        self._padding = None
        new_len = max(0, self._num_tokens + tokens_to_remove)
        if self._evictor is not None:  # retention: evicted tokens cannot come back
            self._evictor.check_crop(new_len)
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
        self._end_step()
        self._after_change()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes a copy of row `beam_idx[i]` (`beam_idx` may also have another length, as
        with `DynamicCache`). Moves block ids and refcounts, not tensors.

        Raises:
            ValueError: an index out of range.
            CacheReleasedError: the cache was released (even for an index that would change nothing).
        """
        self.check_usable()
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
        """Free every block this cache holds; the cache stays usable (empty). On a released cache, a no-op (it holds
        nothing, and stays released). Every table and reference is dropped before the first call that may fail
        (releasing the freed blocks' storage), which then raises after it."""
        self._num_tokens = 0
        self._padding = None
        self._end_step()
        self._grad_history = False
        for layer in self._paged_layers():
            layer.num_tokens = layer.num_evicted = 0
        if self._evictor is not None:
            self._evictor.reset()
        with self.pool.lock:
            if self._offloaded is not None:  # its blocks are in the host tier
                self.pool.host.release(self._owner)
                self._offloaded = None
            held = {rt.group: [b for row in rt.rows for b in row.blocks] for rt in self._groups}
            for rt in self._groups:
                rt.reset()  # plain Python
            self.pool.free_groups(held)

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
        other._evictor = None if self._evictor is None else self._evictor.copy()
        with self.pool.lock:
            for mine, rt in [(other._tables_for(rt.window, rt.tier), rt) for rt in self._groups]:  # groups, then rows
                for row in rt.rows:
                    self.pool.incref(row.blocks, rt.group)
                    mine.rows.append(row.copy())
                mine.table = rt.table.clone()
        other._num_tokens = self._num_tokens
        other._after_change()
        return other

    @classmethod
    def from_prefix(cls, pool: BlockPool, input_ids, model=None, **kwargs) -> PagedCache:
        """A cache attached to the longest cached full-block prefix of `input_ids` in `pool`.

        At least one token is always left to compute (the model needs it to produce logits): a prompt of exactly
        ``k * block_size`` tokens hits at most ``k - 1`` blocks. Pass the whole prompt to `model.generate` (or
        `model(...)` the tokens from `cache.get_seq_length()` on): transformers skips the cached part.

        Args:
            pool (`BlockPool`): a pool created with `prefix_caching=True`.
            input_ids (`torch.LongTensor` of shape `[1, seq_len]` or `[seq_len]`, or a list of ints): the prompt,
                without padding.
            model (`PreTrainedModel`, *optional*): the model that will run; its weights' fingerprint keys the index
                (so two models never share blocks) and its config builds the layers. Without it, pass `config=`;
                the config alone then identifies the model, so do not share the pool with another model that has
                the same config.
            kwargs: passed to `PagedCache` (`config`, `debug`).

        Returns:
            `PagedCache` holding one row of ``hit_blocks * block_size`` tokens.

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
        if getattr(pool, "prefix_index", None) is None:
            raise ValueError("from_prefix needs a pool created with BlockPool(prefix_caching=True).")
        if model is not None:
            kwargs.setdefault("config", model.config)
        if kwargs.get("config") is None:
            raise ValueError("from_prefix needs `model=` (or `config=`) to build the cache's layers up front.")
        rows = prefix_cache.token_rows(input_ids)
        if not rows or rows == [[]]:
            raise ValueError(f"PagedCache.from_prefix: {EMPTY_PROMPT}.")
        if len(rows) != 1:
            raise ValueError(f"from_prefix takes one non-empty prompt, got {len(rows)} rows; attach rows one by "
                             "one (hf_pagedkv.generate does).")
        ids = rows[0]
        cache = cls(pool=pool, **kwargs)
        try:  # all or nothing: on an error or interrupt the cache is released and every reference dropped
            cache._prefix_key = prefix_cache.prefix_key(pool, model, kwargs["config"])
            hashes = prefix_cache.hash_blocks(ids[: len(ids) - 1], pool.block_size, cache._prefix_key)  # >= 1 left
            with pool.lock:  # references and the table that names them appear together (invariant 2)
                if pool.host is not None:  # prefix blocks in the host tier are copied back before any read
                    pool.host.promote(hashes, [rt.group for rt in cache._groups])
                hit = prefix_cache.hit_length(pool, cache._groups, hashes)
                held = {}
                try:
                    for k, rt in enumerate(cache._groups):  # the first group counts the lookup (one per request)
                        lo = rt.droppable(hit * pool.block_size)
                        held[rt.group] = (lo, pool.acquire_prefix(hashes[lo:hit], len(ids), group=rt.group,
                                                                  count=k == 0))
                    cache._attach(hit, held)  # all or nothing
                except BaseException:  # the references taken, in no table
                    pool.free_groups({group: blocks for group, (_, blocks) in held.items()})
                    raise
        except BaseException:
            cache.release()
            raise
        cache._after_change()
        if any(rt.window is not None for rt in cache._groups):
            # NOTE: a sliding group frees the prompt's early blocks as soon as decoding starts, long before a
            # caller publishes; so the prompt is published when the step after the prompt begins (`_begin_step`).
            cache._publish_at_next_step = ids
        return cache

    def publish(self, input_ids, model=None) -> int:
        """Publish this cache's full blocks in the pool's prefix index, so later requests can attach to them.

        Row `r` must hold the K/V of ``input_ids[r][:n]`` (no padding), e.g. the prompt, or the sequences
        `generate` returned (the cache holds all but their last token). A single row of ids with a cache of
        several rows (beams, `num_return_sequences`) publishes row 0. Only blocks whose tokens every layer has
        written are published, so an exception in the middle of a forward pass publishes nothing half-written.

        Args:
            input_ids (`torch.LongTensor` of shape `[rows, seq_len]` or `[seq_len]`, or lists of ints).
            model (`PreTrainedModel`, *optional*): for a cache not made by `from_prefix`, the model that filled it.

        Returns:
            `int`: blocks newly published.

        Raises:
            ValueError: the pool has no prefix caching; the cache was not built with a config (its layer count is
                unknown); the number of rows does not match; a block already published for other tokens.
        """
        self.check_usable()
        pool = self.pool
        if pool.prefix_index is None:
            raise ValueError("publish needs a pool created with BlockPool(prefix_caching=True).")
        if self._num_layers is None:
            raise ValueError("publish needs a cache built with config= (or by from_prefix), so it knows every "
                             "layer has written a block before publishing it.")
        if self._prefix_key is None:
            if model is None:
                raise ValueError("publish on a cache not made by from_prefix needs `model=` (the model that filled "
                                 "it) to key the prefix index.")
            self._prefix_key = prefix_cache.prefix_key(pool, model)
        pool.note_prefix_key(self._prefix_key)  # what save_prefix_cache records as the blocks' model key
        rows = prefix_cache.token_rows(input_ids)
        if len(rows) == 1 and self.num_rows > 1:
            rows = rows + [[]] * (self.num_rows - 1)  # row 0 holds the shared prompt
        if len(rows) != self.num_rows:
            raise ValueError(f"publish got {len(rows)} rows of ids for a cache of {self.num_rows} rows.")
        layers = self._paged_layers()
        written = min([layer.num_tokens for layer in layers] + [self._num_tokens]) if layers else 0
        intact = None if self._evictor is None else self._evictor.num_intact_blocks  # retention: later blocks differ
        return prefix_cache.publish_rows(pool, self._groups, rows, written, self._prefix_key, max_blocks=intact)

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
        try:
            self.reset()  # raises, if at all, after the rows are empty and their references dropped
        finally:
            self._finalizer.detach()
            self.pool.unregister_owner(self._owner)  # the rows are empty now
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
    def num_layer_groups(self) -> int:
        """Sets of block tables this cache holds: one per layer group (full attention, each sliding window) and
        retention tier (`PyramidKV`'s tiers; one per layer for `KVzip(layer_budgets="global")`); 0 before the first
        step. The pool's block counts are summed over them."""
        return len(self._groups)

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
        quant += f", retention={self._evictor.policy!r}" if self._evictor is not None else ""
        return (f"PagedCache(rows={self.num_rows}, tokens={self._num_tokens}, block_size={self.block_size}, "
                f"layers={len(self.layers)}{quant}{', released' if self._released else ''})")

    # -- host tier: swap the whole cache out and in (adapter/offload.py) ----------------------------------------
    @property
    def is_offloaded(self) -> bool:
        """Whether this cache's blocks are in the pool's host tier (`offload()`), not on the device."""
        return self._offloaded is not None

    def offload(self, layer_idx: int | None = None, only_non_sliding: bool = True) -> None:
        """Move this cache to the pool's host tier (`BlockPool(host_memory=...)`) and free its device blocks, so a
        server can preempt a long request instead of losing it; `prefetch()` brings it back and generation continues
        exactly. Blocks other caches share stay on the device for them (refcounts decide; see `adapter/offload.py`).
        Until `prefetch()`, the cache cannot run a step (`CacheOffloadedError`); `release()` frees its host blocks.
        All or nothing, an error or interrupt included: one raised before the move changed nothing, one raised while
        the freed device blocks' storage is released comes after the move is whole. One decision with any other
        offload of this cache (another thread's `generate(swap_on_exhaustion=True)` may swap an idle cache out): the
        second one raises.

        Raises:
            ValueError: a `layer_idx` (only whole caches move); the pool has no host tier.
            PoolExhaustedError: the host tier is full (nothing changed).
            CacheReleasedError, CacheOffloadedError: the cache was released, or is offloaded already (by this
                thread or another; nothing changed).
        """
        if layer_idx is not None:
            raise ValueError(f"offload(layer_idx={layer_idx}): a PagedCache moves whole, with all its layers "
                             "(call cache.offload()).")
        with self.pool.lock:  # the check and the move are one step for every thread (swaps run under this lock)
            if self._offloaded is not None and not self._released:
                raise CacheOffloadedError("offload(): this PagedCache is offloaded already (another thread's "
                                          "generate(swap_on_exhaustion=True) may have swapped it out while idle); "
                                          "cache.prefetch() brings it back.")
            self.check_usable()
            self._offloaded = offload_cache(self.pool, self._owner, self._groups)  # copied; device blocks held
            self._end_step()
            drop_device_blocks(self.pool, self._groups)  # bookkeeping first: an error after it leaves it done

    def prefetch(self, layer_idx: int | None = None, only_non_sliding: bool = True) -> None:
        """Bring an offloaded cache back to the device (new block ids, the same K/V); a no-op when not offloaded.

        All or nothing, an error or interrupt included (the cache stays offloaded then).

        Raises:
            ValueError: a `layer_idx` (only whole caches move).
            PoolExhaustedError: too few free device blocks (the cache stays offloaded; nothing changed).
        """

        if layer_idx is not None:
            raise ValueError(f"prefetch(layer_idx={layer_idx}): a PagedCache moves whole (call cache.prefetch()).")
        with self.pool.lock:  # one decision with any other offload or prefetch of this cache
            if self._released:
                raise CacheReleasedError("This PagedCache was released; create a new one.")
            if self._offloaded is None:
                return
            prefetch_cache(self.pool, self._owner, self._groups, self._offloaded)
            self._offloaded = None
            self.pool.touch_owner(self._owner)
        self._after_change()

    # -- internals: layers ----------------------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self._released:
            raise CacheReleasedError("This PagedCache was released; create a new one (or fork() before release()).")
        if self._offloaded is not None:
            raise CacheOffloadedError("This PagedCache is offloaded to the host tier; call cache.prefetch() before "
                                      "using it again.")

    def _paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def register_layer(self, layer: PagedLayer, spec: LayerSpec) -> None:
        self.pool.register_layer(layer.layer_idx, spec, self._num_layers, group=layer.group)

    def _tables_for(self, window: int | None, tier: int = 0) -> RowTables:
        """This cache's tables in the pool's layer group for `window` (and retention `tier`), created (and
        registered) on first use."""
        group = self.pool.group_for(window, tier)
        rt = self._by_group.get(group)
        if rt is None:
            # a released cache gave its owner token back: it registers no new rows (a cache released before its
            # first step, built without config, gets here at its first update)
            self.check_usable()
            if window is not None and self._evictor is not None and self._evictor.policy.reconstructs:
                # NOTE: the reconstruction pass (as long as the context) moves the sliding windows past the
                # context, and the crop after it cannot bring their blocks back
                raise ValueError(f"retention={self._evictor.policy!r} is not supported yet on models with "
                                 f"sliding-window layers (window {window}): its reconstruction pass would move "
                                 "their windows. Use SnapKV, PyramidKV, KeyDiff, KeyNorm or SinkWindow there.")
            if self._num_tokens:
                raise RuntimeError("A layer of a new layer group appeared after this PagedCache stored tokens; "
                                   "build the cache with config=model.config so every layer is known up front.")
            rt = RowTables(group, window, self.block_size, tier)
            rt.reset(self.num_rows)
            self.pool.add_rows(self._owner, group, rt.rows, mover=weakref.WeakMethod(self._blocks_moved))
            at = sum(other.window is None for other in self._groups) if window is None else len(self._groups)
            self._groups.insert(at, rt)  # full attention first (tiers in order)
            self._by_group[group] = rt
        return rt

    def _blocks_moved(self, group: int, mapping: dict[int, int]) -> Callable[[], None]:
        """`BlockPool.compact` moves blocks of `group` (`{old id: new id}`): build the renamed mirror of this cache's
        tables (may fail; nothing changed then) and return the function (plain Python) that renames the tables and
        swaps the mirror in. The current step's view base and slot tensors are stale then, so the next read
        recomputes them."""
        rename = self._by_group[group].renamed(mapping)

        def commit() -> None:
            rename()
            self._end_step()

        return commit

    @staticmethod
    def _clone_layer(layer: PagedLayer, owner: PagedCache) -> PagedLayer:
        new = PagedLayer(owner, layer.layer_idx, layer.sliding_window, group=layer.group)
        new.num_tokens, new.spec, new.is_initialized = layer.num_tokens, layer.spec, layer.is_initialized
        new.num_evicted = layer.num_evicted
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
        evicted = 0 if self._evictor is None else self._evictor.num_evicted
        bad = [layer.layer_idx for layer in self._paged_layers() if layer.is_initialized
               and (layer.num_evicted != evicted or layer.num_tokens > self._num_tokens)]
        if bad:
            raise InvariantError(f"retention: layers {bad} disagree with the cache on tokens held/evicted "
                                 f"({self._num_tokens} held, {evicted} evicted)")
        problems = [] if self._evictor is None else self._evictor.check_scoring(self, self.num_rows)
        if problems:
            raise InvariantError(f"retention: the reconstruction scores (KVzip) do not follow the rows: "
                                 f"{'; '.join(problems)}")

    # -- retention (hf_pagedkv/retention: the Evictor works through these) ------------------------------------------
    def retention_stats(self) -> RetentionStats:
        """Tokens seen vs held per row, and what the retention policy evicted (`RetentionStats`)."""
        if self._evictor is None:
            return RetentionStats(None, self._num_tokens, self._num_tokens, 0, 0)
        tables = self.retention_tables()
        if len(tables) < 2:
            return self._evictor.stats(self._num_tokens)
        per_layer = tuple(layer.num_tokens - self.first_held(layer) for layer in self._paged_layers())
        return self._evictor.stats(self._num_tokens, per_layer)

    @property
    def retention_policy(self):
        """The cache's `RetentionPolicy`, or None."""
        return None if self._evictor is None else self._evictor.policy

    def begin_context_scoring(self, key_valid: torch.Tensor | None = None) -> None:
        """KVzip (`hf_pagedkv.compress_context` calls it): from the next forward step on, the ``"hf_pagedkv"``
        attention of every layer scores the tokens held now (the context) by the attention they receive
        (`ContextScores`), until `end_context_scoring`.

        Args:
            key_valid (`torch.BoolTensor` of shape `[batch, positions]`, *optional*): for a left-padded batch,
                False at the padding of the context and of the steps to come (the attention mask they get);
                padding then scores 0 and is kept only where a row has fewer real tokens than the budget.

        Raises:
            ValueError: no retention policy, one that is not scored by a reconstruction pass (`KVzip`), an empty
                cache, or one that already evicted tokens; `key_valid` not `[batch, >= held]` bool.
            CacheReleasedError: the cache was released.
        """
        self.check_usable()
        if self._evictor is None:
            raise ValueError("compress_context needs a cache built with a reconstruction policy, e.g. "
                             "PagedCache(config=model.config, retention=hf_pagedkv.KVzip(compression_ratio=0.5)).")
        if not self._num_tokens:
            raise ValueError("compress_context: the cache holds no tokens; prefill the context first, e.g. "
                             "model(context_ids, past_key_values=cache).")
        if key_valid is not None and (key_valid.dtype != torch.bool or key_valid.dim() != 2
                                      or key_valid.shape[0] != self.num_rows or key_valid.shape[1] < self._num_tokens):
            raise ValueError(f"begin_context_scoring: key_valid must be a [{self.num_rows}, >= {self._num_tokens}] "
                             f"bool mask (rows, positions), got {key_valid.dtype} of shape {tuple(key_valid.shape)}.")
        self._evictor.begin_scoring(self._num_tokens, key_valid)

    def end_context_scoring(self, tokens_to_remove: int, compress: bool = True) -> dict[int, torch.Tensor]:
        """End what `begin_context_scoring` started: crop the `tokens_to_remove` tokens added since (the
        reconstruction pass), then, if `compress`, compact every (row, layer, KV head) to the policy's best-scored
        tokens (`KVzip.keep_for`) in fresh blocks and free the old ones.

        Returns:
            The scores per layer index, `torch.Tensor` `[batch, num_kv_heads, context]` float32 each (the highest
            attention weight each context token received).

        Raises:
            ValueError: a layer scored nothing (the model's attention is not ``"hf_pagedkv"``); nothing was evicted
                then (the crop is done).
            PoolExhaustedError: the compaction needs fresh blocks a fixed pool does not have (nothing evicted).
        """
        self.check_usable()
        if self._evictor is None:
            raise ValueError("end_context_scoring: this cache has no retention policy.")
        scores, valid = self._evictor.end_scoring()
        if tokens_to_remove:
            self.crop(-tokens_to_remove)
        if compress:
            with self.pool.lock:
                self._evictor.compress(self, scores, valid)
            self._after_change()
        return scores

    def retention_tables(self) -> list[RowTables]:
        """The block tables a retention policy acts on: the full-attention layer groups (one, or one per tier of
        a tiered policy such as `PyramidKV`, tier 0 first); empty before a cache built without config has seen its
        first layer."""
        return [rt for rt in self._groups if rt.window is None]

    def retention_layers(self) -> list[PagedLayer]:
        """The layers a retention policy scores and compacts: the full-attention ones."""
        return [layer for layer in self._paged_layers() if not layer.is_sliding]

    def sliding_tables(self) -> list[RowTables]:
        """The sliding-window layer groups' tables: after an eviction they keep their window at the new logical
        positions (`hf_pagedkv.retention.WindowRealign`)."""
        return [rt for rt in self._groups if rt.window is not None]

    def sliding_layers(self) -> list[PagedLayer]:
        return [layer for layer in self._paged_layers() if layer.is_sliding]

    def first_held(self, layer: PagedLayer) -> int:
        """The first logical token full-attention `layer` holds: 0, or in a retention tier that holds fewer tokens
        than the span (`PyramidKV`, `KVzip(layer_budgets="global")`), the leading positions its table dropped."""
        return self._by_group[layer.group].window_start(layer.num_tokens)

    def set_held(self, held: int, evicted: int) -> None:
        """After an eviction: every row's tables span `held` logical tokens (each layer holds them from its
        `first_held` on: all of them but in an upper retention tier), `evicted` were evicted before them."""
        self._num_tokens = held
        self._end_step()
        for layer in self._paged_layers():
            layer.num_tokens = min(layer.num_tokens, held)
            layer.num_evicted = evicted

    # -- internals: the forward step ------------------------------------------------------------------------------
    def update_layer(self, layer: PagedLayer, key_states: torch.Tensor,
                     value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new K/V (`[batch, num_kv_heads, q, head_dim]`) and return what its attention reads."""
        # NOTE: autograd is kept, not refused: a forward with grad through a PagedCache gets DynamicCache's
        # gradients (exactly, for tokens cached without grad), so code that merely forgot torch.no_grad() keeps
        # working, and the one case the pool cannot serve (backpropagating into K/V cached by an earlier forward
        # with grad) raises in backward() instead of returning different gradients silently.
        grad = needs_grad(key_states, value_states)
        step_kv = (key_states, value_states)  # every row, before the duplicate rows are dropped
        q = key_states.shape[2]
        start = layer.num_tokens
        rt = self._by_group[layer.group]
        if q == 0:
            if start == 0:
                return key_states, value_states
            return self.read_layer(layer, rt.window_start(start))
        if start == self._num_tokens:
            self._begin_step(key_states, value_states)
        elif self._plan is None or not self._plan.covers(start, q, key_states.shape[0]):
            raise RuntimeError(
                f"Layer {layer.layer_idx} holds {start} tokens but this PagedCache holds {self._num_tokens} per row "
                f"(batch {self.num_rows}); got {q} new tokens for batch {key_states.shape[0]}. An earlier error "
                "interrupted a forward step: release() this cache and start a new one."
            )
        else:
            for r, w in list(self._plan.dup_of.items()):  # duplicates must stay identical in every layer to share
                if not (torch.equal(key_states[r], key_states[w]) and torch.equal(value_states[r], value_states[w])):
                    self._unshare(r)
        plan, tensors = self._plan, self._step_tensors
        device, store = layer.spec.device, self.pool.groups[layer.group].store
        if key_states.requires_grad or value_states.requires_grad:  # (else they are kept as they are: a detach per
            key_states, value_states = key_states.detach(), value_states.detach()  # layer is a Python call)
        new = (plan.start, key_states, value_states)  # this step's tokens, for a quantized read
        if len(plan.writers) < self.num_rows:
            rows = tensors.writer_rows(device)
            key_states, value_states = key_states.index_select(0, rows), value_states.index_select(0, rows)
        stored = tensors.stored_tokens(device)  # None, or the tokens not in whole blocks of padding (pad block)
        if stored is not None:
            key_states, value_states = (_select_tokens(x, stored) for x in (key_states, value_states))
        with self.pool.lock:  # a growing pool replaces its tensors; no write may land in the old ones
            store.write(layer.layer_idx, tensors.write_target(rt, store, device), key_states, value_states)
        layer.num_tokens = plan.end
        lo = rt.window_start(plan.start)
        # -- an attention that reads the pool in place (hf_pagedkv.attention) gets a PagedView -------------------------
        view = None if grad else self._in_place.view(
            plan, store, layer, rt.table[:, : num_blocks_for(plan.end, self.block_size)], lo, plan.end,
            plan.view_base[rt.group], new, self)
        if view is not None and self._in_place.confirmed(plan):
            return self._in_place.hand_out(view)
        out = self.read_layer(layer, lo, new)
        if view is not None:
            view.tag(out[0])
        if grad:
            out = attach_step_grad(out, step_kv, plan.start - lo, plan.grad_history)
            self._grad_history = True
        return out

    def read_layer(self, layer: PagedLayer, lo: int, new: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. layer.num_tokens - 1` of every row: `[batch, num_kv_heads, seq_len, head_dim]` each.
        `new` is `(start, key_states, value_states)` of the current step (a quantized store returns those tokens
        in full precision)."""
        end = layer.num_tokens
        rt = self._by_group[layer.group]
        plan = self._plan
        current = plan is not None and plan.end == end  # the step computed the view base once for its layers
        base = plan.view_base[rt.group] if current else rt.view_base()
        block_source = None
        if current and lo == rt.window_start(plan.start):
            tensors = self._step_tensors
            block_source = lambda device: tensors.indices(rt, "read", device)  # noqa: E731  (shared by the layers)
        request = ReadRequest(rt.table[:, : num_blocks_for(end, self.block_size)], lo, end, self.block_size,
                              None if base is None else base // self.block_size, new, block_source,
                              plan.view_rows.get(rt.group) if current else rt.view_rows())
        return self.pool.groups[layer.group].store.read(layer.layer_idx, request)

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        prompt = self._publish_at_next_step
        if prompt is not None and self._num_tokens >= len(prompt):  # every layer wrote the prompt: publish it
            self._publish_at_next_step = None
            self.publish(prompt)
        # may raise ValueError before anything changed
        padding = None if self._padding is None else self._padding.for_batch(
            key_states.shape[0], key_states.shape[2] if not self._num_tokens else None)
        with self.pool.lock:
            num_rows = self.num_rows
            self._match_batch(key_states.shape[0])
            if self._evictor is not None:  # retention (hf_pagedkv/retention): evict before this step is planned
                self._evictor.before_step(self, key_states.shape[2])
            try:
                plan = self._making_room(lambda: self._planner.begin(
                    self._groups, key_states, value_states, self._num_tokens, maybe_dups=self._maybe_dups,
                    grad_history=self._grad_history, padding=padding))
            except BaseException:  # a full pool: undo the row expansion too, so the pool is exactly as it was
                if self.num_rows != num_rows and self._num_tokens:
                    self._select(list(range(0, self.num_rows, self.num_rows // num_rows)))
                    self._maybe_dups = False
                raise
        self._plan, self._step_tensors = plan, StepTensors(plan)
        self._num_tokens = plan.end
        if padding is not None and plan.end >= self._padding.num_tokens:  # every position of the padding is planned
            self._padding = None
        self.pool.touch_owner(self._owner)  # its last use, for swapping out the least recently used idle caches
        self.last_step_tokens = plan.num_new
        self._maybe_dups = False
        self.pool.events.on_step(self.seq_id, plan, self._rows)
        self.pool.metrics.on_step(self, plan.num_new, plan.num_cow_copies)
        self._after_change()

    def _making_room(self, plan_step: Callable[[], StepPlan]) -> StepPlan:
        """`plan_step()` (all or nothing), planned again each time it finds the pool exhausted and `on_exhausted`
        makes room (returns True)."""
        while True:
            try:
                return plan_step()
            except PoolExhaustedError as error:
                if self.on_exhausted is None or not self.on_exhausted(error):
                    raise

    def _unshare(self, r: int) -> None:
        """Duplicate row `r` differs in this layer: it gets its own blocks for the rest of the step."""
        with self.pool.lock:
            plan = self._making_room(lambda: self._planner.unshare(self._groups, self._plan, r))
        # the stores already prepared for this step stay prepared (`new_step=False` for the rest)
        self._plan, self._step_tensors = plan, StepTensors(plan, self._step_tensors.prepared)
        self._after_change()

    def _end_step(self) -> None:
        """The tables changed outside a forward step (crop, row selection, reset): no step plan applies."""
        self._plan = self._step_tensors = None

    def _attach(self, hit: int, held: dict[int, tuple[int, list[int]]]) -> None:
        """Start this (empty) cache as one row of `hit` full blocks: per group, `(dropped positions, blocks)`
        (already referenced for this row). All or nothing: every group's table and mirror is made before any is
        installed."""
        n = hit * self.block_size
        for group in held:  # a cache built without config starts its (full-attention) group here
            if group not in self._by_group:
                self._tables_for(self.pool.groups[group].window, self.pool.groups[group].tier)
        tables = []
        for rt in self._groups:
            lo, blocks = held[rt.group]
            row = BlockTable(num_dropped=lo)
            row.append(blocks)
            row.num_tokens = n
            tables.append((rt, [row], RowTables.mirror_of([row])))
        for rt, rows, table in tables:
            rt.restore(rows, table)
        self._num_tokens = n
        for layer in self._paged_layers():
            layer.num_tokens = n

    # -- internals: rows ------------------------------------------------------------------------------------------
    def _select(self, idx: list[int], common: bool = False) -> None:
        """Rows become copies of rows `idx`. With `common`, refcounts move only for block positions after the
        leading ones every row shares (a permutation leaves their counts unchanged)."""
        self.check_usable()
        if any(not 0 <= i < self.num_rows for i in idx):
            raise ValueError(f"row indices {idx} out of range for a cache of {self.num_rows} rows.")
        self._padding = None
        with self.pool.lock:
            for rt in self._groups:
                c = rt.common_prefix(self._num_tokens) if common else 0
                new_rows = [rt.rows[i].copy() for i in idx]
                for row in new_rows:
                    self.pool.incref(row.after(c), rt.group)
                self.pool.free([b for row in rt.rows for b in row.after(c)], rt.group)
                rt.rows[:] = new_rows
                rt.select(idx)
            if self._evictor is not None:  # recorded queries follow their rows
                self._evictor.select_rows(idx)
        self._end_step()
        self._after_change()

    def _match_batch(self, batch: int) -> None:
        """Make the cache hold `batch` rows: new empty rows, or `k` forks of each row when `batch = k * rows`."""
        if batch == self.num_rows:
            return
        if self._num_tokens == 0:
            padding = self._padding  # declared for the prefill this batch is for
            self.reset()
            self._padding = padding
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


def _select_tokens(states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens `tokens` (`[n]`, indices into the row-major `[rows * q]` tokens) of `states` `[rows, num_kv_heads, q,
    dim]`, as one row `[1, num_kv_heads, n, dim]` (what the stores write with an `[n]` slot mapping)."""
    heads, dim = states.shape[1], states.shape[-1]
    flat = states.transpose(0, 1).reshape(heads, -1, dim)  # [num_kv_heads, rows * q, dim]
    return flat.index_select(1, tokens).unsqueeze(0)  # [1, num_kv_heads, n, dim]
