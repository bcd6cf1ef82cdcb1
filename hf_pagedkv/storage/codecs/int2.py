"""`Int2Codec`: asymmetric int2 codes, four per byte, with fp16 scales and minimums."""

from __future__ import annotations

from hf_pagedkv.storage.codecs.affine import AffineCodec


class Int2Codec(AffineCodec):
    """Asymmetric int2: ``q = round((x - m) / s)`` in [0, 3], ``x ~ m + q * s``; fp16 scale `s` and minimum `m`.

    - Parameters, grouping and scale layout as `Int4Codec`, with ``s = (max - m) / 3``.
    - Packing: four codes per byte, lowest bits first, split by token quarters of the block: byte ``(t, c)`` holds
      tokens `t`, ``t + B / 4``, ``t + B / 2``, ``t + 3 B / 4`` of channel `c` in bits 0-1, 2-3, 4-5, 6-7
      (`block_size` a multiple of 4).
    - Error bound: ``|x - x_hat| <= s / 2``, about (max - min) / 6 per group.
    """

    name = "int2"
    bits = 2
