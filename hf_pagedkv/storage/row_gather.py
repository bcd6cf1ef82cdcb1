"""`RowGather`: the flat row indices of a batch-major gather from a `SegmentedTensor`, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGather:
    """Where every `(row, head, chunk)` of a batch-major gather reads, for tensors with the same segments and `d0`
    (every layer's keys and values of a page store: built once per step, not per layer). A chunk is `size`
    consecutive entries: one token (`size` 1, what `PageStore.read_blocks` gathers) or a whole block.

    A segment `[d0, n_s * size, d2]` (contiguous) is read as a matrix `[d0 * n_s, size * d2]`, so chunk `c` of head
    `h` is its row ``h * n_s + c``; one `index_select` of those rows along dim 0 gives the output
    `[batch * d0 * n, size * d2]`, i.e. `[batch, d0, n * size, d2]` contiguous, the layout `DynamicCache`'s
    `torch.cat` returns and `scaled_dot_product_attention` reads.

    Attributes:
        batch, d0, n (`int`): output rows, heads and chunks per row.
        base (`int`): the segment read for every output row.
        base_rows (`torch.LongTensor` of shape `[batch * d0 * n]`): the row of `base`'s matrix each output row reads
            (rows whose chunk lies elsewhere read a clamped one, overwritten from `patches`).
        patches (`tuple`): `(segment, out_rows, src_rows)` for every other segment touched: output rows (`[m]`) and
            the rows of that segment's matrix they hold (`[m]`).
        size (`int`): entries per chunk (1: tokens; `block_size`: blocks).
    """

    batch: int
    d0: int
    n: int
    base: int
    base_rows: torch.Tensor
    patches: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    size: int


__all__ = ["RowGather"]
