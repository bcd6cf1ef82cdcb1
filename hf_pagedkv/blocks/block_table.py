"""`BlockTable`: the block ids and token count of one sequence (one batch row of a `PagedCache`) in one layer group."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """Which blocks hold a sequence's tokens, in order, for the layers of one layer group.

    Token `p` of the sequence lives in block ``blocks[p // block_size - num_dropped]`` at offset ``p % block_size``,
    i.e. in slot ``block * block_size + p % block_size`` of every layer of the group::

        blocks:  [  7  |  8  |  3  ]        block_size = 4, num_tokens = 10, num_dropped = 0
        tokens:   0..3  4..7  8 9 . .       (the last block is partial: 2 free slots)

    A sliding-window group frees the blocks that fell out of its window from the front: they are counted by
    `num_dropped` and no longer named (position `j < num_dropped` points at no block)::

        dropped: [  -  |  -  ]  blocks: [ 3 | 9 ]      window 6: tokens 0..7 are out of the window of token 13
        tokens:    0..3  4..7            8..11 12 13

    Invariant: ``len(blocks) + num_dropped == ceil(num_tokens / block_size)`` once a step is committed (0 blocks at
    `num_tokens == 0`, exactly `k` at `k * block_size` tokens). `num_contiguous` is the length of the leading run of
    consecutive ids (``blocks[j] == blocks[0] + j``); the whole row is one run iff ``num_contiguous == len(blocks)``,
    and then the page store can read it as a view.
    """

    blocks: list[int] = field(default_factory=list)  # held block ids in token order; changed by the owning cache only
    num_tokens: int = 0  # tokens written to this row; changed by the owning cache only
    num_contiguous: int = 0  # length of the leading run of consecutive block ids
    num_dropped: int = 0  # leading block positions freed by a sliding window (name no block)
    # retention (hf_pagedkv/retention): block positions a budgeted table may cover, or None; set by the cache's Evictor
    max_positions: int | None = None

    @property
    def is_contiguous(self) -> bool:
        return self.num_contiguous == len(self.blocks)

    @property
    def num_positions(self) -> int:
        """Block positions this row covers, dropped ones included: ``ceil(num_tokens / block_size)``."""
        return self.num_dropped + len(self.blocks)

    def append(self, new_blocks: list[int]) -> None:
        for b in new_blocks:
            if self.num_contiguous == len(self.blocks) and (not self.blocks or b == self.blocks[-1] + 1):
                self.num_contiguous += 1
            self.blocks.append(b)

    def replace_last(self, block: int) -> int:
        """Put `block` in place of the last block (copy-on-write); return the old id."""
        old = self.blocks.pop()
        self.num_contiguous = min(self.num_contiguous, len(self.blocks))
        self.append([block])
        return old

    def truncate(self, num_positions: int) -> list[int]:
        """Keep block positions ``< num_positions``; return the dropped ids (positions already dropped stay so)."""
        keep = num_positions - self.num_dropped
        assert keep >= 0, f"truncate to {num_positions} block positions, but {self.num_dropped} are already dropped"
        dropped = self.blocks[keep:]
        del self.blocks[keep:]
        self.num_contiguous = min(self.num_contiguous, keep)
        return dropped

    def drop_front(self, num_positions: int) -> list[int]:
        """Free block positions ``< num_positions`` (a sliding window moved past them); return the ids let go."""
        n = max(0, min(num_positions - self.num_dropped, len(self.blocks)))
        if n == 0:
            return []
        dropped = self.blocks[:n]
        del self.blocks[:n]
        self.num_dropped += n
        if self.num_contiguous > n:
            self.num_contiguous -= n
        else:  # the leading run ended inside the dropped part: measure the new one
            run = 1 if self.blocks else 0
            while run < len(self.blocks) and self.blocks[run] == self.blocks[0] + run:
                run += 1
            self.num_contiguous = run
        return dropped

    def remove_positions(self, positions: list[int]) -> list[int]:
        """Retention: take held block positions `positions` out of the table (later blocks move up, so their tokens'
        logical positions drop by ``block_size`` each); return the ids let go. The caller fixes `num_tokens`."""
        assert self.num_dropped == 0, "a retention table drops no leading positions"
        gone = set(positions)
        dropped = [b for j, b in enumerate(self.blocks) if j in gone]
        self.blocks = [b for j, b in enumerate(self.blocks) if j not in gone]
        self._count_contiguous()
        return dropped

    def rename(self, mapping: dict[int, int]) -> bool:
        """Compaction moved blocks: name `mapping[b]` in place of each `b` it holds; return whether any changed."""
        if not any(b in mapping for b in self.blocks):
            return False
        self.blocks = [mapping.get(b, b) for b in self.blocks]
        self._count_contiguous()
        return True

    def _count_contiguous(self) -> None:
        run = 1 if self.blocks else 0
        while run < len(self.blocks) and self.blocks[run] == self.blocks[0] + run:
            run += 1
        self.num_contiguous = run

    def after(self, position: int) -> list[int]:
        """Held block ids at positions ``>= position``."""
        return self.blocks[max(0, position - self.num_dropped):]

    def copy(self) -> BlockTable:
        """A copy naming the same blocks (the caller increfs them)."""
        return BlockTable(list(self.blocks), self.num_tokens, self.num_contiguous, self.num_dropped, self.max_positions)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed for `num_tokens` tokens: ``ceil(num_tokens / block_size)`` (0 for 0 tokens)."""
    return -(-num_tokens // block_size)
