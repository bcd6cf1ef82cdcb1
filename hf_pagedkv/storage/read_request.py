"""`ReadRequest`: which tokens of which rows a layer reads from its store (the read half of the store interface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ReadRequest:
    """Tokens ``lo .. end - 1`` of every row of a block table, as `PageStore.read` and `QuantizedPageStore.read`
    take them.

    Attributes:
        table (`torch.LongTensor` of shape `[batch, >= ceil(end / block_size)]`, CPU): block id of each absolute
            block position of each row (positions before `lo // block_size` are never read).
        lo, end (`int`): the token range.
        block_size (`int`): tokens per block.
        first_block (`int`, *optional*): for a single row whose blocks are consecutive, the id that block position
            0 would have (token `p` is in slot ``first_block * block_size + p``), so the store reads views; `None`
            otherwise.
        new (`tuple`, *optional*): `(start, key_states, value_states)`, the current step's tokens ``start .. end -
            1`` of every row, `[batch, num_kv_heads, end - start, head_dim]` in full precision (a quantized store
            returns these rather than its staged copies, as transformers' `QuantizedCache` does).
        rows (`tuple[int, int]`, *optional*): for several rows whose blocks are consecutive and evenly spaced,
            `(first, stride)`: token `p` of row `r` is in slot ``(first + r * stride) * block_size + p``, so a
            full-precision store reads one strided view; `None` otherwise.
        block_source (`callable`, *optional*): `device -> [batch, ceil(end / block_size) - lo // block_size]`
            block ids of the read positions (`table`'s columns from ``lo // block_size``) on a device, when the caller
            has them already (shared by every layer of a step); taken from `table` otherwise.
    """

    table: torch.Tensor
    lo: int
    end: int
    block_size: int
    first_block: int | None = None
    new: tuple[int, torch.Tensor, torch.Tensor] | None = None
    block_source: Callable[[torch.device], torch.Tensor] | None = None
    rows: tuple[int, int] | None = None

    @property
    def first_position(self) -> int:
        """Block position of token `lo`."""
        return self.lo // self.block_size

    def blocks(self, device: torch.device) -> torch.Tensor:
        """Block ids of the positions read, `[batch, ceil(end / block_size) - lo // block_size]` int64 on `device`;
        token `lo` is at offset ``lo % block_size`` of the first."""
        if self.block_source is not None:
            return self.block_source(device)
        return self.table[:, self.first_position: -(-self.end // self.block_size)].to(device)


__all__ = ["ReadRequest"]
