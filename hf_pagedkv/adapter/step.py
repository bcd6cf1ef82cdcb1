"""The per-step logic of `PagedCache`: extend block tables once per forward step, write slots, read rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from hf_pagedkv.pool.block_table import num_blocks_for
from hf_pagedkv.adapter.grad import attach_step_grad, needs_grad


@dataclass
class _Step:
    """What the first layer of a forward step decided, reused by the other layers of that step."""

    start: int  # tokens each row held before the step
    end: int  # tokens each row holds after it
    writers: list[int]  # rows whose new tokens are written (all rows but the duplicates)
    dup_of: dict[int, int]  # duplicate row -> the writer row whose blocks it shares (identical K/V so far)
    view_base: dict[int, int | None]  # group -> slot of token 0 of the only row when its blocks are consecutive
    tensors: dict = field(default_factory=dict)  # (group, kind, device) -> slot tensor, built lazily per device
    planned: set = field(default_factory=set)  # groups whose quantized store has seen this step (`plan_write`)
    grad_history: bool = False  # the tokens before `start` include some computed with grad (see grad.py)


class StepMixin:
    """Mixed into `PagedCache`. A forward step looks like this for a row of block size 4::

        before (start=6):  [ b7: t0 t1 t2 t3 | b8: t4 t5 .  . ]
        new tokens q=3:                                 t6 t7 | t8 -> needs one new block
        after  (end=9):    [ b7: t0 t1 t2 t3 | b8: t4 t5 t6 t7 | b9: t8 .  .  . ]

    The first layer to see tokens past the cache's length extends every row's table in every layer group
    (`_begin_step`): a sliding-window group first frees the blocks wholly before this step's window, then the step
    plans the new blocks and the copy-on-write of shared partial last blocks, reserves them all at once (the only
    step that can fail, before anything else changes), then applies the plan. Every layer then writes its K/V into
    its group's slot mapping and reads its rows back.

    Under grad mode the rows read back are differentiable with respect to the step's own K/V (`grad.py`).
    """

    _grad_history = False  # this cache holds tokens written from K/V that required grad; cleared by reset()

    def update_layer(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        # NOTE: autograd is kept, not refused: a forward with grad through a PagedCache gets DynamicCache's
        # gradients (exactly, for tokens cached without grad), so code that merely forgot torch.no_grad() keeps
        # working, and the one case the pool cannot serve (backpropagating into K/V cached by an earlier forward
        # with grad) raises in backward() instead of returning different gradients silently.
        grad = needs_grad(key_states, value_states)
        step_kv = (key_states, value_states)  # every row, before the duplicate rows are dropped
        q = key_states.shape[2]
        start = layer.num_tokens
        step = self._step
        rt = self._by_group[layer.group]
        if q == 0:
            if layer.num_tokens == 0:
                return key_states, value_states
            return self.read_layer(layer, rt.window_start(start))
        if start == self._num_tokens:
            self._begin_step(key_states, value_states)
            step = self._step
        elif step is None or (start, start + q) != (step.start, step.end) or key_states.shape[0] != self.num_rows:
            raise RuntimeError(
                f"Layer {layer.layer_idx} holds {start} tokens but this PagedCache holds {self._num_tokens} per row "
                f"(batch {self.num_rows}); got {q} new tokens for batch {key_states.shape[0]}. An earlier error "
                "interrupted a forward step: release() this cache and start a new one."
            )
        else:
            for r, w in list(step.dup_of.items()):  # duplicates must stay identical in every layer to share
                if not (torch.equal(key_states[r], key_states[w]) and torch.equal(value_states[r], value_states[w])):
                    self._unshare(r)
        device, store = layer.spec.device, self.pool.groups[layer.group].store
        new = (step.start, key_states.detach(), value_states.detach())  # this step's tokens, for a quantized read
        if len(step.writers) < self.num_rows:
            rows = self._tensor(step, rt, "writers", device)
            key_states, value_states = key_states.index_select(0, rows), value_states.index_select(0, rows)
        with self.pool.lock:  # a growing pool replaces its tensors; no write may land in the old ones
            target = self._plan(step, rt, device) if store.is_quantized else self._tensor(step, rt, "write", device)
            store.write(layer.layer_idx, target, key_states.detach(), value_states.detach())
        layer.num_tokens = step.end
        lo = rt.window_start(step.start)
        # -- issue 15: an attention that reads the pool in place (hf_pagedkv.attention) gets a PagedView ----------
        view = None if grad else self._in_place.view(
            step, store, layer, rt.table[:, : num_blocks_for(step.end, self.block_size)], lo, step.end,
            step.view_base[rt.group], new, self)
        if view is not None and self._in_place.confirmed(step):
            return view.placeholders()
        out = self.read_layer(layer, lo, new)
        if view is not None:
            view.tag(out[0])
        # -- end issue 15 --------------------------------------------------------------------------------------
        if grad:
            out = attach_step_grad(out, step_kv, step.start - lo, step.grad_history)
            self._grad_history = True
        return out

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        with self.pool.lock:
            num_rows = self.num_rows
            self._match_batch(key_states.shape[0])
            try:
                self._extend(key_states, value_states)
            except BaseException:  # a full pool: undo the row expansion too, so the pool is exactly as it was
                if self.num_rows != num_rows and self._num_tokens:
                    self._select(list(range(0, self.num_rows, self.num_rows // num_rows)))
                    self._maybe_dups = False
                raise
        self._after_change()

    def _extend(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Plan this step's blocks in every layer group, reserve them all (the only part that can fail), then
        apply the plan."""
        batch, q = key_states.shape[0], key_states.shape[2]
        B = self.block_size
        pool = self.pool
        start, end = self._num_tokens, self._num_tokens + q
        prompt = self._publish_at_next_step
        if prompt is not None and start >= len(prompt):  # every layer has written the prompt: publish it first
            self._publish_at_next_step = None
            self.publish(prompt)
        # A sliding group lets go of the blocks wholly before this step's window first: no layer reads them again.
        # NOTE: so a crop can go back at most one step's tokens (what assisted decoding does).
        for rt in self._groups:
            drop = rt.droppable(start)
            if drop > rt.num_dropped:
                for row in rt.rows:
                    pool.free(row.drop_front(drop), rt.group)
        maybe_dups = batch > 1 and (q > 1 or self._maybe_dups)
        dup_of = self._find_duplicates(key_states, value_states) if maybe_dups else {}
        writers = [r for r in range(batch) if r not in dup_of]
        # Plan: new blocks per writer, and which writers must copy a shared partial last block first, per group.
        n_new = num_blocks_for(end, B) - num_blocks_for(start, B)
        plans = []
        for rt in self._groups:
            rows, cow = rt.rows, []
            if start % B:
                alloc = pool.groups[rt.group].allocator
                dropped = Counter(rows[r].blocks[-1] for r in dup_of)  # duplicates let go of their blocks
                holders: dict[int, int] = {}
                for r in writers:
                    last = rows[r].blocks[-1]
                    holders.setdefault(last, alloc.refcount(last) - dropped[last])
                    # another holder still reads it, or the prefix index names its content: copy before writing
                    if holders[last] > 1 or pool.is_published(last, rt.group):
                        cow.append(r)
                        holders[last] -= 1
            plans.append((rt, cow, n_new * len(writers) + len(cow)))
        for rt, _, need in plans:  # all groups or none: a group that cannot serve raises before any reservation
            if not pool.can_reserve(need, rt.group):
                pool.reserve(need, rt.group)  # raises PoolExhaustedError; nothing changed yet
        for rt, _, need in plans:
            pool.reserve(need, rt.group)
        # Apply.
        view_base = {}
        total_src, cow0 = 0, ([], [], [])
        for rt, cow, _ in plans:
            g, rows = rt.group, rt.rows
            for r in dup_of:
                pool.free(rows[r].blocks, g)  # never frees: the writer row holds the same blocks
            src, dst = [], []
            for r in cow:
                row = rows[r]
                new = pool.allocate(1, after=row.blocks[-2] if len(row.blocks) > 1 else None, group=g)[0]
                src.append(row.replace_last(new))
                dst.append(new)
            pool.copy_on_write(src, dst, g)
            pool.free(src, g)  # each copied block keeps its other holders (or stays cached if published)
            first = start // B
            fills = [min(B, end - p * B) for p in range(first, num_blocks_for(end, B))]
            for r in writers:
                row = rows[r]
                if n_new:
                    row.append(pool.allocate(n_new, after=row.blocks[-1] if row.blocks else None, group=g))
                row.num_tokens = end
                rt.set_row(r, first)
                pool.mark_written(row.after(first), fills, g)
            for r, w in dup_of.items():
                rows[r] = rows[w].copy()
                pool.incref(rows[r].blocks, g)
                rt.table[r] = rt.table[w]
            view_base[g] = rt.view_base()
            total_src += len(src)
            if g == self._groups[0].group:
                cow0 = (cow, src, dst)
        self._num_tokens = end
        self.last_step_tokens = q
        self._maybe_dups = False
        self._step = _Step(start, end, writers, dup_of, view_base, grad_history=self._grad_history and start > 0)
        pool.events.on_step(self, self._step, *cow0)
        pool.metrics.on_step(self, q, total_src)

    def _find_duplicates(self, key_states: torch.Tensor, value_states: torch.Tensor) -> dict[int, int]:
        """Rows with identical block tables and bit-identical new K/V in this layer -> the first such row."""
        # A cheap fingerprint first (bit-identical rows have equal sums), so distinct rows are not compared pairwise.
        sums = torch.stack([key_states.flatten(1).sum(1), value_states.flatten(1).sum(1)], 1).tolist()
        groups: dict[tuple, list[int]] = {}
        for r in range(self.num_rows):
            tables = tuple(tuple(rt.rows[r].blocks) for rt in self._groups)
            groups.setdefault((tables, *sums[r]), []).append(r)
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
        """A duplicate row turned out different in a later layer: give it its own copy of this step's blocks, in
        every layer group (later layers of any group may differ too)."""
        step, pool = self._step, self.pool
        first = step.start // self.block_size
        with pool.lock:
            for rt in self._groups:
                pool.reserve(len(rt.rows[r].after(first)), rt.group)
            for rt in self._groups:
                row = rt.rows[r]
                old = row.truncate(first)
                row.append(pool.allocate(len(old), after=row.blocks[-1] if row.blocks else None, group=rt.group))
                pool.copy_on_write(old, row.after(first), rt.group)  # earlier layers were identical: exact
                pool.free(old, rt.group)  # still held by the writer row
                rt.set_row(r, first)
        del step.dup_of[r]
        step.writers = sorted(step.writers + [r])
        step.tensors.clear()  # `planned` stays: the quantized stores re-plan with new_step=False
        self._after_change()

    def _tensor(self, step: _Step, rt, kind: str, device: torch.device) -> torch.Tensor:
        """The step's index tensors of one layer group on `device`: "writers" (rows), "write" (slot mapping,
        row-major, `[len(writers) * q]`) and "read" (slots of the tokens the group's layers read, `[batch, n]`)."""
        key = (rt.group, kind, device)
        t = step.tensors.get(key)
        if t is None:
            base = step.view_base.get(rt.group)
            if kind == "writers":
                t = torch.tensor(step.writers, dtype=torch.long)
            elif kind == "write" and base is not None:
                t = torch.arange(step.start, step.end) + base  # consecutive slots
            elif kind == "write":
                t = rt.write_slots(step.writers, step.start, step.end)
            else:
                t = rt.read_slots(rt.window_start(step.start), step.end)
            t = t.to(device)
            step.tensors[key] = t
        return t

    def _plan(self, step: _Step, rt, device: torch.device):
        """The quantized store's `WritePlan` for this step of one group on `device`, built once (rebuilt after
        `_unshare`)."""
        key = (rt.group, "plan", device)
        if key not in step.tensors:
            slots = self._tensor(step, rt, "write", torch.device("cpu"))
            store = self.pool.groups[rt.group].store
            step.tensors[key] = store.plan_write(slots, device, new_step=rt.group not in step.planned,
                                                 start=step.start, num_new=step.end - step.start)
            step.planned.add(rt.group)
        return step.tensors[key]

    def read_layer(self, layer, lo: int, new: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. layer.num_tokens - 1` of every row: `[batch, num_kv_heads, seq_len, head_dim]` each.
        `new` is `(start, key_states, value_states)` of the current step (a quantized store returns those tokens
        in full precision)."""
        end, idx = layer.num_tokens, layer.layer_idx
        rt = self._by_group[layer.group]
        store = self.pool.groups[layer.group].store
        step = self._step
        current = step is not None and step.end == end  # the step computed the view base once for its layers
        base = step.view_base[rt.group] if current else rt.view_base()
        if store.is_quantized:
            first_block = None if base is None else base // self.block_size  # id of block position 0, if extended
            return store.read(idx, rt.table[:, : num_blocks_for(end, self.block_size)], lo, end, first_block, new)
        if base is not None:
            return store.read_view(idx, base + lo, end - lo)
        if current and lo == rt.window_start(step.start):
            slots = self._tensor(step, rt, "read", layer.spec.device)
        else:
            slots = rt.read_slots(lo, end).to(layer.spec.device)
        return store.read_gather(idx, slots)
