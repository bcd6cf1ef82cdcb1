"""`OwnerRegistry`: the live owners (caches) of a pool, when each was last used, and which can be swapped out.
Pure Python, no tensors."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class IdleOwner:
    """An owner (a `PagedCache`) not running a request now, as `BlockPool.idle_owners` lists it."""

    token: int  # the owner's token (`PagedCache.seq_id`)
    last_use: int  # logical time of its last use (a pool-wide counter: larger is more recent)
    last_used_at: float  # `time.monotonic()` seconds at its last use (for display; ordering uses `last_use`)
    num_blocks: int  # device blocks its tables name, all layer groups (each counted once)
    num_exclusive_blocks: int  # of those, the blocks no other owner names (what swapping it out frees or uncaches)
    offload: Callable[[], None]  # moves it to the host tier (`PagedCache.offload`)


class OwnerRegistry:
    """The owner tokens of a `BlockPool` (one per `PagedCache`), with a last-use clock and busy marks.

    A token is *live* from `new` to `forget`. Each use (`touch`: a forward step, an attach, a prefetch) stamps it
    with the next value of a logical clock, so least-recently-used order depends only on the sequence of calls,
    never on wall time (ranks of a tensor-parallel job pick the same caches). An owner is *busy* while `busy`
    marks it (a `hf_pagedkv.generate` call running it holds a mark), and can be swapped out when it registered an
    `offload` hook (a weak reference: the registry never keeps a cache alive).

    Invariants: `last_use`, `busy` and `swappers` name live tokens only; busy counts are >= 1.
    """

    def __init__(self) -> None:
        self._tokens = itertools.count()  # the next owner token; advanced by `new` only
        self._clock = itertools.count(1)  # the logical use clock; advanced by `touch` only
        self.live: set[int] = set()  # live owner tokens; changed by new / forget
        self.last_use: dict[int, tuple[int, float]] = {}  # token -> (logical time, monotonic seconds) of last use
        self.busy: Counter[int] = Counter()  # token -> running requests marking it busy; changed by mark / unmark
        self.swappers: dict[int, Callable[[], Callable[[], None] | None]] = {}  # token -> weak offload hook

    def new(self) -> int:
        """A new live token (used now)."""
        token = next(self._tokens)
        self.live.add(token)
        self.touch(token)
        return token

    def forget(self, token: int) -> None:
        """The owner is gone (released or collected)."""
        self.live.discard(token)
        self.last_use.pop(token, None)
        self.busy.pop(token, None)
        self.swappers.pop(token, None)

    def touch(self, token: int) -> None:
        """`token` was used now."""
        if token in self.live:
            self.last_use[token] = (next(self._clock), time.monotonic())

    def set_swapper(self, token: int, hook: Callable[[], Callable[[], None] | None]) -> None:
        """`hook()` returns the owner's offload function, or None once the owner is gone (a `weakref.WeakMethod`)."""
        assert token in self.live, "a swap hook for an owner that is not live"
        self.swappers[token] = hook

    def mark(self, token: int) -> None:
        """A request runs `token`: it is not idle until the matching `unmark`."""
        if token in self.live:
            self.busy[token] += 1

    def unmark(self, token: int) -> None:
        if self.busy.get(token, 0) > 1:
            self.busy[token] -= 1
        else:
            self.busy.pop(token, None)

    def idle(self, exclude: set[int]) -> list[tuple[int, int, float, Callable[[], None]]]:
        """``(token, logical time, seconds, offload)`` of each live, not busy owner outside `exclude` that has a
        swap hook whose owner still exists, least recently used first."""
        out = []
        for token in self.live:
            if token in exclude or self.busy.get(token) or token not in self.swappers:
                continue
            offload = self.swappers[token]()
            if offload is not None:
                out.append((token, *self.last_use[token], offload))
        return sorted(out, key=lambda o: o[1])

    def check(self) -> list[str]:
        """Problems (empty when fine)."""
        problems = []
        for name, keys in (("last_use", self.last_use), ("busy", self.busy), ("swappers", self.swappers)):
            stale = sorted(set(keys) - self.live)
            if stale:
                problems.append(f"{name} names owners {stale[:10]} that are not live")
        if any(n < 1 for n in self.busy.values()):
            problems.append("a busy count below 1")
        return problems
