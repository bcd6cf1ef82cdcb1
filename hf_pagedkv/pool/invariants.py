"""The pool invariants, checked per layer group by `BlockGroup.check_invariants()`, from
`BlockPool.check_invariants()` (the tests call it after every step; a `debug=True` cache after every change). Each
is stated where its state lives (1-6, 8, 10: `BlockGroup`; 7: `PagedCache`; 9: `HostTiers`; 11: `OwnerRegistry`);
this is the index, with what each check covers. Each error names its number:

1. every block is in exactly one state: free, in use (refcount >= 1) or cached-idle (published, refcount 0); the
   prefix index is consistent (hash <-> block maps inverse) and names no free block;
2. `refcount[b]` equals the live table entries naming `b`, plus one for the pad block (the pool's own reference;
   so with no live table, no block but the pad block is in use: no leak);
3. a table holding `n` tokens covers ``ceil(n / block_size)`` block positions (a sliding-window table drops only
   positions wholly before its window) and names a block once, except the pad block, which it names only at
   leading positions (whole blocks of left padding); a budgeted table (a retention policy's, `max_positions`)
   covers at most the positions of its budget;
4. quantized pools: a full block is encoded once, since it was last freed or reopened by a crop (the one case
   of a second encode);
5. the free queue names only real blocks;
6. quantized pools: every stage and sink stage is owned by exactly one live block, and none is lost;
7. a cache's block tables equal their tensor mirror (checked by `PagedCache.check_invariants`);
8. the written-slot counter agrees with the tables;
9. the host tier (checked by `HostTiers.check`): each host id in one state, free + held + cached equals its size,
   a cache's K/V in one tier, each host store's layout whole (none, or every tensor of a block export);
10. the pad block (`BlockGroup.pad_block`, once reserved): in use (held by the pool), never published or free,
   holding no token (fill 0), and never written: its storage still holds the zeros it was reserved with, in every
   layer (`store.check_zero_blocks`; a quantized store keeps it encoded, without stage or sink stage).
11. the owner registry (`OwnerRegistry.check`): last uses, busy marks and swap hooks name live owners only.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.errors import InvariantError

if TYPE_CHECKING:
    from hf_pagedkv.pool.block_group import BlockGroup


def check_group_invariants(group: BlockGroup, tiered: bool = False) -> None:
    """Raise `InvariantError` naming the first broken invariant of one layer group and the block ids concerned.
    `tiered`: the pool's full-attention layers are split into retention tiers (any tier may then hold a suffix).
    The caller holds the pool's lock and has drained pending releases."""
    alloc, index, B, pad = group.allocator, group.prefix_index, group.block_size, group.pad_block
    where = "" if group.index == 0 else f" [{group.name} group]"
    free = alloc.free_blocks()
    idle = set(index.idle_blocks()) if index is not None else set()
    rc = [alloc.refcount(b) for b in range(alloc.num_blocks)]
    bad = [b for b in range(alloc.num_blocks) if (b in free) + (b in idle) + (rc[b] > 0) != 1 or rc[b] < 0]
    if bad:
        detail = ", ".join(f"{b}: refcount {rc[b]}, free {b in free}, idle {b in idle}" for b in bad[:10])
        raise InvariantError(f"invariant 1/5 (free xor in use xor cached-idle) broken{where}: {detail}")
    if len(idle) != alloc.num_idle_blocks:
        raise InvariantError(f"invariant 1 broken{where}: {len(idle)} idle blocks in the prefix index, "
                             f"{alloc.num_idle_blocks} counted by the allocator")
    problems = index.check(free, alloc.num_blocks) if index is not None else []
    if problems:
        raise InvariantError(f"invariant 1 (prefix index) broken{where}: {'; '.join(problems)}")
    stray = sorted(b for b in free if not 0 <= b < alloc.num_blocks)
    if stray:
        raise InvariantError(f"invariant 5 (free queue names only real blocks) broken{where}: {stray[:20]}")
    entries: Counter[int] = Counter()
    for rows in group.tables.values():
        for row in rows:
            want = num_blocks_for(row.num_tokens, B)
            if row.num_positions != want:
                raise InvariantError(
                    f"invariant 3 (table of {row.num_tokens} tokens owns ceil(n/B)={want} blocks) broken{where}: "
                    f"it owns {row.num_positions} blocks {row.blocks[-5:]}"
                    + (f" ({row.num_dropped} dropped by the window)" if row.num_dropped else "")
                )
            # a sliding window of w keeps tokens >= n - (w - 1) readable: only blocks wholly before them may go
            # (a retention tier keeping fewer tokens than the widest holds a suffix of the tables' span: it may
            # drop all but its last position)
            if group.window is not None:
                may_drop = max(0, row.num_tokens - group.window + 1) // B
            else:
                may_drop = max(0, want - 1) if tiered else 0
            if row.num_dropped > may_drop:
                raise InvariantError(
                    f"invariant 3 (only blocks outside the window are dropped) broken{where}: a table of "
                    f"{row.num_tokens} tokens dropped {row.num_dropped} blocks, at most {may_drop} allowed"
                )
            if row.max_positions is not None and row.num_positions > row.max_positions:
                raise InvariantError(
                    f"invariant 3 (a budgeted table owns at most its budget's blocks) broken{where}: a table of "
                    f"{row.num_tokens} tokens owns {row.num_positions} blocks, its retention budget {row.max_positions}"
                )
            n_pad = next((j for j, b in enumerate(row.blocks) if b != pad), len(row.blocks))  # leading pad entries
            real = row.blocks[n_pad:]
            if len(set(real)) != len(real):
                dup = [b for b, c in Counter(real).items() if c > 1]
                raise InvariantError(f"invariant 3 (a table names a block once) broken{where} for blocks {dup}")
            if pad is not None and pad in real:
                raise InvariantError(f"invariant 3 (a table names the pad block only at leading positions) "
                                     f"broken{where}: {row.blocks[:8]}")
            entries.update(row.blocks)
    if pad is not None:
        entries[pad] += 1  # the pool's own reference
    wrong = [b for b in range(alloc.num_blocks) if rc[b] != entries.get(b, 0)]
    if wrong:
        detail = ", ".join(f"{b}: refcount {rc[b]} vs {entries.get(b, 0)} entries" for b in wrong[:10])
        kind = "a leak" if not group.tables else "refcount mismatch"
        raise InvariantError(f"invariant 2 (refcount == live table entries) broken{where} ({kind}): {detail}")
    # the slots written into blocks in use: at least what the tables hold (more only after a crop into a block
    # another cache still holds: those slots stay written until the block is freed), at most the blocks' slots
    filled, counted = group.num_filled_slots(), alloc.num_filled_slots
    if not filled <= counted <= alloc.num_used_blocks * B:
        raise InvariantError(f"invariant 8 (counters agree with the tables) broken{where}: {counted} written slots "
                             f"counted, {filled} held by the tables, {alloc.num_used_blocks * B} in blocks in use")
    if pad is not None:
        problems = [] if 0 <= pad < alloc.num_blocks else [f"pad block {pad} is not a block of the group"]
        if not problems:
            if rc[pad] < 1 or pad in free or pad in idle or (index is not None and pad in index):
                problems.append(f"pad block {pad} must be in use and unpublished (refcount {rc[pad]}, free "
                                f"{pad in free}, published {index is not None and pad in index})")
            if alloc.fill(pad):
                problems.append(f"pad block {pad} counts {alloc.fill(pad)} written slots, it holds none")
            problems += group.store.check_zero_blocks([pad])
        if problems:
            raise InvariantError(f"invariant 10 (the pad block: held by the pool, never written or published) "
                                 f"broken{where}: {'; '.join(problems)}")
    if group.store.is_quantized:
        live = {b for b in range(alloc.num_blocks) if rc[b] > 0} | idle
        problems = group.store.check(live)  # [(invariant number, text)]
        for number, what in ((4, "a full block is encoded once"), (6, "quantized store stages")):
            texts = [text for n, text in problems if n == number]
            if texts:
                raise InvariantError(f"invariant {number} ({what}) broken{where}: {'; '.join(texts)}")
