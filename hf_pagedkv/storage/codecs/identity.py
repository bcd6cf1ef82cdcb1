"""`IdentityCodec`: full precision through the codec interface (for `QuantConfig(key_bits=None, ...)` halves)."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.base import BlockLayout, Codec


class IdentityCodec(Codec):
    """No quantization: the codes are the input values in their own dtype, and there are no scales.

    Used for the full-precision half of a mixed config such as `v8` (fp keys, int8 values), so that both halves of
    a quantized pool share one storage path. Error bound: exact (``x_hat == x``).
    """

    name = "identity"
    bits = None
    is_affine = True  # with scale 1: the codes are the values

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        return BlockLayout(block_size * dim, dtype, 0, torch.float16)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = x.flatten(-2).clone()  # [..., B * D] in x's dtype
        return codes, x.new_empty((*x.shape[:-2], 0), dtype=torch.float16)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(codes.unflatten(-1, out.shape[-2:]))  # [..., B, D]

    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return codes.unflatten(-1, out.shape[-2:])  # [..., B, D]: a view, `out` is not written

    def affine(self, scales: torch.Tensor, dtype: torch.dtype) -> tuple[None, None]:
        return None, None
