"""`StepPlan`: what the first layer of a forward step decided, read by every layer of that step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class StepPlan:
    """One forward step of a `PagedCache`, as planned (and applied to the block tables) by `StepPlanner.begin`.

    Immutable: a later layer that finds a duplicate row differing gets a new plan (`with_writer`), never an edited
    one. Rows are batch rows; groups are the pool's layer-group indices.
    """

    start: int  # tokens each row held before the step
    end: int  # tokens each row holds after it
    writers: tuple[int, ...]  # rows whose new tokens are written (all rows but the duplicates), ascending
    dup_of: Mapping[int, int]  # duplicate row -> the writer row whose blocks it shares (identical K/V so far)
    view_base: Mapping[int, int | None]  # group -> slot of token 0 of the only row when its blocks are consecutive
    # group -> (block of position 0 of row 0, blocks between rows) when several rows are evenly laid out
    # (`RowTables.view_rows`), else None
    view_rows: Mapping[int, tuple[int, int] | None] = field(default_factory=dict)
    grad_history: bool = False  # the tokens before `start` include some computed with grad (see grad.py)
    # copy-on-write of the first group's shared partial last blocks (for the event log): rows, (src, dst) block ids
    cow_rows: tuple[int, ...] = ()
    cow_src: tuple[int, ...] = ()
    cow_dst: tuple[int, ...] = ()
    num_cow_copies: int = 0  # blocks copied in all groups
    num_rows: int = field(default=0)  # batch rows of the step
    # per batch row, the `[lo, hi)` range of the step's new tokens (indices 0 .. num_new - 1) that lie in whole
    # blocks of left padding naming the pad block, and are not stored; () when the step names no pad block
    pad_skip: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dup_of", MappingProxyType(dict(self.dup_of)))
        object.__setattr__(self, "view_base", MappingProxyType(dict(self.view_base)))
        object.__setattr__(self, "view_rows", MappingProxyType(dict(self.view_rows)))

    @property
    def num_new(self) -> int:
        """New tokens per row."""
        return self.end - self.start

    @property
    def stores_every_token(self) -> bool:
        """Whether every new token of the writers is stored (no whole block of padding names the pad block)."""
        return not any(self.pad_skip[r][1] > self.pad_skip[r][0] for r in self.writers) if self.pad_skip else True

    def covers(self, start: int, num_new: int, batch: int) -> bool:
        """Whether a layer holding `start` tokens that gets `num_new` tokens for `batch` rows is in this step."""
        return (start, start + num_new, batch) == (self.start, self.end, self.num_rows)

    def with_writer(self, row: int) -> StepPlan:
        """This plan after duplicate `row` got its own copy of the step's blocks (`StepPlanner.unshare`)."""
        dup_of = {r: w for r, w in self.dup_of.items() if r != row}
        return replace(self, writers=tuple(sorted((*self.writers, row))), dup_of=dup_of)


__all__ = ["StepPlan"]
