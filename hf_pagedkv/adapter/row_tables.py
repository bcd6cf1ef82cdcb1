"""`RowTables`: one layer group's block tables for the rows of one `PagedCache`, and their CPU mirror."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_pagedkv.blocks.block_table import BlockTable, num_blocks_for

# the mirror of no rows, shared: it has no element, so nothing is ever written into it (a growth replaces it)
_NO_ROWS = torch.zeros((0, 0), dtype=torch.long)


class RowTables:
    """The block tables of a cache's batch rows in one layer group, with a tensor mirror for slot arithmetic.

    Args:
        group (`int`): the pool's layer group (`BlockPool.groups`).
        window (`int`, *optional*): the group's sliding window in tokens; `None` for full attention.
        block_size (`int`): tokens per block.
        tier (`int`, *optional*, defaults to 0): the retention tier of a full-attention group (`PyramidKV`,
            `KVzip`'s global layer budgets); every tier spans the same logical positions, and a tier keeping fewer
            tokens than the most holds a suffix of them, aligned to blocks, after dropping the leading positions.

    `table` is `[batch, capacity]` int64 on the CPU, indexed by absolute block position: ``table[r, j]`` is the
    block holding tokens ``j * B .. (j + 1) * B - 1`` of row `r`. Invariants (`check`): every row holds the same
    number of tokens and has dropped the same number of leading positions (rows of a batch move together);
    ``table[r, j] == rows[r].blocks[j - num_dropped]`` for every held position `j`; entries before `num_dropped`
    are stale and never read (a sliding layer reads only its window).

    Exception safety: a change that can fail (a torch call: a new mirror) builds what it needs first and then swaps
    it in with plain Python, so an error or interrupt leaves the rows and the mirror as they were, never out of
    step (`reset(0)`, `restore`, `renamed`: what an offload, a prefetch and a compaction rely on).
    """

    def __init__(self, group: int, window: int | None, block_size: int, tier: int = 0) -> None:
        self.group = group  # index of the pool's layer group; fixed
        self.window = window  # sliding window in tokens, or None; fixed
        self.block_size = block_size  # tokens per block; fixed
        self.tier = tier  # retention tier (0 but for the upper tiers of a `PyramidKV` cache); fixed
        self.rows: list[BlockTable] = []  # one table per batch row; this list object is registered with the pool
        self.table = _NO_ROWS  # mirror [batch, capacity]; changed with `rows` only

    @property
    def num_dropped(self) -> int:
        """Leading block positions no longer held (the same in every row)."""
        return self.rows[0].num_dropped if self.rows else 0

    def window_start(self, num_tokens: int) -> int:
        """First token a layer of this group reads when it holds `num_tokens` before a step: for full attention 0,
        or the first held token of a retention tier that dropped leading positions (`PyramidKV`); the last
        ``window - 1`` tokens for a sliding window (as `DynamicSlidingWindowLayer`)."""
        if self.window is None:
            return self.num_dropped * self.block_size
        return max(0, num_tokens - (self.window - 1))

    def droppable(self, num_tokens: int) -> int:
        """Block positions wholly before the window of a step that starts at `num_tokens` (0 for full attention)."""
        return self.window_start(num_tokens) // self.block_size

    def reset(self, batch: int = 0) -> None:
        """Forget every row (the caller freed their blocks) and start `batch` empty ones. With `batch` 0 it makes
        no torch call, so it cannot fail."""
        table = _NO_ROWS if batch == 0 else torch.zeros((batch, 0), dtype=torch.long)
        self.rows.clear()
        self.rows.extend(BlockTable() for _ in range(batch))
        self.table = table

    @staticmethod
    def mirror_of(rows: list[BlockTable]) -> torch.Tensor:
        """A new mirror `[len(rows), positions]` of `rows` (for `restore`)."""
        table = torch.zeros((len(rows), max((row.num_positions for row in rows), default=0)), dtype=torch.long)
        for r, row in enumerate(rows):
            if row.blocks:
                table[r, row.num_dropped: row.num_positions] = torch.tensor(row.blocks, dtype=torch.long)
        return table

    def restore(self, rows: list[BlockTable], table: torch.Tensor) -> None:
        """Become `rows` (the caller referenced their blocks) with their mirror `table` (`mirror_of(rows)`). Plain
        Python: cannot fail."""
        self.rows[:] = rows
        self.table = table

    def set_row(self, r: int, start_position: int) -> None:
        """Copy row `r`'s block ids from block position `start_position` on into the mirror, growing it if needed."""
        row = self.rows[r]
        end = row.num_positions
        if self.table.is_inference() and not torch.is_inference_mode_enabled():
            # NOTE: made by an earlier call under torch.inference_mode(), the table cannot be written in place
            # outside it; a normal copy (once) lets one cache be used in and out of inference mode, as DynamicCache.
            self.table = self.table.clone()
        if end > self.table.shape[1]:
            grown = torch.zeros((self.table.shape[0], max(end, 2 * self.table.shape[1])), dtype=torch.long)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        start = max(start_position, row.num_dropped)
        if end > start:
            self.table[r, start:end] = torch.tensor(row.blocks[start - row.num_dropped:], dtype=torch.long)

    def renamed(self, mapping: dict[int, int]) -> Callable[[], None]:
        """The pool moves blocks (`BlockPool.compact`): build the mirror naming `mapping[b]` in place of `b` (the
        torch part, which may fail: nothing changes then) and return the function that renames the rows and swaps
        that mirror in (plain Python: cannot fail). The pool builds every cache's mirror before it changes any."""
        table = None
        for r, row in enumerate(self.rows):
            if any(b in mapping for b in row.blocks):
                if table is None:
                    table = self.table.clone()
                renamed = [mapping.get(b, b) for b in row.blocks]
                table[r, row.num_dropped: row.num_positions] = torch.tensor(renamed, dtype=torch.long)

        def commit() -> None:
            for row in self.rows:
                row.rename(mapping)
            if table is not None:
                self.table = table

        return commit

    def select(self, idx: list[int]) -> None:
        """The mirror follows a row selection (`rows` already replaced by the caller)."""
        self.table = self.table[torch.tensor(idx, dtype=torch.long)] if idx else self.table[:0]

    def common_prefix(self, num_tokens: int) -> int:
        """Block positions (absolute) up to which every row names the same blocks (dropped positions count as
        common, since no row holds them)."""
        nblk, lo = num_blocks_for(num_tokens, self.block_size), self.num_dropped
        table = self.table[:, lo:nblk]
        same = (table == table[:1]).all(0).tolist()  # held positions where every row names the same block
        return lo + (same.index(False) if False in same else nblk - lo)

    def view_base(self) -> int | None:
        """For a single row whose held blocks are consecutive: the slot of token 0 if the blocks extended
        backwards (token `p` is in slot ``view_base + p``), else None."""
        if len(self.rows) != 1 or not self.rows[0].blocks or not self.rows[0].is_contiguous:
            return None
        row = self.rows[0]
        return (row.blocks[0] - row.num_dropped) * self.block_size

    def view_rows(self) -> tuple[int, int] | None:
        """For several rows that each hold consecutive blocks, the rows evenly spaced (row `r`'s first held block is
        row 0's plus ``r * stride``, ``stride`` at least the blocks a row holds): ``(first, stride)`` with `first`
        the block position 0 of row 0 would have (token `p` of row `r` is in slot ``(first + r * stride) *
        block_size + p``); else None. Laid out so by `BlockGroup.allocate_rows`."""
        rows = self.rows
        if len(rows) < 2 or not rows[0].blocks or not rows[1].blocks:
            return None
        b0, n = rows[0].blocks[0], len(rows[0].blocks)
        stride = rows[1].blocks[0] - b0
        if stride < n:  # rows that overlap, share blocks (stride 0) or run backwards
            return None
        for r, row in enumerate(rows):
            if not row.is_contiguous or not row.blocks or row.blocks[0] != b0 + r * stride:
                return None
        return b0 - rows[0].num_dropped, stride

    def write_slots(self, writers: list[int], start: int, end: int) -> torch.Tensor:
        """The slot mapping of tokens ``start .. end - 1`` of rows `writers`, row-major `[len(writers) * q]`."""
        B = self.block_size
        pos = torch.arange(start, end)
        blocks = self.table[torch.tensor(writers)][:, pos // B]  # [writers, q]
        return (blocks * B + pos % B).reshape(-1)  # [writers * q]

    def check(self) -> list[str]:
        """Problems (empty when fine): rows out of step with each other, or the mirror out of step with the rows."""
        problems = []
        if len({(row.num_tokens, row.num_dropped) for row in self.rows}) > 1:
            problems.append("rows hold different numbers of tokens or dropped blocks")
        if self.table.shape[0] != len(self.rows):
            problems.append(f"mirror has {self.table.shape[0]} rows for {len(self.rows)} tables")
            return problems
        for r, row in enumerate(self.rows):
            held = self.table[r, row.num_dropped: row.num_positions].tolist()
            if held != row.blocks:
                problems.append(f"row {r}: mirror {held[-5:]} != table {row.blocks[-5:]}")
        return problems
