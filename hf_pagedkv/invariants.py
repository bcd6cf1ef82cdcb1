"""The pool invariants of DESIGN.md, checked by `BlockPool.check_invariants()` (the tests call it after every step)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .block_table import num_blocks_for
from .errors import InvariantError

if TYPE_CHECKING:
    from .block_pool import BlockPool


def check_pool_invariants(pool: BlockPool) -> None:
    """Raise `InvariantError` naming the first broken invariant of `pool` and the block ids concerned."""
    with pool.lock:
        pool._drain()
        alloc, index = pool.allocator, pool.prefix_index
        free = alloc.free_blocks()
        idle = set(index.idle_blocks()) if index is not None else set()
        rc = [alloc.refcount(b) for b in range(alloc.num_blocks)]
        bad = [b for b in range(alloc.num_blocks) if (b in free) + (b in idle) + (rc[b] > 0) != 1 or rc[b] < 0]
        if bad:
            detail = ", ".join(f"{b}: refcount {rc[b]}, free {b in free}, idle {b in idle}" for b in bad[:10])
            raise InvariantError(f"invariant 1/5 (free xor in use xor cached-idle) broken: {detail}")
        if len(idle) != alloc.num_idle_blocks:
            raise InvariantError(f"invariant 1 broken: {len(idle)} idle blocks in the prefix index, "
                                 f"{alloc.num_idle_blocks} counted by the allocator")
        problems = index.check(free, alloc.num_blocks) if index is not None else []
        if problems:
            raise InvariantError(f"invariant 1 (prefix index) broken: {'; '.join(problems)}")
        stray = sorted(b for b in free if not 0 <= b < alloc.num_blocks)
        if stray:
            raise InvariantError(f"invariant 5 (free queue names only real blocks) broken: {stray[:20]}")
        entries: Counter[int] = Counter()
        for rows in pool._tables.values():
            for row in rows:
                want = num_blocks_for(row.num_tokens, pool.block_size)
                if len(row.blocks) != want:
                    raise InvariantError(
                        f"invariant 3 (table of {row.num_tokens} tokens owns ceil(n/B)={want} blocks) broken: "
                        f"it owns {len(row.blocks)} blocks {row.blocks[-5:]}"
                    )
                if len(set(row.blocks)) != len(row.blocks):
                    dup = [b for b, c in Counter(row.blocks).items() if c > 1]
                    raise InvariantError(f"invariant 3 (a table names a block once) broken for blocks {dup}")
                entries.update(row.blocks)
        wrong = [b for b in range(alloc.num_blocks) if rc[b] != entries.get(b, 0)]
        if wrong:
            detail = ", ".join(f"{b}: refcount {rc[b]} vs {entries.get(b, 0)} entries" for b in wrong[:10])
            kind = "a leak" if not pool._tables else "refcount mismatch"
            raise InvariantError(f"invariant 2 (refcount == live table entries) broken ({kind}): {detail}")
        if pool.store.is_quantized:
            live = {b for b in range(alloc.num_blocks) if rc[b] > 0} | idle
            problems = pool.store.check(live)
            if problems:
                raise InvariantError(f"invariant 6 (quantized store stages) broken: {'; '.join(problems)}")
