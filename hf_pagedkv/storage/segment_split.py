"""`SegmentSplit`: where the entries of an index tensor lie among a `SegmentedTensor`'s segments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentSplit:
    """An index `[n]` split by storage segment, computed once and reused by every tensor with the same segments
    (all layers of a store: one split per step, not one per layer).

    Attributes:
        base (`int`): the segment holding the most entries.
        base_local (`torch.LongTensor` of shape `[n]`): each entry's index inside `base`; entries that lie in
            another segment are clamped into it (a harmless read, overwritten from `patches`).
        parts (`tuple`): `(segment, positions, local)` for every segment holding entries, `base` included:
            `positions` (`[n_s]`) into the index, `local` (`[n_s]`) inside that segment. Empty when every entry is
            in `base` (then `base_local` is exact).
        size (`int`): chunk size the indices count in (1: entries; `block_size`: whole blocks).
    """

    base: int
    base_local: torch.Tensor
    parts: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    size: int

    @property
    def single(self) -> bool:
        """Every entry lies in segment `base`."""
        return not self.parts

    @property
    def patches(self) -> tuple[tuple[int, torch.Tensor, torch.Tensor], ...]:
        """`parts` without `base`: what a gather from `base` must overwrite."""
        return tuple(p for p in self.parts if p[0] != self.base)


__all__ = ["SegmentSplit"]
