"""`StepRunner`: runs the forward steps of one `PagedCache` (what its `PagedLayer`s call)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from hf_pagedkv._compat import DummyLayer
from hf_pagedkv.adapter.cache_retention import CacheRetention
from hf_pagedkv.adapter.cache_rows import CacheRows
from hf_pagedkv.adapter.evictor import Evictor
from hf_pagedkv.adapter.grad import attach_step_grad, needs_grad
from hf_pagedkv.adapter.in_place_reads import InPlaceReads
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.adapter.prefix_cache import prefix_key
from hf_pagedkv.adapter.step_io import StepIO
from hf_pagedkv.adapter.step_plan import StepPlan
from hf_pagedkv.adapter.step_planner import StepPlanner
from hf_pagedkv.adapter.step_tensors import StepTensors
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.errors import InvariantError, PoolExhaustedError, counted
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.read_request import ReadRequest

logger = logging.getLogger(__name__)


class StepRunner:
    """The forward steps of one cache, and the per-layer bookkeeping that goes with its rows.

    A step: the first layer to see tokens past the rows' length (`update_layer`) begins it: the rows match the batch
    (forked when it is a multiple of them), a retention policy evicts, and the `StepPlanner` extends every row's table
    in every layer group (the only part that can fail, all or nothing), returning an immutable `StepPlan`. When a
    fixed pool has too few blocks for it, `on_exhausted` (if set) may make room and the step is planned again, so the
    request goes on where it was. Every layer of the step then writes its K/V through its group's store
    (`prepare_write` / `write`) and reads its rows back (`read_layer`, a `ReadRequest`), or hands an in-place view to
    the ``"hf_pagedkv"`` attention (`InPlaceReads`). Rows found identical at a prefill share their blocks until a
    layer's K/V tell them apart (`unshare`). Under grad mode the rows read back are differentiable with respect to the
    step's own K/V (`grad.py`).

    Invariants: `plan` is None or the plan of the step in progress, whose `end` is `rows.num_tokens`; every layer
    holds at most `rows.num_tokens` tokens and has evicted `retention.num_evicted` (`check_invariants`). Row
    operations (`select`, `crop`, `reset`) and evictions (`set_held`) end the step in progress.

    Layers hold this object weakly (the cache holds it), so a cache dropped without `release()` returns its blocks at
    once and its layers then raise `CacheReleasedError`.

    Args:
        rows (`CacheRows`): the cache's rows.
        layers (`list`): the cache's `layers` (the same list object: layers appended to it are run too).
        debug (`bool`): check every invariant after each change (`after_change`).
        config (`PretrainedConfig`, *optional*): the model config (its attention's name, for `InPlaceReads`).
        num_layers (`int`, *optional*): the model's layers when known up front (sizes `max_memory` pools).
        evictor (`Evictor`, *optional*): the retention state of a cache with a retention policy.
    """

    def __init__(self, rows: CacheRows, layers: list, *, debug: bool = False, config=None,
                 num_layers: int | None = None, evictor: Evictor | None = None) -> None:
        self.rows = rows  # fixed
        self.pool = rows.pool  # fixed
        self.block_size = rows.block_size  # fixed
        self.layers = layers  # the cache's layers (PagedLayer or DummyLayer); appended to by the cache only
        self.debug = debug  # check invariants after every change; fixed
        self.num_layers = num_layers  # the model's layers when built from a config, else None; fixed (a fork copies)
        self._planner = StepPlanner(self.pool)  # extends the tables at each step's first layer; fixed
        self.plan: StepPlan | None = None  # the current forward step, set by its first layer
        self._tensors: StepTensors | None = None  # the current step's index tensors, per group and device
        self.grad_history = False  # holds tokens written from K/V that required grad; cleared by reset()
        self.last_step_tokens = 0  # new tokens per row of the last forward step (a sliding group holds them too)
        self.publish_at_next_step: list[int] | None = None  # a prompt to publish before sliding groups free it
        # called with the `PoolExhaustedError` when a step's blocks do not fit; returns True when it made room (then
        # the step is planned again), False to raise the error; None: raise it. Set through `PagedCache.on_exhausted`
        self.on_exhausted: Callable[[PoolExhaustedError], bool] | None = None
        self.in_place = InPlaceReads(config, num_layers)  # which step's attention reads the pool in place
        # the retention policy's state and plumbing, or None; set once (a fork sets its copy)
        self.retention = None if evictor is None else CacheRetention(evictor, self)
        rows.on_stale = weakref.WeakMethod(self.end_step)

    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    # -- what a PagedLayer calls ----------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raises `CacheReleasedError` / `CacheOffloadedError` when the cache cannot run a step."""
        self.rows.check_usable()

    def register_layer(self, layer: PagedLayer, spec: LayerSpec) -> None:
        """Storage for `layer`'s first K/V (`LayerRegistry.register`)."""
        with self.pool.lock:
            self.pool.layers.register(layer.layer_idx, spec, self.num_layers, layer.group)

    def first_held(self, layer: PagedLayer) -> int:
        """The first logical token full-attention `layer` holds: 0, or in a retention tier that holds fewer tokens
        than the span (`PyramidKV`, `KVzip(scoring="global")`), the leading positions its table dropped."""
        return self.rows.by_group[layer.group].window_start(layer.num_tokens)

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
        rows = self.rows
        rt = rows.by_group[layer.group]
        if q == 0:
            if start == 0:
                return key_states, value_states
            return self.read_layer(layer, rt.window_start(start))
        if start == rows.num_tokens:
            self._begin_step(key_states, value_states)
        elif self.plan is None or not self.plan.covers(start, q, key_states.shape[0]):
            raise RuntimeError(
                f"Layer {layer.layer_idx} holds {counted(start, 'token')} but this PagedCache holds {rows.num_tokens} "
                f"per row (batch {rows.num_rows}); got {counted(q, 'new token')} for batch {key_states.shape[0]}. An "
                "earlier error interrupted a forward step: release() this cache and start a new one."
            )
        else:
            for r, w in list(self.plan.dup_of.items()):  # duplicates must stay identical in every layer to share
                if not (torch.equal(key_states[r], key_states[w]) and torch.equal(value_states[r], value_states[w])):
                    self._unshare(r)
        plan, tensors = self.plan, self._tensors
        device, group = layer.spec.device, self.pool.groups[layer.group]
        if key_states.requires_grad or value_states.requires_grad:  # (else they are kept as they are: a detach per
            key_states, value_states = key_states.detach(), value_states.detach()  # layer is a Python call)
        new = (plan.start, key_states, value_states)  # this step's tokens, for a quantized read
        if len(plan.writers) < rows.num_rows:
            writers = tensors.writer_rows(device)
            key_states, value_states = key_states.index_select(0, writers), value_states.index_select(0, writers)
        stored = tensors.stored_tokens(device)  # None, or the tokens not in whole blocks of padding (pad block)
        if stored is not None:
            key_states, value_states = (_select_tokens(x, stored) for x in (key_states, value_states))
        with self.pool.lock:  # a growing pool replaces its tensors; no write may land in the old ones
            group.write(layer.layer_idx, tensors.write_target(rt, group, device), key_states, value_states)
        layer.num_tokens = plan.end
        lo = rt.window_start(plan.start)
        # -- an attention that reads the pool in place (hf_pagedkv.attention) gets a PagedView -------------------------
        view = None if grad else self.in_place.view(
            plan, group.page_store, layer, rt.table[:, : num_blocks_for(plan.end, self.block_size)], lo, plan.end,
            plan.view_base[rt.group], new, self)
        if view is not None and self.in_place.confirmed(plan):
            return self.in_place.hand_out(view)
        out = self.read_layer(layer, lo, new)
        if view is not None:
            view.tag(out[0])
        if grad:
            out = attach_step_grad(out, step_kv, plan.start - lo, plan.grad_history)
            self.grad_history = True
        return out

    def step_io(self, layer: PagedLayer) -> StepIO | None:
        """`layer`'s writes and reads in the current step, for a caller that writes many caches' K/V at once (the
        serving engine's packed step); None: call `update` (see `StepIO.of`). Raises as `check_usable`."""
        self.check_usable()
        return StepIO.of(self.plan, self._tensors, self.rows, self.pool.groups[layer.group], layer,
                         self.rows.num_tokens, self.retention is not None, self.read_layer)

    def read_layer(self, layer: PagedLayer, lo: int, new: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. layer.num_tokens - 1` of every row: `[batch, num_kv_heads, seq_len, head_dim]` each.
        `new` is `(start, key_states, value_states)` of the current step (a quantized store returns those tokens
        in full precision)."""
        end = layer.num_tokens
        rt = self.rows.by_group[layer.group]
        plan = self.plan
        current = plan is not None and plan.end == end  # the step computed the view base once for its layers
        base = plan.view_base[rt.group] if current else rt.view_base()
        block_source = None
        if current and lo == rt.window_start(plan.start):
            tensors = self._tensors
            block_source = lambda device: tensors.indices(rt, "read", device)  # noqa: E731  (shared by the layers)
        request = ReadRequest(rt.table[:, : num_blocks_for(end, self.block_size)], lo, end, self.block_size,
                              None if base is None else base // self.block_size, new, block_source,
                              plan.view_rows.get(rt.group) if current else rt.view_rows())
        return self.pool.groups[layer.group].read(layer.layer_idx, request)

    def reset(self) -> None:
        """Free every block of the cache; it stays usable (empty). Every table and reference is dropped before the
        first call that may fail (releasing the freed blocks' storage), which then raises after it."""
        self.end_step()
        self.grad_history = False
        for layer in self.paged_layers():
            layer.num_tokens = layer.num_evicted = 0
        if self.retention is not None:
            self.retention.reset()
        self.rows.reset()

    # -- the step ---------------------------------------------------------------------------------------------------
    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = self.rows
        prompt = self.publish_at_next_step
        if prompt is not None and rows.num_tokens >= len(prompt):  # every layer wrote the prompt: publish it
            self.publish_at_next_step = None
            self._publish(prompt)
        # may raise ValueError before anything changed
        padding = None if rows.padding is None else rows.padding.for_batch(
            key_states.shape[0], key_states.shape[2] if not rows.num_tokens else None)
        with self.pool.lock:
            num_rows = rows.num_rows
            self._match_batch(key_states.shape[0])
            if self.retention is not None:  # retention (hf_pagedkv/retention): evict before this step is planned
                self.retention.before_step(key_states.shape[2])
            try:
                plan = self._making_room(lambda: self._planner.begin(
                    rows.groups, key_states, value_states, rows.num_tokens, maybe_dups=rows.maybe_dups,
                    grad_history=self.grad_history, padding=padding))
            except BaseException:  # a full pool: undo the row expansion too, so the pool is exactly as it was
                if rows.num_rows != num_rows and rows.num_tokens:
                    self.select(list(range(0, rows.num_rows, rows.num_rows // num_rows)))
                    rows.maybe_dups = False
                raise
        self.plan, self._tensors = plan, StepTensors(plan)
        rows.num_tokens = plan.end
        if padding is not None and plan.end >= rows.padding.num_tokens:  # every position of the padding is planned
            rows.padding = None
        self.pool.owners.touch(rows.owner)  # its last use, for swapping out the least recently used idle caches
        self.last_step_tokens = plan.num_new
        rows.maybe_dups = False
        self.pool.events.on_step(rows.owner, plan, rows.first_group)
        self.pool.metrics.on_step(self, plan.num_new, plan.num_cow_copies)
        self.after_change()

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
            plan = self._making_room(lambda: self._planner.unshare(self.rows.groups, self.plan, r))
        # the stores already prepared for this step stay prepared (`new_step=False` for the rest)
        self.plan, self._tensors = plan, StepTensors(plan, self._tensors.prepared)
        self.after_change()

    def end_step(self) -> None:
        """The tables changed outside a forward step (crop, row selection, reset, eviction, compaction, offload): no
        step plan applies."""
        self.plan = self._tensors = None

    def _match_batch(self, batch: int) -> None:
        """Make the rows `batch`: new empty rows, or `k` forks of each row when `batch = k * rows`."""
        rows = self.rows
        if batch == rows.num_rows:
            return
        if rows.num_tokens == 0:
            padding = rows.padding  # declared for the prefill this batch is for
            self.reset()
            rows.padding = padding
            for rt in rows.groups:
                rt.reset(batch)
        elif rows.num_rows and batch % rows.num_rows == 0:
            logger.debug("PagedCache: expanding %d rows to %d by forking", rows.num_rows, batch)
            self.repeat_rows(batch // rows.num_rows)
        else:
            raise ValueError(
                f"This PagedCache holds {counted(rows.num_rows, 'row')} of {counted(rows.num_tokens, 'token')} but got "
                f"a batch of {batch}; the batch must equal the rows, or be a multiple of them (rows are then forked)."
            )

    # -- row operations, with the layers' and the retention's bookkeeping ------------------------------------------
    def select(self, idx: list[int], common: bool = False) -> None:
        """Rows become copies of rows `idx` (`CacheRows.select`); recorded queries follow them."""
        with self.pool.lock:
            self.rows.select(idx, common)
            if self.retention is not None:  # recorded queries follow their rows
                self.retention.select_rows(idx)
        self.end_step()
        self.after_change()

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Row `i` becomes a copy of row `beam_idx[i]` (`PagedCache.reorder_cache`).

        Raises:
            ValueError: not integer indices, or one out of range.
            CacheReleasedError, CacheOffloadedError: as `check_usable` (even for an index that would change nothing).
        """
        self.check_usable()
        beam_idx = torch.as_tensor(beam_idx)
        if beam_idx.is_floating_point() or beam_idx.dtype == torch.bool:
            raise ValueError(f"reorder_cache: beam_idx must hold integer row indices, got {beam_idx.dtype}.")
        idx = beam_idx.reshape(-1).tolist()
        if idx == list(range(self.rows.num_rows)):
            return
        # as many rows after as before: leading blocks every row shares keep their counts
        self.select(idx, common=len(idx) == self.rows.num_rows and bool(idx))

    def repeat_rows(self, repeats: int) -> None:
        """Repeat each row `repeats` times, sharing its blocks (identical rows may be deduplicated next step).

        Raises:
            ValueError: `repeats` is not a non-negative int (as `DynamicCache`).
        """
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
            raise ValueError(f"batch_repeat_interleave: repeats must be a non-negative int, got {repeats!r}.")
        self.select([r for r in range(self.rows.num_rows) for _ in range(repeats)])
        self.rows.maybe_dups = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens of every row (`PagedCache.crop`).

        Raises:
            ValueError: `tokens_to_remove` is not an int or is positive; the crop reaches into what a retention
                policy or a sliding-window group still holds.
            CacheReleasedError, CacheOffloadedError: as `check_usable`.
        """
        self.check_usable()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"crop({tokens_to_remove!r}): pass an int, the negative number of tokens to remove "
                             "(as with DynamicCache).")
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as with DynamicCache."
            )
        rows = self.rows
        if tokens_to_remove == 0 or rows.num_tokens == 0:
            return
        rows.padding = None
        new_len = max(0, rows.num_tokens + tokens_to_remove)
        if self.retention is not None:  # retention: evicted tokens cannot come back
            self.retention.check_crop(new_len)
        rows.crop(new_len, tokens_to_remove)
        for layer in self.paged_layers():
            layer.num_tokens = min(layer.num_tokens, new_len)
        self.end_step()
        self.after_change()

    def set_held(self, held: int, evicted: int) -> None:
        """After an eviction: every row's tables span `held` logical tokens (each layer holds them from its
        `first_held` on: all of them but in an upper retention tier), `evicted` were evicted before them."""
        self.rows.num_tokens = held
        self.end_step()
        for layer in self.paged_layers():
            layer.num_tokens = min(layer.num_tokens, held)
            layer.num_evicted = evicted

    # -- prefix caching ---------------------------------------------------------------------------------------------
    def attach_prefix(self, ids: list[int]) -> None:
        """Attach the (empty) cache to the longest cached prefix of `ids` (`CacheRows.attach_prefix`)."""
        n = self.rows.attach_prefix(ids)
        for layer in self.paged_layers():
            layer.num_tokens = n
        self.after_change()
        if self.rows.sliding_tables():
            # NOTE: a sliding group frees the prompt's early blocks as soon as decoding starts, long before a
            # caller publishes; so the prompt is published when the step after the prompt begins (`_begin_step`).
            self.publish_at_next_step = ids

    def publish(self, input_ids, model=None) -> int:
        """`PagedCache.publish`: the full blocks every layer has written (`CacheRows.publish`).

        Raises:
            ValueError: the pool has no prefix caching; the cache was not built with a config (its layer count is
                unknown); no `model` to key the index with; as `CacheRows.publish`.
            CacheReleasedError, CacheOffloadedError: as `check_usable`.
        """
        self.check_usable()
        if not self.pool.prefix_caching:
            raise ValueError("publish needs a pool created with BlockPool(prefix_caching=True).")
        if self.num_layers is None:
            raise ValueError("publish needs a cache built with config= (or by from_prefix), so it knows every "
                             "layer has written a block before publishing it.")
        if self.rows.prefix_key is None:
            if model is None:
                raise ValueError("publish on a cache not made by from_prefix needs `model=` (the model that filled "
                                 "it) to key the prefix index.")
            self.rows.prefix_key = prefix_key(self.pool, model)
        return self._publish(input_ids)

    def _publish(self, input_ids) -> int:
        """The full blocks every layer has written (a retention policy's intact ones), keyed by `rows.prefix_key`."""
        layers = self.paged_layers()
        written = min([layer.num_tokens for layer in layers] + [self.rows.num_tokens]) if layers else 0
        intact = None if self.retention is None else self.retention.num_intact_blocks  # later blocks differ
        return self.rows.publish(input_ids, written, intact)

    def copy_into(self, other: StepRunner) -> None:
        """Make the runner of a new, empty cache (`PagedCache.fork`) hold the same tokens, sharing every block."""
        other.layers[:] = [DummyLayer() if isinstance(layer, DummyLayer) else _clone_layer(layer, other)
                           for layer in self.layers]
        other.num_layers = self.num_layers
        other.grad_history = self.grad_history
        other.retention = None if self.retention is None else CacheRetention(self.retention.evictor.copy(), other)
        self.rows.copy_into(other.rows)
        other.after_change()

    # -- checks -----------------------------------------------------------------------------------------------------
    def after_change(self) -> None:
        if self.debug:
            self.check_invariants()

    def check_invariants(self) -> None:
        """The pool's invariants, the rows' (`CacheRows.check_invariants`), and every layer's tokens held and
        evicted against the rows'; after the cache's `release()`, that it holds no block. Raises `InvariantError`."""
        self.pool.check_invariants()
        if self.rows.released:
            held = [list(row.blocks) for rt in self.rows.groups for row in rt.rows if row.blocks]
            if held:
                raise InvariantError(f"a released cache still holds blocks: {held}")
            return
        self.rows.check_invariants()
        held = self.rows.num_tokens
        evicted = 0 if self.retention is None else self.retention.num_evicted
        bad = [layer.layer_idx for layer in self.paged_layers() if layer.is_initialized
               and (layer.num_evicted != evicted or layer.num_tokens > held)]
        if bad:
            raise InvariantError(f"retention: layers {bad} disagree with the cache on tokens held/evicted "
                                 f"({held} held, {evicted} evicted)")
        problems = [] if self.retention is None else self.retention.check_scoring()
        if problems:
            raise InvariantError(f"retention: the reconstruction scores (KVzip) do not follow the rows: "
                                 f"{'; '.join(problems)}")


def _clone_layer(layer: PagedLayer, runner: StepRunner) -> PagedLayer:
    new = PagedLayer(runner, layer.layer_idx, layer.sliding_window, group=layer.group)
    new.num_tokens, new.spec, new.is_initialized = layer.num_tokens, layer.spec, layer.is_initialized
    new.num_evicted = layer.num_evicted
    if layer.is_initialized:
        new.dtype, new.device = layer.dtype, layer.device
    return new


def _select_tokens(states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens `tokens` (`[n]`, indices into the row-major `[rows * q]` tokens) of `states` `[rows, num_kv_heads, q,
    dim]`, as one row `[1, num_kv_heads, n, dim]` (what the stores write with an `[n]` slot mapping)."""
    heads, dim = states.shape[1], states.shape[-1]
    flat = states.transpose(0, 1).reshape(heads, -1, dim)  # [num_kv_heads, rows * q, dim]
    return flat.index_select(1, tokens).unsqueeze(0)  # [1, num_kv_heads, n, dim]
