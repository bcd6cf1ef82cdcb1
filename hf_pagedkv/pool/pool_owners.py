"""`PoolOwners`: the caches that hold a pool's blocks -- their tokens, their tables in each layer group, the owners
collected without `release()` whose blocks are freed at the next pool operation, and which of them are idle."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from hf_pagedkv.blocks.block_table import BlockTable
from hf_pagedkv.blocks.owner_registry import IdleOwner, OwnerRegistry
from hf_pagedkv.errors import InvariantError

if TYPE_CHECKING:
    from hf_pagedkv.pool.block_group import BlockGroup
    from hf_pagedkv.pool.host_tiers import HostTiers


class PoolOwners:
    """The owners of a `BlockPool`'s blocks (one per `PagedCache`), each named by a token (`PagedCache.seq_id`).

    An owner registers its block tables in each layer group it uses (`BlockGroup.tables`, with an optional hook
    that renames them when `compact` moves blocks); the group's refcounts count those tables' entries. An owner
    goes away by `unregister` (an explicit release: its tables are empty already) or by `release` (a cache
    garbage collected: only queued, since a finalizer may run inside a pool method; `drain` frees its blocks at the
    start of the next pool operation). `registry` (`OwnerRegistry`) keeps the last-use clock, busy marks and swap
    hooks that `idle` reads.

    Invariants: a token has tables in a group only while it is live or queued (`drain` drops them); the registry's
    own (invariant 11, `OwnerRegistry.check`). Every method takes `lock`, the pool's lock.

    Args:
        groups (`list[BlockGroup]`): the pool's layer groups (the pool's own list: groups it adds later count).
        host (`HostTiers`, *optional*): the pool's host tier, whose blocks a collected offloaded owner holds.
        lock (`threading.RLock`): the pool's lock.
    """

    def __init__(self, groups: list[BlockGroup], host: HostTiers | None, lock: threading.RLock) -> None:
        self.groups = groups  # the pool's layer groups (shared list); read here, appended by the pool only
        self.host = host  # the pool's host tier, or None; fixed
        self.lock = lock  # the pool's lock; fixed
        self.registry = OwnerRegistry()  # live tokens, last uses, busy marks, swap hooks
        self._pending: deque[int] = deque()  # owners collected without release(); appended by `release`, `drain` only

    @property
    def num_pending(self) -> int:
        """Owners collected without `release()` whose blocks the next pool operation frees."""
        return len(self._pending)

    def register(self, rows: list[BlockTable] | None = None, group: int = 0) -> int:
        """A new live token; `rows` (a list the owner keeps filling) are its tables in `group`."""
        with self.lock:
            token = self.registry.new()
            if rows is not None:
                self.groups[group].tables[token] = rows
            return token

    def add_rows(self, token: int, group: int, rows: list[BlockTable], mover=None) -> None:
        """Register an owner's tables in another layer group; `mover` (a `weakref.WeakMethod`, optional) is called
        as ``mover()(group, {old: new})`` when `compact` moves blocks they name: it prepares what may fail (a new
        mirror) and returns a function, plain Python, that renames the tables and swaps the mirror in."""
        with self.lock:
            assert token in self.registry.live and token not in self.groups[group].tables
            self.groups[group].tables[token] = rows
            if mover is not None:
                self.groups[group].movers[token] = mover

    def unregister(self, token: int) -> None:
        """Forget an owner whose rows are already empty (an explicit `PagedCache.release()`)."""
        with self.lock:
            self.registry.forget(token)
            for group in self.groups:
                rows = group.tables.pop(token, None)
                group.movers.pop(token, None)
                assert not rows, "unregister of an owner that still holds blocks"

    def release(self, token: int) -> None:
        """Queue an owner that was released or garbage collected: `drain` frees its blocks and forgets it.

        NOTE: this runs from a `weakref.finalize`, which the garbage collector may call in any thread at any point,
        even inside a pool method holding `lock` (an RLock lets it in). So it only queues the owner; the blocks are
        freed at the start of the next pool operation (`drain`), never in the middle of one.
        """
        self._pending.append(token)  # deque.append is atomic

    def drain(self, free_groups: Callable[[dict[int, list[int]]], None]) -> None:
        """Free the blocks of the queued owners through `free_groups` (`BlockPool._free_groups`). Each owner's tables
        and references are all dropped before the first call that may fail (releasing the freed blocks' storage)."""
        with self.lock:
            while self._pending:
                token = self._pending.popleft()
                self.registry.forget(token)
                if self.host is not None:  # an offloaded cache holds host blocks instead
                    self.host.release(token)
                held = {}
                for group in self.groups:
                    rows = group.tables.pop(token, None)
                    group.movers.pop(token, None)
                    if rows:
                        held[group.index] = [b for row in rows for b in row.blocks]
                        rows.clear()
                free_groups(held)

    def touch(self, token: int) -> None:
        """Record a use of `token` now (`PagedCache` calls it at each forward step, attach and prefetch); the order
        of uses is what `idle` sorts by."""
        with self.lock:
            self.registry.touch(token)

    def set_swapper(self, token: int, hook) -> None:
        """Let `idle` offer owner `token` for swapping out: `hook()` returns a function that moves it to the host
        tier (``weakref.WeakMethod(cache.offload)``), or None once the owner is gone."""
        with self.lock:
            self.registry.set_swapper(token, hook)

    @contextlib.contextmanager
    def busy(self, token: int):
        """``with owners.busy(cache.seq_id):`` marks the cache busy (a request is running it), so `idle` does not
        offer it for swapping out meanwhile. Marks nest."""
        with self.lock:
            self.registry.mark(token)
        try:
            yield
        finally:
            with self.lock:
                self.registry.unmark(token)

    def idle(self, exclude=()) -> list[IdleOwner]:
        """The owners that could be swapped out to the host tier now, least recently used first: live, not `busy`,
        not offloaded, holding device blocks, and not in `exclude` (owner tokens). `drain` first.

        Returns:
            `list[IdleOwner]`: each with its token, last use (a logical clock, and `time.monotonic()` seconds), the
            device blocks it names (and how many of them no other owner names) and its `offload` function.
        """
        with self.lock:
            out = []
            for token, tick, seconds, offload in self.registry.idle(set(exclude)):
                held = {(g.index, b): n for g in self.groups for b, n in g.held_by(token).items()}
                if held:  # a block is exclusive when every reference to it is one of this owner's table entries
                    mine = sum(self.groups[gi].refcount(b) == n for (gi, b), n in held.items())
                    out.append(IdleOwner(token, tick, seconds, len(held), mine, offload))
            return out

    def check(self) -> None:
        """Raise `InvariantError` when the registry's invariant (11) is broken."""
        problems = self.registry.check()
        if problems:
            raise InvariantError(f"invariant 11 (owner registry) broken: {'; '.join(problems)}")
