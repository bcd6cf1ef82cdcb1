"""`CodeRead`: a quantized layer's tokens as an attention reads them in place (codes and scales, not de-quantized)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_pagedkv.storage.codecs import Codec


class CodeRead(NamedTuple):
    """What `QuantizedPageStore.read_codes` returns: tokens ``lo .. end - 1`` of every row, laid out in columns
    from the start of the first block read (``pos0 = (lo // block_size) * block_size``)::

        columns:  0 ..                num_encoded * block_size - 1 | .. end - pos0 - 1
                  [ encoded blocks: codes + scales               ] [ tail: full precision ]
                  the sink (pos0 == 0): tokens lo .. sink_end - 1 in full precision, instead of their codes
                  columns before lo - pos0 lie outside the read (a sliding window's first block) and are not read

    Attributes:
        pos0 (`int`): token position of column 0, a multiple of `block_size`.
        lo, end (`int`): the tokens read.
        block_size (`int`): tokens per block.
        dims (`tuple[int, int]`): key and value head dims.
        codecs (`tuple[Codec, Codec]`): the key and the value codec.
        codes (`tuple[torch.Tensor, torch.Tensor]`): key and value codes of the encoded blocks,
            `[num_kv_heads, batch, num_encoded, code_size]` each (a view of the pool when the row's blocks are
            consecutive, else gathered: codes are 1/4 to 1/16 of the full-precision bytes).
        scales (`tuple[torch.Tensor, torch.Tensor]`): their scales, `[num_kv_heads, batch, num_encoded, scale_size]`.
        full (`tuple[torch.Tensor, torch.Tensor]`): keys and values in full precision, `[num_kv_heads, batch, m,
            dim]`: first the tail, the tokens from column ``num_encoded * block_size`` on (the staged partial block
            and the step's own tokens), then the sink tokens ``lo .. sink_end - 1``, which replace their codes.
        sink_end (`int`): one past the last sink token (0: no sink in this read).
    """

    pos0: int
    lo: int
    end: int
    block_size: int
    dims: tuple[int, int]
    codecs: tuple[Codec, Codec]
    codes: tuple[torch.Tensor, torch.Tensor]
    scales: tuple[torch.Tensor, torch.Tensor]
    full: tuple[torch.Tensor, torch.Tensor]
    sink_end: int

    @property
    def num_encoded(self) -> int:
        """Encoded blocks read (from column 0)."""
        return self.codes[0].shape[2]


__all__ = ["CodeRead"]
