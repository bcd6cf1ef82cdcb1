"""`Int4Codec`: asymmetric int4 codes, two per byte, with fp16 scales and minimums."""

from __future__ import annotations

from hf_pagedkv.storage.codecs.affine import AffineCodec


class Int4Codec(AffineCodec):
    """Asymmetric int4: ``q = round((x - m) / s)`` in [0, 15], ``x ~ m + q * s``; fp16 scale `s` and minimum `m`.

    - Parameters: ``m = min(group)`` rounded *down* to fp16, ``s = (max(group) - m) / 15`` rounded *up*, so the
      group's range is covered and nothing clips. A constant group gets ``s = 0`` (or one fp16 step) and decodes
      to within fp16 rounding of its value. (``fit="minmax"``, the default; ``"lsq"`` and ``"mse"`` refit or clip
      the range for a lower squared error, `fit_range`: same format.)
    - Grouping: ``axis="channel"``: per channel over the block's tokens (keys); ``axis="token"``: per token, groups of
      `group_size` channels (values). Scales are stored `[scales..., minimums...]`, fp16.
    - Packing: two codes per byte, low nibble first, split by token halves of the block: byte ``(t, c)`` of the
      `[block_size / 2, dim]` code array holds token `t` (bits 0-3) and token ``t + block_size / 2`` (bits 4-7) of
      channel `c`. Unpacking then writes two contiguous half-blocks, about 2.5x faster on CPU than interleaved
      pairs (needs an even `block_size`).
    - Error bound (``fit="minmax"``): ``|x - x_hat| <= s / 2`` (plus fp32 rounding), about (max - min) / 30 per group.
    """

    name = "int4"
    bits = 4
