"""`CacheRows`: the batch rows of one `PagedCache`: a `RowTables` per layer group, what they hold and where."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable

from hf_pagedkv.adapter import prefix_cache
from hf_pagedkv.adapter.left_padding import LeftPadding
from hf_pagedkv.adapter.offload import OffloadedGroup, drop_device_blocks, offload_cache, prefetch_cache
from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.blocks.block_table import BlockTable, num_blocks_for
from hf_pagedkv.errors import CacheOffloadedError, CacheReleasedError, InvariantError, counted
from hf_pagedkv.pool.block_pool import BlockPool


class CacheRows:
    """The block tables of a cache's batch rows: one `RowTables` per layer group its layers use, registered with the
    pool under the cache's owner token, and where they are (on the device, in the host tier, or released).

    Invariants (`check_invariants`): every group holds `num_rows` rows of `num_tokens` tokens (rows of a batch move
    together, padding included); `groups` lists the full-attention groups first (retention tiers in order), then the
    sliding-window ones in order of first use, and `by_group` indexes them by the pool's group; while `offloaded`,
    every group holds no row (the blocks are in the host tier); once `released`, the rows are empty for good.

    Row operations (`select`, `crop`, `attach`, `reset`) hold the pool's lock for their block references and change
    a group's tables and their mirror together (`RowTables`); the `StepRunner` runs them with the per-layer and
    retention bookkeeping that goes with them.

    Args:
        pool (`BlockPool`): the pool holding the blocks.
        owner (`int`): the cache's token in the pool's owner registry (`PoolOwners.register`).
    """

    def __init__(self, pool: BlockPool, owner: int) -> None:
        self.pool = pool  # fixed
        self.block_size = pool.block_size  # tokens per block; fixed
        self.owner = owner  # the cache's token in the pool's registry of tables; fixed
        self.groups: list[RowTables] = []  # one per layer group the cache's layers use; full attention first
        self.by_group: dict[int, RowTables] = {}  # pool group index -> its RowTables; grows with `groups`
        self.num_tokens = 0  # tokens held by every row (padding included); set by the StepRunner and the row operations
        # leading padding tokens per row of the coming prefill (`PagedCache.set_padding`), until its steps planned
        # them; or None. Forgotten by every row operation
        self.padding: LeftPadding | None = None
        self.maybe_dups = False  # rows were just forked, so identical rows may be deduplicated at the next step
        self.prefix_key: bytes | None = None  # model + format identity for the prefix index; set once
        self.released = False  # set once, by `PagedCache.release`
        # while offloaded: the rows' blocks in the host tier (adapter/offload.py); read to decide and changed only under
        # the pool's lock, so the cache is offloaded once however many threads try
        self.offloaded: list[OffloadedGroup] | None = None
        # called when the tables changed under a step (a compaction renamed blocks, an offload emptied them): the
        # step's plan no longer applies (`StepRunner.end_step`, weakly); set once by the StepRunner
        self.on_stale: weakref.WeakMethod | None = None

    def check_not_released(self) -> None:
        """Raises `CacheReleasedError` after `release()` (an offloaded cache passes)."""
        if self.released:
            raise CacheReleasedError("This PagedCache was released; create a new one (or fork() before release()).")

    def check_usable(self) -> None:
        """Raises `CacheReleasedError` after `release()`, `CacheOffloadedError` while offloaded."""
        self.check_not_released()
        if self.offloaded is not None:
            raise CacheOffloadedError("This PagedCache is offloaded to the host tier; call cache.prefetch() before "
                                      "using it again.")

    @property
    def num_rows(self) -> int:
        """Batch rows (each has one block table per layer group)."""
        return len(self.groups[0].rows) if self.groups else 0

    @property
    def first_group(self) -> list[BlockTable]:
        """The rows' block tables in the first layer group (full attention when the model has it)."""
        return self.groups[0].rows if self.groups else []

    def full_tables(self) -> list[RowTables]:
        """The full-attention layer groups (one, or one per tier of a tiered retention policy, tier 0 first)."""
        return [rt for rt in self.groups if rt.window is None]

    def sliding_tables(self) -> list[RowTables]:
        """The sliding-window layer groups."""
        return [rt for rt in self.groups if rt.window is not None]

    def block_tables(self, window: int | None = ...) -> list[list[int]]:
        """A copy of each row's held block ids in the first group, or in the group of sliding window `window`."""
        if window is ...:
            rt = self.groups[0] if self.groups else None
        else:
            rt = next((rt for rt in self.groups if rt.window == window), None)
        return [list(row.blocks) for row in rt.rows] if rt is not None else []

    def tables_for(self, window: int | None, tier: int = 0) -> RowTables:
        """The tables in the pool's layer group for `window` (and retention `tier`), created (and registered with
        the pool) on first use.

        Raises:
            CacheReleasedError: the cache was released (its owner token is gone: it registers no new rows).
            RuntimeError: a new group after the rows stored tokens.
        """
        group = self.pool.group_for(window, tier)
        rt = self.by_group.get(group)
        if rt is None:
            self.check_usable()
            if self.num_tokens:
                raise RuntimeError("A layer of a new layer group appeared after this PagedCache stored tokens; "
                                   "build the cache with config=model.config so every layer is known up front.")
            rt = RowTables(group, window, self.block_size, tier)
            rt.reset(self.num_rows)
            self.pool.owners.add_rows(self.owner, group, rt.rows, mover=weakref.WeakMethod(self._blocks_moved))
            at = sum(other.window is None for other in self.groups) if window is None else len(self.groups)
            self.groups.insert(at, rt)  # full attention first (tiers in order)
            self.by_group[group] = rt
        return rt

    def _blocks_moved(self, group: int, mapping: dict[int, int]) -> Callable[[], None]:
        """`BlockPool.compact` moves blocks of `group` (`{old id: new id}`): build the renamed mirror (may fail;
        nothing changed then) and return the function (plain Python) that renames the tables and swaps the mirror
        in. The current step's view base and slot tensors are stale then, so the next read recomputes them."""
        rename = self.by_group[group].renamed(mapping)

        def commit() -> None:
            rename()
            self._stale()

        return commit

    def _stale(self) -> None:
        end_step = None if self.on_stale is None else self.on_stale()
        if end_step is not None:
            end_step()

    # -- row operations ---------------------------------------------------------------------------------------------
    def select(self, idx: list[int], common: bool = False) -> None:
        """Rows become copies of rows `idx`. With `common`, refcounts move only for block positions after the
        leading ones every row shares (a permutation leaves their counts unchanged).

        Raises:
            CacheReleasedError, CacheOffloadedError: as `check_usable`.
            ValueError: an index out of range (nothing changed).
        """
        self.check_usable()
        if any(not 0 <= i < self.num_rows for i in idx):
            raise ValueError(f"row indices {idx} out of range for a cache of {counted(self.num_rows, 'row')}.")
        self.padding = None
        with self.pool.lock:
            for rt in self.groups:
                c = rt.common_prefix(self.num_tokens) if common else 0
                new_rows = [rt.rows[i].copy() for i in idx]
                for row in new_rows:
                    self.pool.groups[rt.group].incref(row.after(c))
                self.pool._free([b for row in rt.rows for b in row.after(c)], rt.group)
                rt.rows[:] = new_rows
                rt.select(idx)

    def crop(self, new_len: int, tokens_to_remove: int) -> None:
        """Every row keeps its first `new_len` tokens (`PagedCache.crop(tokens_to_remove)`): blocks past
        ``ceil(new_len / block_size)`` are freed; a last block only these rows hold keeps what they kept.

        Raises:
            ValueError: `new_len` reaches before what a sliding-window group still holds (nothing changed).
        """
        B = self.block_size
        for rt in self.groups:  # a sliding group must still hold the window the next step reads
            if rt.droppable(new_len) < rt.num_dropped:
                raise ValueError(
                    f"crop({tokens_to_remove}) to {counted(new_len, 'token')} reaches before what the sliding-window "
                    f"layers (window {rt.window}) still hold: they keep the last window - 1 tokens plus the last "
                    f"step's new tokens ({(rt.num_dropped * B)} tokens onward here). Crop at most the tokens of the "
                    "last forward step, as assisted decoding does."
                )
        keep, kept = num_blocks_for(new_len, B), new_len % B  # kept: tokens of the last block
        pool = self.pool
        with pool.lock:
            for rt in self.groups:
                group = pool.groups[rt.group]
                for row in rt.rows:
                    pool._free(row.truncate(keep), rt.group)
                    row.num_tokens = new_len
                if not kept:
                    continue
                # a last block only this cache's rows hold now holds what they kept (all rows crop together); a
                # published block keeps its content
                lasts = Counter(row.blocks[-1] for row in rt.rows if row.blocks)
                mine = [b for b, holders in lasts.items()
                        if group.refcount(b) == holders and not pool.groups[rt.group].is_published(b)]
                group.mark_written(mine, [kept] * len(mine))
                if pool.debug:  # stale tokens past the crop must never be read (blocks one row holds alone)
                    group.poison_slots([b * B + i for b in mine if group.refcount(b) == 1 for i in range(kept, B)])
        self.num_tokens = new_len

    def reset(self) -> None:
        """Free every block the rows hold (on the device or in the host tier) and forget the rows. Every table and
        reference is dropped before the first call that may fail (releasing the freed blocks' storage)."""
        self.num_tokens = 0
        self.padding = None
        with self.pool.lock:
            if self.offloaded is not None:  # its blocks are in the host tier
                self.pool.host.release(self.owner)
                self.offloaded = None
            held = {rt.group: [b for row in rt.rows for b in row.blocks] for rt in self.groups}
            for rt in self.groups:
                rt.reset()  # plain Python
            self.pool._free_groups(held)

    def attach(self, hit: int, held: dict[int, tuple[int, list[int]]]) -> None:
        """Start these (empty) rows as one row of `hit` full blocks: per group, `(dropped positions, blocks)`
        (already referenced for this row). All or nothing: every group's table and mirror is made before any is
        installed."""
        n = hit * self.block_size
        for group in held:  # a cache built without config starts its (full-attention) group here
            if group not in self.by_group:
                self.tables_for(self.pool.groups[group].window, self.pool.groups[group].tier)
        tables = []
        for rt in self.groups:
            lo, blocks = held[rt.group]
            row = BlockTable(num_dropped=lo)
            row.append(blocks)
            row.num_tokens = n
            tables.append((rt, [row], RowTables.mirror_of([row])))
        for rt, rows, table in tables:
            rt.restore(rows, table)
        self.num_tokens = n

    def attach_prefix(self, ids: list[int]) -> int:
        """Attach these (empty) rows, as one row, to the longest cached full-block prefix of `ids` in the pool's
        prefix index (keyed by `prefix_key`), leaving at least one token to compute; returns the tokens attached.
        All or nothing: on an error the references taken are let go."""
        pool = self.pool
        hashes = prefix_cache.hash_blocks(ids[: len(ids) - 1], pool.block_size, self.prefix_key)  # >= 1 left
        with pool.lock:  # references and the table that names them appear together (invariant 2)
            if pool.host is not None:  # prefix blocks in the host tier are copied back before any read
                pool.host.promote(hashes, [rt.group for rt in self.groups])
            hit = prefix_cache.hit_length(pool, self.groups, hashes)
            held = {}
            try:
                for k, rt in enumerate(self.groups):  # the first group counts the lookup (one per request)
                    lo = rt.droppable(hit * pool.block_size)
                    held[rt.group] = (lo, pool._acquire_prefix(hashes[lo:hit], len(ids), group=rt.group, count=k == 0))
                self.attach(hit, held)  # all or nothing
            except BaseException:  # the references taken, in no table
                pool._free_groups({group: blocks for group, (_, blocks) in held.items()})
                raise
        return self.num_tokens

    def copy_into(self, other: CacheRows) -> None:
        """Make the (empty) rows `other` share every block of these (a fork): O(blocks), no tensor copy."""
        other.prefix_key = self.prefix_key  # same model, same tokens: a fork may publish them too
        with self.pool.lock:
            for mine, rt in [(other.tables_for(rt.window, rt.tier), rt) for rt in self.groups]:  # groups, then rows
                for row in rt.rows:
                    self.pool.groups[rt.group].incref(row.blocks)
                    mine.rows.append(row.copy())
                mine.table = rt.table.clone()
        other.num_tokens = self.num_tokens

    def publish(self, input_ids, written: int, max_blocks: int | None) -> int:
        """Publish the full blocks of row `r` holding ``input_ids[r][:written]`` (a single row of ids with several
        rows: row 0), of a row only the held positions below `max_blocks`; returns the blocks newly published.

        Raises:
            ValueError: `input_ids` not token ids; the number of rows does not match; a block already published for
                other tokens.
        """
        with self.pool.lock:  # the key save_prefix_cache records as the blocks' model key
            self.pool.prefix_keys.setdefault(bytes(self.prefix_key))
        rows = prefix_cache.token_rows(input_ids)
        if len(rows) == 1 and self.num_rows > 1:
            rows = rows + [[]] * (self.num_rows - 1)  # row 0 holds the shared prompt
        if len(rows) != self.num_rows:
            raise ValueError(f"publish got {counted(len(rows), 'row')} of ids for a cache of "
                             f"{counted(self.num_rows, 'row')}.")
        return prefix_cache.publish_rows(self.pool, self.groups, rows, written, self.prefix_key, max_blocks=max_blocks)

    # -- host tier (adapter/offload.py) -----------------------------------------------------------------------------
    def offload(self) -> None:
        """Move every row to the pool's host tier and drop the device references (`PagedCache.offload`).

        Raises:
            CacheReleasedError, CacheOffloadedError: released, or offloaded already (nothing changed).
            ValueError, PoolExhaustedError: as `offload_cache` (nothing changed).
        """
        with self.pool.lock:  # the check and the move are one step for every thread (swaps run under this lock)
            if self.offloaded is not None and not self.released:
                raise CacheOffloadedError("offload(): this PagedCache is offloaded already (another thread's "
                                          "generate(swap_on_exhaustion=True) may have swapped it out while idle); "
                                          "cache.prefetch() brings it back.")
            self.check_usable()
            self.offloaded = offload_cache(self.pool, self.owner, self.groups)  # copied; device blocks held
            self._stale()
            drop_device_blocks(self.pool, self.groups)  # bookkeeping first: an error after it leaves it done

    def prefetch(self) -> bool:
        """Bring offloaded rows back to the device (`PagedCache.prefetch`); False (nothing done) when not offloaded.

        Raises:
            CacheReleasedError: released.
            PoolExhaustedError: too few free device blocks (the rows stay offloaded).
        """
        with self.pool.lock:  # one decision with any other offload or prefetch of this cache
            if self.released:
                raise CacheReleasedError("This PagedCache was released; create a new one.")
            if self.offloaded is None:
                return False
            prefetch_cache(self.pool, self.owner, self.groups, self.offloaded)
            self.offloaded = None
            self.pool.owners.touch(self.owner)
        return True

    def check_invariants(self) -> None:
        """Per layer group: rows in step with each other and with `num_tokens`, and the tables' tensor mirror equal
        to the tables. Raises `InvariantError`."""
        for rt in self.groups:
            problems = rt.check()
            if len(rt.rows) != self.num_rows or any(row.num_tokens != self.num_tokens for row in rt.rows):
                problems.append(f"group rows/tokens out of step with the cache ({counted(self.num_rows, 'row')} of "
                                f"{counted(self.num_tokens, 'token')})")
            if problems:
                raise InvariantError(f"invariant 7 (block tables and their mirror agree) broken in the cache's "
                                     f"group {rt.group}: {'; '.join(problems)}")
