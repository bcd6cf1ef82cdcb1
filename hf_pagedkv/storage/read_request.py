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
        slot_source (`callable`, *optional*): `device -> [batch, end - lo]` slots of the tokens, when the caller
            has them already (shared by every layer of a step); computed from `table` otherwise.
    """

    table: torch.Tensor
    lo: int
    end: int
    block_size: int
    first_block: int | None = None
    new: tuple[int, torch.Tensor, torch.Tensor] | None = None
    slot_source: Callable[[torch.device], torch.Tensor] | None = None

    def slots(self, device: torch.device) -> torch.Tensor:
        """Slot of each token ``lo .. end - 1`` of each row: `[batch, end - lo]` int64 on `device`."""
        if self.slot_source is not None:
            return self.slot_source(device)
        B = self.block_size
        first, last = self.lo // B, -(-self.end // B)
        table = self.table[:, first:last]  # [batch, blocks]
        slots = (table[:, :, None] * B + torch.arange(B)).reshape(table.shape[0], -1)  # [batch, blocks * B]
        return slots[:, self.lo - first * B: self.end - first * B].to(device)


__all__ = ["ReadRequest"]
