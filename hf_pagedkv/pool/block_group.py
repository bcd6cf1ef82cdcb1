"""`BlockGroup`: the blocks of one layer group of a pool -- ids and refcounts, their storage, prefix index, tables."""

from __future__ import annotations

from collections.abc import Callable

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.page_store import PageStore
from hf_pagedkv.blocks.prefix_index import PrefixIndex
from hf_pagedkv.storage.quantized_store import QuantizedPageStore


class BlockGroup:
    """The blocks of one layer group: layers that keep the same history (full attention; one sliding window).

    As in vLLM's hybrid KV-cache manager, one block id of a group names the same slot range in every layer of that
    group, so a sequence needs one block table per group. Each group has its own ids, allocator and storage: a
    sliding-window group frees the blocks that leave its window, so its storage stays the size of the windows
    while a full-attention group grows with the context.

    Invariants (checked by `BlockPool.check_invariants`, per group): every id is free, in use or cached-idle;
    `refcount[b]` equals the live table entries naming `b` among the tables registered here; a table holding `n`
    tokens covers ``ceil(n / block_size)`` block positions, of which a full-attention table holds all (a retention
    tier > 0 may drop leading positions, keeping at least the last) and a sliding table drops only positions wholly
    before its window.

    The pad block (`pad_block`, once reserved by `BlockPool.ensure_pad_block`): one block of zeros that every whole
    block of left padding names (as vLLM's null block). The pool holds one reference to it, so it is never freed
    (its refcount is the table entries naming it plus one); it is never written, never published and holds no
    token (fill 0).
    """

    def __init__(self, index: int, window: int | None, block_size: int, quant: QuantConfig, debug: bool,
                 prefix_caching: bool, tier: int = 0) -> None:
        self.index = index  # position in `BlockPool.groups`; fixed
        self.window = window  # sliding window in tokens, or None for full attention; fixed
        # retention tier (`PyramidKV`): 0, or the tier of full-attention layers this group holds; fixed. A tier > 0
        # holds fewer tokens than tier 0 and drops the leading block positions before them (`RowTables`)
        self.tier = tier
        self.block_size = block_size  # tokens per block; fixed
        self.allocator = BlockAllocator()  # block ids and refcounts of this group
        self.store = (QuantizedPageStore(block_size, quant, debug=debug) if quant.is_quantized
                      else PageStore(block_size, debug=debug))  # the tensors of this group's layers
        self.prefix_index = PrefixIndex() if prefix_caching else None  # full-block hashes -> blocks, or None
        self.tables: dict[int, list[BlockTable]] = {}  # owner token -> that cache's rows in this group
        # owner token -> callback(group, {old: new}) that prepares the renaming of moved blocks in its tables and
        # returns the function doing it (a weak method, see `BlockPool.add_rows`), if any
        self.movers: dict[int, Callable[[], Callable[[int, dict[int, int]], Callable[[], None]] | None]] = {}
        self.num_cow_copies = 0  # blocks copied before a write; changed by `BlockPool.copy_on_write` only
        # the pad block (zeros, never written or freed), or None until first needed; set by
        # `BlockPool.ensure_pad_block`, renamed by `BlockPool.compact` only
        self.pad_block: int | None = None

    @property
    def layers(self) -> list[int]:
        """Model layers stored in this group (registered so far)."""
        return sorted(self.store.specs)

    @property
    def name(self) -> str:
        name = "full" if self.window is None else f"sliding{self.window}"
        return f"{name}.tier{self.tier}" if self.tier else name

    def num_filled_slots(self) -> int:
        """Token slots in use: each block in use counted once with the most tokens any table holds in it (the pad
        block holds none)."""
        B, fill = self.block_size, {}
        for rows in self.tables.values():
            for row in rows:
                for j, b in enumerate(row.blocks, row.num_dropped):
                    if b != self.pad_block:
                        fill[b] = max(fill.get(b, 0), min(B, row.num_tokens - j * B))
        return sum(fill.values())

    def num_rows(self) -> int:
        """Live tables of this group (O(caches), for `stats()`)."""
        return sum(len(rows) for rows in self.tables.values())

    def rows(self) -> list[BlockTable]:
        """Every live table of this group."""
        return [row for rows in self.tables.values() for row in rows]

    def __repr__(self) -> str:
        return (f"BlockGroup({self.name}, layers={self.layers}, blocks={self.allocator.num_blocks}, "
                f"in_use={self.allocator.num_used_blocks})")
