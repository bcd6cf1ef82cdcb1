"""`WindowRealign`: a hybrid model's sliding-window layer groups follow an eviction of its full-attention layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_pagedkv.errors import counted
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.adapter.fresh_rows import install_fresh_rows

if TYPE_CHECKING:  # type-only: the owner is a CacheRetention, which imports the evictor, which imports this
    from hf_pagedkv.adapter.row_tables import RowTables


class WindowRealign:
    """How the sliding-window layer groups of one cache follow an eviction that leaves every row `new_held` of its
    `held` logical tokens (a retention policy on a hybrid model such as Gemma 2/3 or gpt-oss).

    A retention policy acts on the full-attention layers; a sliding-window layer keeps reading exactly its last
    ``window - 1`` tokens. Every layer group's table spans the same logical positions (one step planner, one token
    count per cache), so after an eviction of ``n = held - new_held`` tokens a sliding group's last
    ``m = min(held, window - 1)`` tokens must sit at the logical positions ``new_held - m .. new_held - 1``; the
    sliding layers' mask offset adds the `n` evicted tokens back (`PagedLayer.get_mask_sizes`), so transformers'
    sliding mask still sees their true positions. Two ways, per group:

    - *shift* (no tensor touched): `n` is whole blocks and the group's rows hold no block at or before the last
      position the eviction frees (once the blocks wholly before the window are freed), so every held block moves
      ``n / block_size`` positions up::

          full:    [ s | a | b | c | d ]  -> drop a, b ->  [ s | c | d ]           (block_size 4, n = 8)
          sliding: [ - | - | - | c'| d']  ------------->   [ - | c'| d']           (positions 0..2 before 0..4)

    - *copy*: otherwise the window is copied into fresh blocks at its new positions. The slots before it in its
      first block are never read (a sliding layer reads from its window's start, and a crop may not go below what
      the eviction kept, `Evictor.check_crop`); they hold copies of the window's first token, so they are finite and
      leave a quantized block's scales those of the window's own tokens.

    Use: construct (validates), `reserve` with the other blocks of the eviction (all or nothing), then `apply` before
    the full-attention tables change.

    Args:
        cache: the `RetentionOwner` (its `sliding_tables`, `sliding_layers`, `read_layer`, `pool`, `block_size`,
            `policy`).
        held (`int`): logical tokens every row holds before the eviction.
        new_held (`int`): logical tokens it holds after.
        dropped (`list[int]`, *optional*): the block positions a block-level eviction frees (`SinkWindow`); None for
            a compaction, which rewrites every position.

    Raises:
        ValueError: `new_held` is below the ``min(held, window - 1)`` tokens a sliding group's layers read: the
            eviction would cut into their window (nothing changed).
    """

    def __init__(self, cache, held: int, new_held: int, dropped: list[int] | None = None) -> None:
        self.cache = cache  # fixed
        self.held, self.new_held = held, new_held  # fixed
        B = cache.block_size
        n = held - new_held
        self.shifts: list[RowTables] = []  # groups whose blocks move up by n / B positions
        self.copies: list[tuple[RowTables, dict[tuple, list[int]]]] = []  # (group, its rows by table) to copy
        for rt in cache.sliding_tables():
            if not rt.rows:
                continue
            m = min(held, rt.window - 1)
            if new_held < m:
                raise ValueError(
                    f"retention={cache.policy!r} would keep {counted(new_held, 'token')} per row, but this "
                    f"model's sliding-window layers (window {rt.window}) read the last {m}: on a hybrid model the "
                    f"full-attention layers must keep at least window - 1 = {rt.window - 1} tokens. Use a larger "
                    "budget or window, or a smaller compression_ratio. Nothing was evicted.")
            # a shift needs whole blocks and no held block at or before the last position the eviction frees (the
            # blocks wholly before the window are let go first: the step planner would free them at this step)
            lowest = n // B if dropped is None else max(dropped) + 1
            if n % B == 0 and max(rt.num_dropped, rt.droppable(held)) >= lowest:
                self.shifts.append(rt)
            else:
                self.copies.append((rt, self._writers(rt)))

    @property
    def first_position(self) -> int | None:
        """The lowest logical block position a copied group writes (None without copies): blocks from there on no
        longer hold their original positions' tokens."""
        if not self.copies:
            return None
        return min((self.new_held - min(self.held, rt.window - 1)) // self.cache.block_size for rt, _ in self.copies)

    def needs(self) -> dict[int, int]:
        """Fresh blocks per layer group the copies take (reserve them with the eviction's own)."""
        return {rt.group: self._num_blocks(rt) * len(by_table) for rt, by_table in self.copies}

    def _num_blocks(self, rt: RowTables) -> int:
        """Fresh blocks one distinct row of copied group `rt` takes (its window's positions after the eviction)."""
        B = self.cache.block_size
        return num_blocks_for(self.new_held, B) - (self.new_held - min(self.held, rt.window - 1)) // B

    def apply(self) -> dict[int, list[int]]:
        """Move every sliding group to the new logical positions; returns, per copied group, the block ids let go
        (a shift first frees the blocks wholly before its window, as the step planner would at this step, unreported
        like the planner's)."""
        d = (self.held - self.new_held) // self.cache.block_size
        for rt in self.shifts:
            before = rt.droppable(self.held)
            for r, row in enumerate(rt.rows):
                self.cache.pool._free(row.drop_front(before), rt.group)
                row.num_dropped -= d
                row.num_tokens = self.new_held
                rt.set_row(r, 0)
        return {rt.group: self._copy(rt, by_table) for rt, by_table in self.copies}

    @staticmethod
    def _writers(rt: RowTables) -> dict[tuple, list[int]]:
        """Rows with identical tables (beams before they diverge) are copied once and keep sharing the copy."""
        by_table: dict[tuple, list[int]] = {}
        for r, row in enumerate(rt.rows):
            by_table.setdefault(tuple(row.blocks), []).append(r)
        return by_table

    def _copy(self, rt: RowTables, by_table: dict[tuple, list[int]]) -> list[int]:
        """Copy the group's last ``m`` tokens to the logical positions ``new_held - m ..`` in fresh blocks (their
        first block from its slot 0: the leading slots repeat the first token); free the old blocks."""
        cache, held, new = self.cache, self.held, self.new_held
        pool, B, g = cache.pool, cache.block_size, rt.group
        m = min(held, rt.window - 1)
        first = (new - m) // B
        lead = new - m - first * B  # slots before the window in its first block
        nb = self._num_blocks(rt)
        writers = [members[0] for members in by_table.values()]
        fresh: dict[int, list[int]] = {}
        for w in writers:
            fresh[w] = pool._allocate(nb, after=fresh[writers[0]][-1] if fresh else None, group=g)
        local = torch.arange(new - first * B)
        blocks = torch.tensor([fresh[w] for w in writers], dtype=torch.long)  # [writers, nb]
        slots = (blocks[:, local // B] * B + local % B).reshape(-1)  # [writers * (new - first * B)], row-major
        rows_idx = torch.tensor(writers)
        group, targets = pool.groups[g], {}
        for layer in cache.sliding_layers():
            if layer.group != g or not layer.is_initialized:
                continue
            k, v = cache.read_layer(layer, held - m)  # [batch, num_kv_heads, m, head_dim] each
            if len(writers) < k.shape[0]:
                k, v = k.index_select(0, rows_idx.to(k.device)), v.index_select(0, rows_idx.to(v.device))
            if lead:
                k = torch.cat([k[:, :, :1].expand(-1, -1, lead, -1), k], 2)
                v = torch.cat([v[:, :, :1].expand(-1, -1, lead, -1), v], 2)
            device = layer.spec.device
            if device not in targets:  # (a quantized store encodes the copied tokens in their new blocks)
                targets[device] = group.prepare_write(slots, device, new_step=not targets, start=first * B,
                                                      num_new=new - first * B)
            group.write(layer.layer_idx, targets[device], k.contiguous(), v.contiguous())
        fills = [min(B, new - (first + j) * B) for j in range(nb)]
        return install_fresh_rows(pool, rt, by_table, fresh, fills, first, new)
