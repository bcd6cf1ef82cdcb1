"""`BlockTable`: the block ids and token count of one sequence (one batch row of a `PagedCache`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """Which blocks hold a sequence's tokens, in order.

    Token `p` of the sequence lives in block ``blocks[p // block_size]`` at offset ``p % block_size``, i.e. in
    slot ``blocks[p // block_size] * block_size + p % block_size`` of every layer::

        blocks:  [  7  |  8  |  3  ]        block_size = 4, num_tokens = 10
        tokens:   0..3  4..7  8 9 . .       (the last block is partial: 2 free slots)

    Invariant: ``len(blocks) == ceil(num_tokens / block_size)`` once a step is committed (0 blocks at
    `num_tokens == 0`, exactly `k` blocks at `k * block_size` tokens). `num_contiguous` is the length of the
    leading run of consecutive ids (``blocks[j] == blocks[0] + j``); the whole row is one run iff
    ``num_contiguous == len(blocks)``, and then the page store can read it as a view.
    """

    blocks: list[int] = field(default_factory=list)  # block ids in token order; changed by the owning cache only
    num_tokens: int = 0  # tokens written to this row; changed by the owning cache only
    num_contiguous: int = 0  # length of the leading run of consecutive block ids

    @property
    def is_contiguous(self) -> bool:
        return self.num_contiguous == len(self.blocks)

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

    def truncate(self, num_blocks: int) -> list[int]:
        """Keep the first `num_blocks` blocks; return the dropped ids."""
        dropped = self.blocks[num_blocks:]
        del self.blocks[num_blocks:]
        self.num_contiguous = min(self.num_contiguous, num_blocks)
        return dropped

    def copy(self) -> BlockTable:
        """A copy naming the same blocks (the caller increfs them)."""
        return BlockTable(list(self.blocks), self.num_tokens, self.num_contiguous)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed for `num_tokens` tokens: ``ceil(num_tokens / block_size)`` (0 for 0 tokens)."""
    return -(-num_tokens // block_size)
