"""`Int3Codec`: asymmetric int3 codes as two bit planes (a 2-bit plane and a 1-bit plane), with fp16 scales."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.affine import AffineCodec, pack, unpack_into


class Int3Codec(AffineCodec):
    """Asymmetric int3: ``q = round((x - m) / s)`` in [0, 7], ``x ~ m + q * s``; fp16 scale `s` and minimum `m`.

    - Parameters, grouping and scale layout as `Int4Codec`, with ``s = (max - m) / 7``.
    - Packing: two bit planes, 3 bytes per 8 codes. The low two bits of every code are packed as `Int2Codec` packs
      its codes (`[B / 4, D]` bytes, four token quarters per byte), then the high bit as 1-bit codes (`[B / 8, D]`
      bytes, token eighths, lowest bit first); code bytes are ``[low plane | high plane]``, `3 * B * D / 8` in all
      (`block_size` a multiple of 8). Planes keep the shifts byte-aligned and vectorised, as the 4-bit packing.
    - Error bound: ``|x - x_hat| <= s / 2``, about (max - min) / 14 per group.
    """

    name = "int3"
    bits = 3

    @property
    def tokens_per_pack(self) -> int:
        return 8

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        B = q.shape[-2]
        low, high = pack(q & 3, 2), pack(q >> 2, 1)  # [..., B // 4, D], [..., B // 8, D]
        assert low.shape[-2] + high.shape[-2] == 3 * B // 8
        return torch.cat((low, high), -2)  # [..., 3 * B // 8, D]

    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        planes = codes.unflatten(-1, (-1, D))  # [..., 3 * B // 8, D]
        low, high = planes[..., : B // 4, :], planes[..., B // 4:, :]
        unpack_into(low, 2, out)  # [..., B, D]: the low two bits
        top = torch.empty_like(out)
        unpack_into(high, 1, top)  # [..., B, D]: the high bit
        return out.add_(top.mul_(4))
