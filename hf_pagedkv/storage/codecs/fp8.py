"""`Fp8Codec`: 8-bit floating-point codes (`float8_e4m3fn` or `float8_e5m2`) with fp16 scales."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.base import BlockLayout, Codec, check_finite, fp16_up

#: format name -> torch dtype
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: scale granularities: "group" follows the axis (per channel over the block, or per token and channel group),
#: "block" is one scale per block of one head
SCALES = ("group", "block")


class Fp8Codec(Codec):
    """Symmetric fp8: ``c = fp8(x / s)``, ``x ~ c * s``, one fp16 scale per group, codes stored as their bytes.

    - Formats: ``"e4m3"`` (`torch.float8_e4m3fn`: 3 mantissa bits, largest 448) or ``"e5m2"`` (2 mantissa bits,
      largest 57344). Scale ``s = absmax(group) / largest``, rounded *up* to fp16, so nothing saturates.
    - Grouping (`scales`): ``"group"``: as the integer codecs, per channel over the block's tokens
      (``axis="channel"``) or per token in groups of `group_size` channels (``axis="token"``); ``"block"``: one scale
      for the whole block of one head (``scale_size`` 1; not read in place as an affine form: `decode`).
    - Codes: `[block_size, dim]` token-major, one byte each (the fp8 bit pattern).
    - Error bound: relative to each element, half a unit in the last place: ``|x - x_hat| <= 2**-4 |x|`` (e4m3) or
      ``2**-3 |x|`` (e5m2), plus, near zero, half the smallest subnormal times `s` (``2**-10 s`` e4m3,
      ``2**-17 s`` e5m2). Unlike the integer codecs, small elements of a group keep their relative precision.

    Args:
        fmt (`str`): ``"e4m3"`` or ``"e5m2"``.
        axis, group_size: see `Codec`.
        scales (`str`, *optional*, defaults to ``"group"``): ``"group"`` or ``"block"``.
    """

    name = "fp8"
    bits = 8

    def __init__(self, fmt: str, axis: str, group_size: int = 64, scales: str = "group") -> None:
        super().__init__(axis, group_size)
        if fmt not in FORMATS:
            raise ValueError(f"Fp8Codec `fmt` must be one of {', '.join(FORMATS)}; got {fmt!r}.")
        if scales not in SCALES:
            raise ValueError(f"Fp8Codec `scales` must be one of {', '.join(SCALES)}; got {scales!r}.")
        self.fmt = fmt  # fixed
        self.dtype = FORMATS[fmt]  # the fp8 dtype; fixed
        self.largest = torch.finfo(self.dtype).max  # fixed
        self.per_block = scales == "block"  # one scale per block of one head; fixed
        self.is_affine = not self.per_block  # (a per-block scale has no per-group form for the in-place read)

    def __repr__(self) -> str:
        return f"Fp8Codec({self.fmt!r}, axis={self.axis!r}, scales={'block' if self.per_block else 'group'!r})"

    def num_groups(self, block_size: int, dim: int) -> int:
        return 1 if self.per_block else super().num_groups(block_size, dim)

    def grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.per_block:
            return x.flatten(-2), -1  # [..., B * D] reduced over the whole block
        return super().grouped(x)

    def stats_view(self, stats: torch.Tensor, block_size: int, dim: int) -> torch.Tensor:
        if self.per_block:
            return stats  # [..., 1] against [..., B * D]
        return super().stats_view(stats, block_size, dim)

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        return BlockLayout(block_size * dim, torch.uint8, self.num_groups(block_size, dim), torch.float16)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_finite(x)
        B, D = x.shape[-2:]
        xg, red = self.grouped(x.float())
        scale = fp16_up(xg.abs().amax(red, keepdim=True) / self.largest)  # fp16, absmax / scale <= largest
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        c = (xg / safe).clamp_(-self.largest, self.largest).to(self.dtype)  # same shape as xg
        codes = c.reshape(*x.shape[:-2], B * D).view(torch.uint8)  # [..., B * D] bytes
        return codes, scale.reshape(*x.shape[:-2], -1)  # scales [..., groups]

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        self.unpack(codes, out)  # [..., B, D] code values
        if self.per_block:  # (not through `grouped`: flattening a strided `out` would copy it)
            return out.mul_(scales.to(out.dtype).unsqueeze(-1))  # [..., 1, 1] against [..., B, D]
        og, _ = self.grouped(out)
        og.mul_(self.stats_view(scales.to(out.dtype), B, D))
        return out

    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(codes.view(self.dtype).unflatten(-1, out.shape[-2:]))  # [..., B, D] code values

    def affine(self, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        if self.per_block:
            raise NotImplementedError("Fp8Codec with per-block scales is read by decode().")
        return scales.to(dtype), None  # symmetric: x_hat = c * s
