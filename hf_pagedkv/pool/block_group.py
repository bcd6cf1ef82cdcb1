"""`BlockGroup`: the blocks of one layer group of a pool -- ids and refcounts, their storage, prefix index, tables --
and every operation on them."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from hf_pagedkv.blocks.block_allocator import BlockAllocator
from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.compaction import num_trapped_free, plan_moves
from hf_pagedkv.blocks.prefix_index import BlockHash, PrefixIndex
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.observe.pool_stats import GroupStats
from hf_pagedkv.pool.invariants import check_group_invariants
from hf_pagedkv.storage.page_store import PageStore
from hf_pagedkv.storage.quantized_store import QuantizedPageStore

if TYPE_CHECKING:
    import torch

    from hf_pagedkv.observe.events import EventLog
    from hf_pagedkv.pool.host_tiers import HostTiers

logger = logging.getLogger(__name__)

# A growable group grows by what a step is missing plus a headroom of a quarter of its size, at least
# _MIN_GROWTH_BLOCKS: sized to need (a pool that one prefill sized holds about that prefill), and still amortised.
_MIN_GROWTH_BLOCKS = 16
_GROWTH_FRACTION = 4  # headroom = num_blocks // _GROWTH_FRACTION


class BlockGroup:
    """The blocks of one layer group: layers that keep the same history (full attention; one sliding window).

    As in vLLM's hybrid KV-cache manager, one block id of a group names the same slot range in every layer of that
    group, so a sequence needs one block table per group. Each group has its own ids, allocator and storage: a
    sliding-window group frees the blocks that leave its window, so its storage stays the size of the windows
    while a full-attention group grows with the context. Every change to its blocks goes through the methods
    below (`BlockPool` calls them under its lock, and adds what spans groups: draining released owners, metrics,
    idle shrinking); code outside `pool/` never touches `allocator`, `store` or `prefix_index` directly.

    Invariants (numbered as `InvariantError` names them; `check_invariants`, from `BlockPool.check_invariants`):

    1. every block id is in exactly one state: free, in use (refcount >= 1) or cached-idle (published, refcount 0);
       the prefix index is consistent (hash <-> block maps inverse) and names no free block;
    2. `refcount[b]` equals the live table entries naming `b` among the tables registered here (`tables`), plus
       one for the pad block (the pool's own reference): with no live table, no block but the pad block is in use;
    3. a table holding `n` tokens covers ``ceil(n / block_size)`` block positions, of which a full-attention table
       holds all (a retention tier > 0 may drop leading positions, keeping at least the last), a sliding table
       drops only positions wholly before its window, and a budgeted table (`max_positions`) holds at most its
       budget; a table names a block once, except the pad block, which it names only at leading positions;
    4. quantized: a full block is encoded once (since it was last freed or reopened by a crop);
    5. the free queue names only real blocks, none in use;
    6. quantized: every stage and sink stage is owned by exactly one live block;
    8. the written-slot counter (`allocator.num_filled_slots`) agrees with the tables;
    10. the pad block (`pad_block`, once reserved by `BlockPool._ensure_pad_block`): one block of zeros that every
        whole block of left padding names (as vLLM's null block). The pool holds one reference to it, so it is
        never freed; it is never written, never published and holds no token (fill 0).
    """

    def __init__(self, index: int, window: int | None, block_size: int, quant: QuantConfig, *, debug: bool = False,
                 prefix_caching: bool = False, tier: int = 0, growable: bool = True,
                 host: HostTiers | None = None) -> None:
        self.index = index  # position in `BlockPool.groups`; fixed
        self.window = window  # sliding window in tokens, or None for full attention; fixed
        # retention tier (`PyramidKV`): 0, or the tier of full-attention layers this group holds; fixed. A tier > 0
        # holds fewer tokens than tier 0 and drops the leading block positions before them (`RowTables`)
        self.tier = tier
        self.block_size = block_size  # tokens per block; fixed
        self.growable = growable  # grow on demand instead of evicting or raising; fixed
        self.host = host  # the pool's host tier (evicted prefix blocks are demoted there), or None; fixed
        self.allocator = BlockAllocator()  # block ids and refcounts of this group; changed by the methods below
        self.store = (QuantizedPageStore(block_size, quant, debug=debug) if quant.is_quantized
                      else PageStore(block_size, debug=debug))  # the tensors of this group's layers
        self.prefix_index = PrefixIndex() if prefix_caching else None  # full-block hashes -> blocks, or None
        self.tables: dict[int, list[BlockTable]] = {}  # owner token -> that cache's rows here; `PoolOwners` only
        # owner token -> callback(group, {old: new}) that prepares the renaming of moved blocks in its tables and
        # returns the function doing it (a weak method, see `PoolOwners.add_rows`), if any; `PoolOwners` only
        self.movers: dict[int, Callable[[], Callable[[int, dict[int, int]], Callable[[], None]] | None]] = {}
        self.num_cow_copies = 0  # blocks copied before a write; changed by `copy_on_write` only
        self.pad_block: int | None = None  # the pad block, or None until `set_pad_block`; renamed by `compact`
        self._events: EventLog | None = None  # the pool's event log; set once through `events`

    @property
    def events(self) -> EventLog | None:
        """The pool's block event log (`observe/events.py`), or None until the pool sets it (once)."""
        return self._events

    @events.setter
    def events(self, log: EventLog) -> None:
        assert self._events is None, "a layer group's event log is set once"
        self._events = log

    def _emit(self, kind: str, blocks: list[int], **fields) -> None:
        if self._events is not None:  # group 0 events carry no group field
            self._events.emit(kind, blocks, **({} if self.index == 0 else {"group": self.index}), **fields)

    # -- what the layers above may read ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        name = "full" if self.window is None else f"sliding{self.window}"
        return f"{name}.tier{self.tier}" if self.tier else name

    @property
    def layers(self) -> list[int]:
        """Model layers stored in this group (registered so far)."""
        return sorted(self.store.specs)

    @property
    def num_blocks(self) -> int:
        """Blocks this group holds storage for (free, in use and cached-idle)."""
        return self.allocator.num_blocks

    @property
    def is_quantized(self) -> bool:
        """Whether its blocks are stored quantized (codes and scales)."""
        return self.store.is_quantized

    @property
    def page_store(self):
        """The group's page store, for the per-layer tensor work above the pool that hands the store itself on (the
        attention bridge's `PagedView`); block state changes only through this group's methods."""
        return self.store

    def refcount(self, block: int) -> int:
        """Live references to `block` (table entries, plus one for the pad block)."""
        return self.allocator.refcount(block)

    def fill(self, block: int) -> int:
        """Leading slots of `block` written."""
        return self.allocator.fill(block)

    def prepare_write(self, slots: torch.Tensor, device: torch.device, **kwargs):
        """`store.prepare_write`: the write target of `slots` (`[num_new_tokens]` int64) on `device`."""
        return self.store.prepare_write(slots, device, **kwargs)

    def write(self, layer_idx: int, target, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """`store.write`: K/V (`[tokens, num_kv_heads, head_dim]` as the target was prepared) into layer `layer_idx`."""
        self.store.write(layer_idx, target, key_states, value_states)

    def read(self, layer_idx: int, request) -> tuple[torch.Tensor, torch.Tensor]:
        """`store.read`: `[batch, num_kv_heads, seq_len, head_dim]` keys and values of `request` (`ReadRequest`)."""
        return self.store.read(layer_idx, request)

    def import_blocks(self, blocks: list[int], export: dict[str, torch.Tensor]) -> None:
        """Write an export (`store.export_blocks`, e.g. from the host tier) into `blocks` (held by the caller)."""
        self.store.import_blocks(blocks, export)

    def poison_slots(self, slots: list[int]) -> None:
        """Debug mode: poison slots (block * block_size + offset) no table may read any more (after a crop)."""
        self.store.poison_slots(slots)

    def held_by(self, token: int) -> Counter[int]:
        """The blocks owner `token`'s tables here name, with how many entries name each."""
        return Counter(b for row in self.tables.get(token, ()) for b in row.blocks)

    # -- reserve and allocate ----------------------------------------------------------------------------------------
    def add_blocks(self, n: int) -> None:
        """Grow by `n` free blocks (storage first: a failed growth leaves the ids as they were)."""
        self.store.grow(self.allocator.num_blocks + n)
        self.allocator.add_blocks(n)

    def can_reserve(self, n: int) -> bool:
        """Whether `reserve(n)` would succeed. No side effects."""
        return self.growable or n <= self.allocator.num_free_blocks + self.allocator.num_idle_blocks

    def exhausted_error(self, n: int, named: bool) -> PoolExhaustedError:
        """The error of a reservation of `n` blocks that cannot succeed (`named`: say which layer group)."""
        free, idle = self.allocator.num_free_blocks, self.allocator.num_idle_blocks
        idle_note = f" and {idle} cached-idle" if self.prefix_index is not None else ""
        where = f" in its {self.name} layer group" if named else ""
        return PoolExhaustedError(
            f"BlockPool is full{where}: {counted(n, 'block')} needed, {free} free{idle_note} of "
            f"{self.allocator.num_blocks} (block_size={self.block_size}). Raise num_blocks / max_memory, "
            "release finished caches, or use num_blocks=None to let the pool grow."
        )

    def reserve(self, n: int, rows: int = 1, run: int = 0) -> None:
        """Make sure `n` blocks are free: a fixed group evicts cached-idle blocks (LRU), a growable one grows (its
        idle blocks stay, within the prefix cache's budget). Changes no refcount. `rows`: how many rows the blocks
        are for; a growth keeps at least one more free block per row, so that the rows' next blocks come from the
        same storage segment. `run`: a growth also makes `run` consecutive free blocks in one segment (for
        `allocate_rows`) unless a segment has them already; it never grows for that alone.

        Raises:
            PoolExhaustedError: a fixed group has fewer than `n` free plus cached-idle blocks (nothing changed).
        """
        free = self.allocator.num_free_blocks
        if n <= free:
            return
        if not self.can_reserve(n):
            raise self.exhausted_error(n, named=True)
        idle = self.allocator.num_idle_blocks
        if idle and not self.growable:  # evict before raising: idle blocks are only a cache
            self.evict(min(n - free, idle))
            return
        # NOTE: a growable group grows rather than evicting: its idle blocks are within the prefix cache's budget
        # (`free` trims them to it), and evicting them first would keep no prefix across requests.
        cur = self.allocator.num_blocks
        headroom = max(cur // _GROWTH_FRACTION, _MIN_GROWTH_BLOCKS, rows)
        want_run = run > n - free + headroom and self.free_run(run) is None
        self.add_blocks((run if want_run else n - free) + headroom)
        logger.debug("BlockPool %s group grew from %d to %d blocks", self.name, cur, self.allocator.num_blocks)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` free blocks (refcount 1 each), the one after `after` preferred; `reserve(n)` first."""
        blocks = self.allocator.allocate(n, after)
        assert blocks is not None, "allocate without a reservation"
        self._emit("allocate", blocks)
        return blocks

    def allocate_rows(self, rows: int, n: int, stride: int) -> list[list[int]] | None:
        """Allocate `n` blocks for each of `rows` new rows, laid out evenly: row `r` gets the consecutive ids
        ``s + r * stride .. s + r * stride + n - 1`` of the lowest free run ``s .. s + rows * stride - 1`` that lies
        in one storage segment, and the ``stride - n`` ids after each row stay free for its next blocks
        (`BlockAllocator.allocate` prefers them). Rows so placed are read by a page store as one strided view
        (`PageStore.read`) instead of a gather. Returns the blocks per row (refcount 1 each), or `None` (nothing
        changed) when no such run is free: the caller allocates row by row instead. Call `reserve` first (with
        ``run=rows * stride``, so that a growth makes room for the run)."""
        assert 0 < n <= stride
        start = self.free_run(rows * stride)
        if start is None:
            return None
        out = [list(range(start + r * stride, start + r * stride + n)) for r in range(rows)]
        flat = [b for row in out for b in row]
        self.allocator.allocate_ids(flat)
        self._emit("allocate", flat)
        return out

    def free_run(self, length: int) -> int | None:
        """The lowest start of `length` consecutive free blocks inside one storage segment, or None."""
        ranges, lo = [], 0
        for size in self.store.segment_blocks:
            ranges.append((lo, lo + size))
            lo += size
        return self.allocator.free_run(length, (r for r in ranges if r[1] - r[0] >= length))

    def set_pad_block(self, block: int) -> None:
        """Make `block` (just allocated: the pool's own reference, never dropped) the pad block: one block of zeros
        (finite, in every layer of the group) that every whole block of a row's left padding names instead of a
        block of its own, as vLLM's null block.

        Its refcount is the table entries naming it + 1, so it is never freed; it is never written (a step drops
        the writes of padding tokens that fall in it, and copies it before writing a real token into it after a
        crop), never published, never moved to the host tier, and holds no token (fill 0). Reads gather it like any
        block: attention masks its positions, and zeros keep the masked softmax exact. Counted once in
        `stats().blocks_in_use` and `bytes_in_use`. Invariant 10."""
        assert self.pad_block is None, "a layer group has one pad block"
        self.store.zero_blocks([block])
        self.pad_block = block
        logger.debug("BlockPool: block %d is the pad block of its %s group", block, self.name)

    # -- references --------------------------------------------------------------------------------------------------
    def incref(self, blocks: list[int]) -> None:
        self._emit("fork", blocks)
        self.allocator.incref(blocks)

    def free(self, blocks: list[int]) -> list[int]:
        """Drop one reference from each block; those that reach refcount 0 become free (poisoned in debug mode) or,
        when published, cached-idle (`trim_prefix_cache` then keeps them within the budget). The references are
        dropped first, in plain Python: an error raised later (releasing the freed blocks' storage) leaves them
        dropped and every invariant holding. Returns the blocks freed."""
        self._emit("free", blocks)
        if self.prefix_index is None:
            freed = self.allocator.decref(blocks)
        else:
            freed = self.prefix_index.release(blocks, self.allocator)
        self.store.release(freed)
        return freed

    def trim_prefix_cache(self, max_idle: int | None) -> None:
        """Evict the least recently used cached-idle blocks beyond `max_idle` (None: no limit)."""
        excess = 0 if max_idle is None else self.allocator.num_idle_blocks - max_idle
        if excess > 0:
            self.evict(excess)

    def evict(self, n: int) -> None:
        """Free the `n` least recently used cached-idle blocks; the host tier, if any, keeps a copy of each."""
        if self.host is not None:  # the host tier keeps what the device drops (host_tiers.py)
            self.host.demote(self.index, self.prefix_index.oldest_idle(n))
        evicted = self.prefix_index.evict(n, self.allocator)
        self._emit("evict", evicted)
        self.store.release(evicted)
        logger.debug("BlockPool evicted %d cached-idle blocks of its %s group", n, self.name)

    def mark_written(self, blocks: list[int], fills: list[int]) -> None:
        """`blocks[i]` now hold their first `fills[i]` slots (for `stats().tokens_stored`, kept O(1))."""
        for b, n in zip(blocks, fills):
            self.allocator.set_fill(b, n)

    def copy_on_write(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer (before writing to a shared or published block)."""
        self.store.copy_blocks(src, dst)
        for s, d in zip(src, dst):
            self.allocator.set_fill(d, self.allocator.fill(s))
        self.num_cow_copies += len(src)

    # -- prefix caching ----------------------------------------------------------------------------------------------
    def is_published(self, block: int) -> bool:
        """Whether `block` holds a published full prefix (it must then be copied before any write)."""
        return self.prefix_index is not None and block in self.prefix_index

    def acquire_prefix(self, hashes: list[BlockHash], num_tokens: int, count: bool = True) -> list[int]:
        """Take one reference to each block of the longest published prefix of `hashes` (reviving idle ones).

        Args:
            hashes (`list[BlockHash]`): chain hashes of the full blocks a request may reuse.
            num_tokens (`int`): tokens of the request (for `hit_rate`).
            count (`bool`, *optional*, defaults to `True`): count the lookup and its hit (once per request: the
                other layer groups of the same request pass `False`).

        Returns:
            `list[int]`: the hit blocks, in order; the caller's block table must name them (one reference each).
        """
        blocks = self.prefix_index.acquire(hashes, self.allocator, num_tokens, count)
        self._emit("hit", blocks, tokens=num_tokens)
        return blocks

    def match_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks of the longest published prefix of `hashes`. Changes nothing."""
        return self.prefix_index.match(hashes)

    def publish(self, hashes: list[BlockHash], blocks: list[int]) -> int:
        """Publish `blocks[i]` under `hashes[i]` (held by the caller, fully written); returns blocks newly published."""
        assert all(self.allocator.refcount(b) > 0 for b in blocks), "publish of a block the caller does not hold"
        assert self.pad_block is None or self.pad_block not in blocks, "publish of the pad block (padding)"
        self._emit("publish", blocks)
        return sum(self.prefix_index.publish(h, b) for h, b in zip(hashes, blocks))

    # -- compaction and shrinking ------------------------------------------------------------------------------------
    def compact(self, max_blocks: int) -> int:
        """Move up to `max_blocks` live blocks (in use or cached-idle) to free ids below them (`blocks/compaction.py`):
        each row whole to the lowest place where its blocks are consecutive in one storage segment, then blocks no
        row names to the lowest free ids, so the free blocks gather at the end, where `shrink` can return them.
        Returns the blocks moved.

        Exact: a moved block's storage is copied whole (K/V, or codes, scales, its stage and sink stage), its
        refcount, fill, prefix hash and LRU place move with it, and every block table naming it is renamed (a
        `PagedCache` renames its tables and their mirror through the hook it registered, `movers`), so outputs are
        unchanged for live caches, forks, beams, prefix-cached and quantized blocks. All or nothing: an error or
        interrupt leaves the group as it was."""
        # the pad block is shared by every padded row: not part of any row's run (it may pack down loose)
        rows = [[b for b in row.blocks if b != self.pad_block] for row in self.rows()]
        moves = plan_moves(self.allocator, max_blocks, rows, self.store.segment_blocks)
        if not moves:
            return 0
        src, dst = list(moves), list(moves.values())
        # NOTE: all or nothing: what may fail (torch calls: the storage copy, the caches' new mirrors) comes first
        # and changes no bookkeeping; then plain Python renames everything at once
        try:
            self.store.copy_blocks(src, dst)  # storage first: dst are free, src stay valid until renamed
            renames = [self._renamer(token, rows, moves) for token, rows in self.tables.items()]
        except BaseException:
            self.store.release(dst)  # still free: drop what the copy gave them (a quantized block's stages)
            raise
        for s, d in moves.items():
            self.allocator.move(s, d)
        if self.prefix_index is not None:
            self.prefix_index.rename(moves)
        if self.pad_block in moves:  # its zeros were copied with it
            self.pad_block = moves[self.pad_block]
        for rename in renames:
            rename()
        self.store.release(src)  # now free: stages returned, state dropped, poisoned in debug mode
        logger.debug("BlockPool compacted %d blocks of its %s group", len(moves), self.name)
        return len(moves)

    def _renamer(self, token: int, rows: list[BlockTable], moves: dict[int, int]) -> Callable[[], None]:
        """For `compact`: the function (plain Python) that renames owner `token`'s tables; the cache builds its new
        mirror here, through its hook (which may fail)."""
        mover = self.movers.get(token)
        rename = mover() if mover is not None else None
        if rename is not None:
            return rename(self.index, moves)  # the cache renames its rows and their mirror

        def rename_rows() -> None:  # an owner without a hook (or collected, not yet drained): its rows only
            for row in rows:
                row.rename(moves)

        return rename_rows

    def shrink(self) -> int:
        """Give back the trailing storage segments whose blocks are all free; returns the bytes returned."""
        free = self.allocator.free_blocks()
        top = next((b for b in range(self.allocator.num_blocks - 1, -1, -1) if b not in free), -1)
        before = self.store.bytes_reserved()
        kept = self.store.shrink(top + 1)
        self.allocator.remove_blocks(self.allocator.num_blocks - kept)
        return before - self.store.bytes_reserved()

    # -- observation -------------------------------------------------------------------------------------------------
    def stats(self) -> GroupStats:
        """A snapshot of this group's occupancy."""
        alloc = self.allocator
        return GroupStats(window=self.window, layers=tuple(self.layers), num_blocks=alloc.num_blocks,
                          blocks_in_use=alloc.num_used_blocks, tokens_stored=alloc.num_filled_slots,
                          bytes_per_block=self.store.bytes_per_block,
                          bytes_in_use=self.store.bytes_in_use(alloc.num_used_blocks),
                          bytes_reserved=self.store.bytes_reserved())

    def num_trapped_blocks(self) -> int:
        """Free blocks below the highest live one (what `shrink` cannot return before a `compact`)."""
        return num_trapped_free(self.allocator)

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

    def check_invariants(self, tiered: bool = False) -> None:
        """Raise `InvariantError` naming the first broken invariant (1-6, 8, 10 above) and the blocks concerned.
        `tiered`: the pool's full-attention layers are split into retention tiers (`pool/invariants.py`)."""
        check_group_invariants(self, tiered)

    def __repr__(self) -> str:
        return (f"BlockGroup({self.name}, layers={self.layers}, blocks={self.allocator.num_blocks}, "
                f"in_use={self.allocator.num_used_blocks})")
