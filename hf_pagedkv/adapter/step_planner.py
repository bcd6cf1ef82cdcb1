"""`StepPlanner`: extend a cache's block tables for one forward step, in every layer group, all or nothing."""

from __future__ import annotations

from collections import Counter

import torch

from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.adapter.step_plan import StepPlan
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.pool.staging_budget import copied_stages, step_stages


# Tokens of free blocks a batch prefill leaves after each full-precision row for its decode steps (`_row_stride`):
# the batch is then read as a view, not gathered, for that many new tokens (at most the prompt's length again). The
# blocks stay free (any allocation may take them), so they cost reserved storage only, at most this per row.
ROW_HEADROOM_TOKENS = 256


class StepPlanner:
    """Plans and applies the block-table changes of a forward step. A step looks like this for a row of block
    size 4::

        before (start=6):  [ b7: t0 t1 t2 t3 | b8: t4 t5 .  . ]
        new tokens q=3:                                 t6 t7 | t8 -> needs one new block
        after  (end=9):    [ b7: t0 t1 t2 t3 | b8: t4 t5 t6 t7 | b9: t8 .  .  . ]

    `begin` first lets a sliding-window group free the blocks wholly before this step's window, finds rows whose
    K/V are identical (stored once), plans the new blocks and the copy-on-write of shared partial last blocks per
    group, reserves them all at once (the only part that can fail, before anything else changes), then applies the
    plan to the cache's `RowTables` and returns it as an immutable `StepPlan`.

    Args:
        pool (`BlockPool`): the pool the tables' blocks belong to. The caller holds `pool.lock`.
    """

    def __init__(self, pool) -> None:
        self.pool = pool  # fixed
        self.block_size = pool.block_size  # fixed

    def begin(self, groups: list[RowTables], key_states: torch.Tensor, value_states: torch.Tensor, start: int,
              maybe_dups: bool = False, grad_history: bool = False, padding: list[int] | None = None) -> StepPlan:
        """Extend every row of every group from `start` by this step's tokens.

        Args:
            groups (`list[RowTables]`): the cache's tables, one per layer group, each with `batch` rows.
            key_states, value_states (`torch.Tensor` of shape `[batch, num_kv_heads, q, head_dim]`): the first
                layer's new K/V (compared to find duplicate rows).
            start (`int`): tokens each row holds.
            maybe_dups (`bool`): rows were just forked, so a one-token step may have duplicate rows too.
            grad_history (`bool`): some cached tokens were written from K/V that required grad.
            padding (`list[int]`, *optional*): leading padding tokens of each row (`PagedCache.set_padding`). A new
                block position wholly inside a row's padding and wholly written by this step names the group's pad
                block (`BlockPool._ensure_pad_block`) instead of a block of its own; the plan's `pad_skip` says which
                tokens are then not stored::

                    padding 9, B = 4:  [ pad | pad | b5: p8 t9 t10 t11 | b6: ... ]   p: padding (masked)
                                        p0..3  p4..7  stored normally: the block of the row's first real token

        Raises:
            PoolExhaustedError: a fixed pool cannot hold the step's blocks (nothing changed).
        """
        batch, q = key_states.shape[0], key_states.shape[2]
        B, pool = self.block_size, self.pool
        end = start + q
        # A sliding group lets go of the blocks wholly before this step's window first: no layer reads them again.
        # NOTE: so a crop can go back at most one step's tokens (what assisted decoding does).
        for rt in groups:
            drop = rt.droppable(start)
            if drop > rt.num_dropped:
                for row in rt.rows:
                    pool._free(row.drop_front(drop), rt.group)
        find = batch > 1 and (q > 1 or maybe_dups)
        dup_of = self.find_duplicates(groups, key_states, value_states, padding) if find else {}
        writers = [r for r in range(batch) if r not in dup_of]
        # Plan: new blocks per writer, and which writers must copy a shared partial last block first, per group.
        first_new = num_blocks_for(start, B)  # the first new block position
        n_new = num_blocks_for(end, B) - first_new
        # new positions of each row that name the pad block: wholly padding, wholly written now, and continuing the
        # row's leading run of pad entries (a chunked prefill may have stored a block of padding partly written)
        pads = [0] * batch if padding is None else [
            max(0, min(p, end) // B - first_new) if self._only_padding(groups, r) else 0 for r, p in enumerate(padding)]
        padded = any(pads[r] for r in writers)
        plans = []
        for rt in groups:
            rows, cow = rt.rows, []
            if start % B:
                group = pool.groups[rt.group]
                dropped = Counter(rows[r].blocks[-1] for r in dup_of)  # duplicates let go of their blocks
                holders: dict[int, int] = {}
                for r in writers:
                    last = rows[r].blocks[-1]
                    holders.setdefault(last, group.refcount(last) - dropped[last])
                    # another holder still reads it, or the prefix index names its content: copy before writing
                    if holders[last] > 1 or pool.groups[rt.group].is_published(last):
                        cow.append(r)
                        holders[last] -= 1
            need = sum(n_new - pads[r] for r in writers) + len(cow)
            if padded and pool.groups[rt.group].pad_block is None:
                need += 1  # the pad block itself, reserved once
            stages = step_stages(pool.groups[rt.group], rows, writers, cow, start, end)  # quantized max_memory
            plans.append((rt, cow, need, self._row_stride(rt, writers, n_new, padded), stages))
        for rt, _, need, _, stages in plans:  # all groups or none: a group that cannot serve raises before any change
            if not pool._can_reserve(need, rt.group, stages):
                pool._reserve(need, rt.group, stages=stages)  # raises PoolExhaustedError; nothing changed yet
        for rt, _, need, stride, stages in plans:
            pool._reserve(need, rt.group, rows=len(writers), run=len(writers) * stride if stride else 0, stages=stages)
        # Apply.
        view_base, view_rows = {}, {}
        total_src, cow0 = 0, ((), (), ())
        first = start // B
        fills = [min(B, end - p * B) for p in range(first, num_blocks_for(end, B))]
        for rt, cow, _, stride, _ in plans:
            g, rows = rt.group, rt.rows
            placed = pool._allocate_rows(len(writers), n_new, stride, g) if stride else None  # evenly laid out rows
            placed = dict(zip(writers, placed)) if placed is not None else {}
            for r in dup_of:
                pool._free(rows[r].blocks, g)  # never frees: the writer row holds the same blocks
            src, dst = [], []
            for r in cow:
                row = rows[r]
                new = pool._allocate(1, after=row.blocks[-2] if len(row.blocks) > 1 else None, group=g)[0]
                src.append(row.replace_last(new))
                dst.append(new)
            pool.groups[g].copy_on_write(src, dst)
            pool._free(src, g)  # each copied block keeps its other holders (or stays cached if published)
            written, filled = [], []  # blocks of the writers' positions from `first` on (not the pad block), fills
            copied = set(cow)
            pad = pool._ensure_pad_block(g) if padded else None
            for r in writers:
                row = rows[r]
                if pads[r]:
                    row.append([pad] * pads[r])
                    pool.groups[g].incref([pad] * pads[r])
                if r in placed:
                    row.append(placed[r])
                elif n_new > pads[r]:
                    row.append(pool._allocate(n_new - pads[r], after=row.blocks[-1] if row.blocks else None, group=g))
                row.num_tokens = end
                if n_new or r in copied:  # NOTE: a decode step inside a block leaves the row's block ids as they were
                    rt.set_row(r, first)
                for b, f in zip(row.after(first), fills):
                    if b != pad:
                        written.append(b)
                        filled.append(f)
            pool.groups[g].mark_written(written, filled)
            for r, w in dup_of.items():
                rows[r] = rows[w].copy()
                pool.groups[g].incref(rows[r].blocks)
                rt.table[r] = rt.table[w]
            view_base[g] = rt.view_base()
            view_rows[g] = rt.view_rows()
            total_src += len(src)
            if rt is groups[0]:
                cow0 = (tuple(cow), tuple(src), tuple(dst))
        lo = first_new * B - start  # the step's first token of a new block position
        pad_skip = tuple((lo, lo + n * B) for n in pads) if any(pads) else ()
        return StepPlan(start, end, tuple(writers), dup_of, view_base, view_rows,
                        grad_history=grad_history and start > 0, cow_rows=cow0[0], cow_src=cow0[1], cow_dst=cow0[2],
                        num_cow_copies=total_src, num_rows=batch, pad_skip=pad_skip)

    def _row_stride(self, rt: RowTables, writers: list[int], n_new: int, padded: bool) -> int:
        """Blocks between the first blocks of consecutive rows when this step should lay its rows out evenly
        (`BlockGroup.allocate_rows`), else 0. Only a full-precision group's first step of several new rows without
        pad blocks (a batch prefill) does: each row gets `n_new` blocks and ``min(n_new, ROW_HEADROOM_TOKENS //
        block_size)`` (at least 1) free blocks after them, which its decode blocks take (`allocate` prefers the id
        after a row's last block), so the whole batch stays one strided view of the pool (`RowTables.view_rows`)
        until a row outgrows its room; then its blocks come from anywhere, and the batch is gathered as before."""
        if (len(writers) < 2 or not n_new or padded or self.pool.groups[rt.group].is_quantized
                or any(rt.rows[r].blocks or rt.rows[r].num_dropped for r in writers)):
            return 0
        return n_new + min(n_new, max(1, ROW_HEADROOM_TOKENS // self.block_size))

    def _only_padding(self, groups: list[RowTables], r: int) -> bool:
        """Whether every block row `r` holds, in every group, is the group's pad block (or it holds none)."""
        return all(b == self.pool.groups[rt.group].pad_block for rt in groups for b in rt.rows[r].blocks)

    def find_duplicates(self, groups: list[RowTables], key_states: torch.Tensor, value_states: torch.Tensor,
                        padding: list[int] | None = None) -> dict[int, int]:
        """Rows with identical block tables, padding and bit-identical new K/V in this layer -> the first such
        row."""
        # A cheap fingerprint first (bit-identical rows have equal sums), so distinct rows are not compared pairwise.
        sums = torch.stack([key_states.flatten(1).sum(1), value_states.flatten(1).sum(1)], 1).tolist()
        candidates: dict[tuple, list[int]] = {}
        for r in range(key_states.shape[0]):
            tables = tuple(tuple(rt.rows[r].blocks) for rt in groups)
            pad = None if padding is None else padding[r]
            candidates.setdefault((tables, pad, *sums[r]), []).append(r)
        dup_of = {}
        for members in candidates.values():
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

    def unshare(self, groups: list[RowTables], plan: StepPlan, r: int) -> StepPlan:
        """A duplicate row turned out different in a later layer: give it its own copy of this step's blocks, in
        every layer group (later layers of any group may differ too). Returns the plan with `r` a writer.

        Raises:
            PoolExhaustedError: a fixed pool cannot hold the copies (nothing changed).
        """
        pool, first = self.pool, plan.start // self.block_size

        def own(rt: RowTables) -> list[int]:  # the step's blocks of row r that it copies (the pad block it shares)
            pad = pool.groups[rt.group].pad_block
            return [b for b in rt.rows[r].after(first) if b != pad]

        for rt in groups:  # all groups or none
            stages = copied_stages(pool.groups[rt.group], own(rt))  # a staged block's copy takes a stage
            if not pool._can_reserve(len(own(rt)), rt.group, stages):
                pool._reserve(len(own(rt)), rt.group, stages=stages)  # raises
        for rt in groups:
            pool._reserve(len(own(rt)), rt.group)
        for rt in groups:
            row, copied = rt.rows[r], own(rt)
            old = row.truncate(first)
            pads = old[: len(old) - len(copied)]  # leading entries naming the pad block: shared, not copied
            row.append(pads)
            pool.groups[rt.group].incref(pads)
            new = pool._allocate(len(copied), after=row.blocks[-1] if row.blocks else None, group=rt.group)
            row.append(new)
            pool.groups[rt.group].copy_on_write(copied, new)  # earlier layers were identical: exact
            pool._free(old, rt.group)  # still held by the writer row
            rt.set_row(r, first)
        return plan.with_writer(r)


__all__ = ["StepPlanner"]
