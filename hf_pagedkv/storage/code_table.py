"""`CodeTable`: a quantized layer's tokens as an attention reads them through the block table, nothing gathered."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_pagedkv.storage.codecs import Codec
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor


class CodeTable(NamedTuple):
    """What `QuantizedPageStore.code_table` returns: tokens ``lo .. end - 1`` of every row (``lo`` a multiple of
    `block_size`) where they lie, as a kernel that follows block ids reads them. Columns, as `CodeRead`'s::

        [ encoded blocks: ids[:, j] ] [ staged partial block: rest ] [ step's tokens: q ]   (then the sink tokens)

    Attributes:
        lo, end (`int`): the tokens read.
        block_size (`int`): tokens per block.
        dims (`tuple[int, int]`): key and value head dims.
        codecs (`tuple[Codec, Codec]`): the key and the value codec.
        ids (`torch.LongTensor` of shape `[batch, n]`, CPU, contiguous): each row's encoded blocks, in order.
        codes, scales (`tuple[SegmentedTensor, SegmentedTensor]`): the layer's whole pool of key and value codes
            and scales, `[num_kv_heads, num_blocks, size]` each (indexed by `ids`), in one or more storage segments.
        rest (`int`): tokens of each row's partial block staged before this step (0: none).
        stage (`torch.LongTensor` of shape `[batch]`, *optional*): each row's first staging slot of that block.
        staged (`tuple[torch.Tensor, torch.Tensor]`, *optional*): the layer's staged keys and values,
            `[num_kv_heads, slots, dim]` (None when `rest` is 0).
        new (`tuple[torch.Tensor, torch.Tensor]`, *optional*): the step's keys and values, `[batch, num_kv_heads,
            q, dim]` (None: no new tokens in the read).
        sink_end (`int`): one past the last sink token read in full precision (0: none; then ``lo == 0``).
        sink_slot (`torch.LongTensor` of shape `[batch]`, *optional*): each row's first sink slot.
        sinks (`tuple[torch.Tensor, torch.Tensor]`, *optional*): the layer's sink keys and values, `[num_kv_heads,
            slots, dim]`.
    """

    lo: int
    end: int
    block_size: int
    dims: tuple[int, int]
    codecs: tuple[Codec, Codec]
    ids: torch.Tensor
    codes: tuple[SegmentedTensor, SegmentedTensor]
    scales: tuple[SegmentedTensor, SegmentedTensor]
    rest: int
    stage: torch.Tensor | None
    staged: tuple[torch.Tensor, torch.Tensor] | None
    new: tuple[torch.Tensor, torch.Tensor] | None
    sink_end: int
    sink_slot: torch.Tensor | None
    sinks: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def num_encoded(self) -> int:
        """Encoded blocks read per row."""
        return self.ids.shape[1]

    def pools_fit(self, heads: int, device: torch.device) -> bool:
        """Whether the four pool arrays (key codes, key scales, value codes, value scales) have the layout a kernel
        indexes them by: `[heads, blocks, size]` with the codecs' row sizes (int8 keys: a scale per channel; int4:
        scales and minimums; values per token likewise), uint8 codes and fp16 scales, the same segments, each
        contiguous, on `device`."""
        kc, vc = self.codecs
        dim, bs = self.dims[0], self.block_size
        pools = [(self.codes[0], bs * dim * kc.bits // 8, torch.uint8),
                 (self.scales[0], dim * (1 if kc.bits == 8 else 2), torch.float16),
                 (self.codes[1], bs * dim * vc.bits // 8, torch.uint8),
                 (self.scales[1], bs * (1 if vc.bits == 8 else 2), torch.float16)]
        starts = self.codes[0].starts
        return all(t.starts == starts and t.d0 == heads and t.d2 == size and t.dtype == dtype
                   and torch.device(t.device) == device
                   and all(seg.is_contiguous() for seg in t.segments) for t, size, dtype in pools)


__all__ = ["CodeTable"]
