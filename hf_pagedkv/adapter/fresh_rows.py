"""`install_fresh_rows`: rows of one layer group move to freshly written blocks (a compaction or a window copy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_pagedkv.blocks.block_table import BlockTable

if TYPE_CHECKING:  # type-only
    from hf_pagedkv.adapter.row_tables import RowTables
    from hf_pagedkv.pool.block_pool import BlockPool


def install_fresh_rows(pool: BlockPool, rt: RowTables, by_table: dict[tuple, list[int]], fresh: dict[int, list[int]],
                       fills: list[int], num_dropped: int, num_tokens: int) -> list[int]:
    """Every row of `rt` now names the fresh blocks its writer row filled and lets go of its old ones.

    Args:
        pool (`BlockPool`): owns the blocks of `rt.group`.
        rt (`RowTables`): the group's tables; each row is replaced (and its mirror row rewritten).
        by_table (`dict[tuple, list[int]]`): rows with identical old tables, the first of each the writer; the
            others share the writer's fresh blocks (one more reference each).
        fresh (`dict[int, list[int]]`): writer row -> its fresh block ids, written already.
        fills (`list[int]`): tokens written into each fresh block (`BlockGroup.mark_written`).
        num_dropped (`int`): leading block positions the new tables no longer hold.
        num_tokens (`int`): tokens each new table spans.

    Returns:
        `list[int]`: the old block ids let go (with repeats for shared ones), for the `evict` event.
    """
    g, freed = rt.group, []
    for members in by_table.values():
        new = fresh[members[0]]
        pool.groups[g].mark_written(new, fills)
        for i, r in enumerate(members):
            old = rt.rows[r]
            freed += old.blocks
            pool._free(old.blocks, g)
            row = BlockTable(num_dropped=num_dropped)
            row.append(new)
            row.num_tokens = num_tokens
            if i:
                pool.groups[g].incref(new)
            rt.rows[r] = row
            rt.set_row(r, 0)
    return freed
