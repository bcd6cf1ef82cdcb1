"""What a quantized pool with a byte budget (`BlockPool(max_memory=...)`) checks of its full-precision stages.

A quantized layer group holds each row's partial last block as a full-precision *stage* (`StagingStore`) until the
block fills and is encoded. With `max_memory` the stages are part of the budget: the group's store holds at most
`Store.stage_capacity()` of them (`QuantizedPageStore.budget_split`: one per `ROW_BLOCKS` encoded blocks), so a
step checks, before it changes anything, that the stages it will take are available (`stages_fit`), and the serving
scheduler admits a request only while the running ones' stages (`stages_of_rows`) leave room for it. Pools without a
byte budget, and full-precision ones, have no stage limit: every function here then says yes.
"""

from __future__ import annotations

from hf_pagedkv.errors import PoolExhaustedError, counted


def stages_fit(store, stages: int) -> bool:
    """Whether `store` (a layer group's page store) can hand out `stages` more stages this step."""
    have = store.stages_available() if stages else None
    return have is None or stages <= have


def reserve_error(group, n: int, stages: int, named: bool) -> PoolExhaustedError:
    """The error of a reservation of `n` blocks and `stages` stages `group` cannot serve (`named`: say which layer
    group): its blocks' (`BlockGroup.exhausted_error`), else its stages'."""
    if not group.can_reserve(n):
        return group.exhausted_error(n, named)
    where = f" in its {group.name} layer group" if named else ""
    store = group.store
    return PoolExhaustedError(
        f"BlockPool is full{where}: {counted(stages, 'full-precision stage')} needed, {store.stages_available()} "
        f"of {store.stage_capacity()} available (a quantized pool holds each row's partial last block in full "
        "precision, inside max_memory). Raise max_memory, run fewer rows at once, or release finished caches.")


def step_stages(group, rows, writers: list[int], cow: list[int], start: int, end: int) -> int:
    """Stages a step of `writers` (rows of `rows`, each holding `start` tokens, `end` after the step) takes from
    `group` at most: a copy-on-write row's copy of its staged last block, and each row's last block when the step
    leaves it partial and it holds no stage yet (a new block, or an encoded one a crop reopens). 0 when the group
    has no stage limit."""
    store = group.store
    if store.stages_available() is None:
        return 0
    B, n = group.block_size, len(cow)
    if end % B:
        for r in writers:
            same = start % B and (end - 1) // B == start // B  # the step ends in the row's last block
            if not same or (r not in cow and not store.num_staged(rows[r].blocks[-1:])):
                n += 1
    return n


def copied_stages(group, blocks: list[int]) -> int:
    """Stages a copy of `blocks` of `group` takes (one per staged block)."""
    return group.store.num_staged(blocks)


def compact_within_stages(group, max_blocks: int) -> int:
    """`group.compact(max_blocks)`, or 0 (nothing moved) when the group's staging area has no room for the copies
    of the open blocks it would move (a moved block's stage is copied before the old one is returned)."""
    try:
        return group.compact(max_blocks)
    except PoolExhaustedError:
        if group.store.stage_capacity() is None:
            raise
        return 0


def stage_capacity(pool) -> int | None:
    """The stages each layer group of `pool` holds at most (the least over its groups), or None: no limit."""
    caps = [c for c in (g.store.stage_capacity() for g in pool.groups) if c is not None]
    return min(caps) if caps else None


def stages_of_rows(num_decoding: int, num_prefilling: int) -> int:
    """Stages rows may hold at once in a step: a decoding row one (its open block; the stage of a block it
    completes returns at the next step's start, before that step takes a new one), a prefilling row two (a chunk may
    complete the row's open block and leave a new partial one)."""
    return num_decoding + 2 * num_prefilling
