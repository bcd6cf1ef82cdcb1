"""The per-step logic of `PagedCache`: extend block tables once per forward step, write slots, read rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from .block_table import num_blocks_for
from .grad import attach_step_grad, needs_grad


@dataclass
class _Step:
    """What the first layer of a forward step decided, reused by the other layers of that step."""

    start: int  # tokens each row held before the step
    end: int  # tokens each row holds after it
    writers: list[int]  # rows whose new tokens are written (all rows but the duplicates)
    dup_of: dict[int, int]  # duplicate row -> the writer row whose blocks it shares (identical K/V so far)
    view_base: int | None  # first slot of the only row when its blocks are consecutive (read as a view)
    tensors: dict = field(default_factory=dict)  # (kind, device) -> slot tensor, built lazily per device
    planned: bool = False  # a quantized store has seen this step's slot mapping (`plan_write`)
    grad_history: bool = False  # the tokens before `start` include some computed with grad (see grad.py)


class StepMixin:
    """Mixed into `PagedCache`. A forward step looks like this for a row of block size 4::

        before (start=6):  [ b7: t0 t1 t2 t3 | b8: t4 t5 .  . ]
        new tokens q=3:                                 t6 t7 | t8 -> needs one new block
        after  (end=9):    [ b7: t0 t1 t2 t3 | b8: t4 t5 t6 t7 | b9: t8 .  .  . ]

    The first layer to see tokens past the cache's length extends every row's table (`_begin_step`): it
    plans the new blocks and the copy-on-write of shared partial last blocks, reserves them all at once (the
    only step that can fail, before anything changes), then applies the plan. Every layer then writes its K/V
    into the step's slot mapping and reads its rows back.

    Under grad mode the rows read back are differentiable with respect to the step's own K/V (`grad.py`).
    """

    _grad_history = False  # this cache holds tokens written from K/V that required grad; cleared by reset()

    def _update_layer(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        # NOTE: autograd is kept, not refused: a forward with grad through a PagedCache gets DynamicCache's
        # gradients (exactly, for tokens cached without grad), so code that merely forgot torch.no_grad() keeps
        # working, and the one case the pool cannot serve (backpropagating into K/V cached by an earlier forward
        # with grad) raises in backward() instead of returning different gradients silently.
        grad = needs_grad(key_states, value_states)
        step_kv = (key_states, value_states)  # every row, before the duplicate rows are dropped
        q = key_states.shape[2]
        start = layer.num_tokens
        step = self._step
        if q == 0:
            if layer.num_tokens == 0:
                return key_states, value_states
            return self._read(layer, self._window_start(layer, start))
        if start == self._num_tokens:
            self._begin_step(key_states, value_states)
            step = self._step
        elif step is None or (start, start + q) != (step.start, step.end) or key_states.shape[0] != len(self._rows):
            raise RuntimeError(
                f"Layer {layer.layer_idx} holds {start} tokens but this PagedCache holds {self._num_tokens} per row "
                f"(batch {len(self._rows)}); got {q} new tokens for batch {key_states.shape[0]}. An earlier error "
                "interrupted a forward step: release() this cache and start a new one."
            )
        else:
            for r, w in list(step.dup_of.items()):  # duplicates must stay identical in every layer to share
                if not (torch.equal(key_states[r], key_states[w]) and torch.equal(value_states[r], value_states[w])):
                    self._unshare(r)
        device, store = layer.spec.device, self.pool.store
        new = (step.start, key_states.detach(), value_states.detach())  # this step's tokens, for a quantized read
        if len(step.writers) < len(self._rows):
            rows = self._tensor(step, "writers", device)
            key_states, value_states = key_states.index_select(0, rows), value_states.index_select(0, rows)
        with self.pool.lock:  # a growing pool replaces its tensors; no write may land in the old ones
            target = self._plan(step, device) if store.is_quantized else self._tensor(step, "write", device)
            store.write(layer.layer_idx, target, key_states.detach(), value_states.detach())
        layer.num_tokens = step.end
        lo = self._window_start(layer, step.start)
        out = self._read(layer, lo, new)
        if grad:
            out = attach_step_grad(out, step_kv, step.start - lo, step.grad_history)
            self._grad_history = True
        return out

    @staticmethod
    def _window_start(layer, start: int) -> int:
        """First position attention reads: 0, or the last `sliding_window - 1` cached tokens (as DynamicCache)."""
        return 0 if layer.sliding_window is None else max(0, start - (layer.sliding_window - 1))

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        with self.pool.lock:
            num_rows = len(self._rows)
            self._match_batch(key_states.shape[0])
            try:
                self._extend(key_states, value_states)
            except BaseException:  # a full pool: undo the row expansion too, so the pool is exactly as it was
                if len(self._rows) != num_rows and self._num_tokens:
                    self._select(list(range(0, len(self._rows), len(self._rows) // num_rows)), 0)
                    self._maybe_dups = False
                raise
        self._after_change()

    def _extend(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Plan this step's blocks, reserve them all (the only part that can fail), then apply the plan."""
        batch, q = key_states.shape[0], key_states.shape[2]
        B = self.block_size
        pool = self.pool
        rows = self._rows
        start, end = self._num_tokens, self._num_tokens + q
        maybe_dups = batch > 1 and (q > 1 or self._maybe_dups)
        dup_of = self._find_duplicates(key_states, value_states) if maybe_dups else {}
        writers = [r for r in range(batch) if r not in dup_of]
        # Plan: new blocks per writer, and which writers must copy a shared partial last block first.
        n_new = num_blocks_for(end, B) - num_blocks_for(start, B)
        cow = []
        if start % B:
            dropped = Counter(rows[r].blocks[-1] for r in dup_of)  # duplicates let go of their blocks
            holders: dict[int, int] = {}
            for r in writers:
                last = rows[r].blocks[-1]
                holders.setdefault(last, pool.allocator.refcount(last) - dropped[last])
                # another holder still reads it, or the prefix index names its content: copy before writing
                if holders[last] > 1 or pool.is_published(last):
                    cow.append(r)
                    holders[last] -= 1
        pool.reserve(n_new * len(writers) + len(cow))  # may raise PoolExhaustedError; nothing changed yet
        # Apply.
        for r in dup_of:
            pool.free(rows[r].blocks)  # never frees: the writer row holds the same blocks
        src, dst = [], []
        for r in cow:
            row = rows[r]
            new = pool.allocate(1, after=row.blocks[-2] if len(row.blocks) > 1 else None)[0]
            src.append(row.replace_last(new))
            dst.append(new)
        pool.copy_on_write(src, dst)
        pool.free(src)  # each copied block keeps its other holders (or stays cached if published)
        for r in writers:
            row = rows[r]
            if n_new:
                row.append(pool.allocate(n_new, after=row.blocks[-1] if row.blocks else None))
            row.num_tokens = end
            self._set_table(r, start // B)
        for r, w in dup_of.items():
            rows[r] = rows[w].copy()
            pool.incref(rows[r].blocks)
            self._table[r] = self._table[w]
        self._num_tokens = end
        self._maybe_dups = False
        only = rows[0] if batch == 1 else None
        view_base = only.blocks[0] * B if only is not None and only.is_contiguous else None
        self._step = _Step(start, end, writers, dup_of, view_base, grad_history=self._grad_history and start > 0)
        pool.events.on_step(self, self._step, cow, src, dst)
        pool.metrics.on_step(self, q, len(src))

    def _find_duplicates(self, key_states: torch.Tensor, value_states: torch.Tensor) -> dict[int, int]:
        """Rows with identical block tables and bit-identical new K/V in this layer -> the first such row."""
        # A cheap fingerprint first (bit-identical rows have equal sums), so distinct rows are not compared pairwise.
        sums = torch.stack([key_states.flatten(1).sum(1), value_states.flatten(1).sum(1)], 1).tolist()
        groups: dict[tuple, list[int]] = {}
        for r, row in enumerate(self._rows):
            groups.setdefault((tuple(row.blocks), *sums[r]), []).append(r)
        dup_of = {}
        for members in groups.values():
            firsts: list[int] = []
            for r in members:
                same = (w for w in firsts if torch.equal(key_states[r], key_states[w])
                        and torch.equal(value_states[r], value_states[w]))
                w = next(same, None)
                if w is None:
                    firsts.append(r)
                else:
                    dup_of[r] = w
        return dup_of

    def _unshare(self, r: int) -> None:
        """A duplicate row turned out different in a later layer: give it its own copy of this step's blocks."""
        step, pool, row = self._step, self.pool, self._rows[r]
        first = step.start // self.block_size
        with pool.lock:
            pool.reserve(len(row.blocks) - first)
            old = row.truncate(first)
            row.append(pool.allocate(len(old), after=row.blocks[-1] if row.blocks else None))
            pool.copy_on_write(old, row.blocks[first:])  # earlier layers were identical, so this is exact
            pool.free(old)  # still held by the writer row
            self._set_table(r, first)
        del step.dup_of[r]
        step.writers = sorted(step.writers + [r])
        step.tensors.clear()
        self._after_change()

    def _tensor(self, step: _Step, kind: str, device: torch.device) -> torch.Tensor:
        """The step's index tensors on `device`: "writers" (rows), "write" (slot mapping, row-major,
        `[len(writers) * q]`) and "read" (slots of every token of every row, `[batch, end]`)."""
        key = (kind, device)
        t = step.tensors.get(key)
        if t is None:
            B = self.block_size
            if kind == "writers":
                t = torch.tensor(step.writers, dtype=torch.long)
            elif kind == "write" and step.view_base is not None:
                t = torch.arange(step.start, step.end) + step.view_base  # consecutive slots
            elif kind == "write":
                pos = torch.arange(step.start, step.end)
                blocks = self._table[torch.tensor(step.writers)][:, pos // B]  # [writers, q]
                t = (blocks * B + pos % B).reshape(-1)  # [writers * q]
            else:
                t = self._read_slots(step.end)
            t = t.to(device)
            step.tensors[key] = t
        return t

    def _plan(self, step: _Step, device: torch.device):
        """The quantized store's `WritePlan` for this step on `device`, built once (rebuilt after `_unshare`)."""
        key = ("plan", device)
        if key not in step.tensors:
            slots = self._tensor(step, "write", torch.device("cpu"))
            step.tensors[key] = self.pool.store.plan_write(
                slots, device, new_step=not step.planned, start=step.start, num_new=step.end - step.start)
            step.planned = True
        return step.tensors[key]

    def _read_slots(self, end: int) -> torch.Tensor:
        """Slot of each of the first `end` tokens of each row, `[batch, end]` int64 (CPU)."""
        B = self.block_size
        table = self._table[:, : num_blocks_for(end, B)]  # [batch, blocks]
        return (table[:, :, None] * B + torch.arange(B)).reshape(len(self._rows), -1)[:, :end]  # [batch, end]

    def _read(self, layer, lo: int, new: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. layer.num_tokens - 1` of every row: `[batch, num_kv_heads, seq_len, head_dim]` each.
        `new` is `(start, key_states, value_states)` of the current step (a quantized store returns those tokens
        in full precision)."""
        end, idx = layer.num_tokens, layer.layer_idx
        store = self.pool.store
        if store.is_quantized:
            row = self._rows[0] if len(self._rows) == 1 else None
            base = row.blocks[0] if row is not None and row.is_contiguous and row.blocks else None
            return store.read(idx, self._table[:, : num_blocks_for(end, self.block_size)], lo, end, base, new)
        if len(self._rows) == 1 and self._rows[0].is_contiguous:
            return store.read_view(idx, self._rows[0].blocks[0] * self.block_size + lo, end - lo)
        step = self._step
        if step is not None and step.end == end:
            slots = self._tensor(step, "read", layer.spec.device)
        else:
            slots = self._read_slots(end).to(layer.spec.device)
        return store.read_gather(idx, slots[:, lo:])
