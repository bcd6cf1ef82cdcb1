"""`CodeLayout`: where a step's quantized read lies in the block tables, alike for every layer of a layer group."""

from __future__ import annotations

from typing import NamedTuple

import torch


class CodeLayout(NamedTuple):
    """What `QuantizedPageStore.code_layout` returns: the half of a `CodeTable` that depends on the block table and
    the block states only, not on the layer. Every layer of a layer group reads the same blocks in a forward step, so
    an attention that reads in place computes it once per step and group (`PagedView`'s step-shared memo) and gets
    each layer's `CodeTable` from it (`QuantizedPageStore.layer_table`): the per-layer part only picks tensors.

    Attributes:
        lo, end (`int`): the tokens read (``lo`` a multiple of the block size).
        start (`int`): the step's first new token (``end`` when the read holds no new tokens).
        ids (`torch.LongTensor` of shape `[batch, n]`, CPU, contiguous): each row's encoded blocks, in order.
        rest (`int`): tokens of each row's partial block staged before this step (0: none).
        stage (`torch.LongTensor` of shape `[batch]`, *optional*): each row's first staging slot of that block.
        sink_end (`int`): one past the last sink token read in full precision (0: none).
        sink_slot (`torch.LongTensor` of shape `[batch]`, *optional*): each row's first sink slot.
        sink_rows (`tuple[list[int], list[int | None]]`, *optional*): when some rows have a sink stage and some do
            not (set_padding's pad block, a first block freed by retention): each row's first block and sink stage
            (None: none), for the layer's own gathered sink tokens (`QuantizedReader._row_sinks`); None otherwise.
    """

    lo: int
    end: int
    start: int
    ids: torch.Tensor
    rest: int
    stage: torch.Tensor | None
    sink_end: int
    sink_slot: torch.Tensor | None
    sink_rows: tuple[list[int], list[int | None]] | None


__all__ = ["CodeLayout"]
