"""Vectorised integer codecs (the default fast path): `Int8Codec`, `Int4Codec`, `Int2Codec`.

`tests/test_codecs.py` checks that each one produces exactly the codes, scales and reconstruction of
`ReferenceCodec` (codecs/reference.py, the plain specification) for the same bit width.
"""

from __future__ import annotations

import torch

from .base import BlockLayout, Codec, check_finite, fp16_down, fp16_up


class Int8Codec(Codec):
    """Symmetric int8: ``q = round(x / s)`` in [-127, 127], ``x ~ q * s`` with one fp16 scale per group.

    - Scale: ``s = absmax(group) / 127``, rounded *up* to fp16, so no element clips.
    - Grouping: ``axis="channel"``: per channel over the block's tokens; ``axis="token"``: per token, groups of
      `group_size` channels. Codes are int8 stored as bytes, `[block_size, dim]` token-major.
    - Error bound: ``|x - x_hat| <= s / 2`` (plus fp32 rounding), i.e. <= absmax / 254 per group.

    NOTE: symmetric, not asymmetric: at 8 bits the zero point buys almost nothing (half a step of 1/254 of the
    range), while the extra fp16 per group would cost 1/16 B per key element at 32-token blocks, the difference
    between meeting and missing the k8v4 memory target (0.41 vs 0.44 of fp16).
    """

    name = "int8"
    bits = 8

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        return BlockLayout(block_size * dim, torch.uint8, self.num_groups(block_size, dim), torch.float16)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_finite(x)
        B, D = x.shape[-2:]
        xg, red = self.grouped(x.float())
        scale = fp16_up(xg.abs().amax(red, keepdim=True) / 127)  # [..., groups] broadcastable, fp16
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        q = torch.round(xg / safe).clamp_(-127, 127).to(torch.int8)  # same shape as xg
        codes = q.reshape(*x.shape[:-2], B * D).view(torch.uint8)  # [..., B * D] bytes
        return codes, scale.reshape(*x.shape[:-2], -1)  # scales [..., groups]

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        out.copy_(codes.view(torch.int8).unflatten(-1, (B, D)))  # [..., B, D]
        og, _ = self.grouped(out)
        og.mul_(self.stats_view(scales.to(out.dtype), B, D))  # NOTE: mixed-dtype in-place ops are slow on CPU
        return out


class _AffineCodec(Codec):
    """Asymmetric `bits`-bit codes with a fp16 scale and minimum per group, packed split-half (see subclasses)."""

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        per_byte = 8 // self.bits
        if block_size % per_byte:
            raise ValueError(f"{self.name} packs {per_byte} tokens per byte: block_size={block_size} must be a "
                             "multiple of it.")
        return BlockLayout(block_size * dim // per_byte, torch.uint8, 2 * self.num_groups(block_size, dim),
                           torch.float16)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_finite(x)
        qmax = 2**self.bits - 1
        xg, red = self.grouped(x.float())
        lo = fp16_down(xg.amin(red, keepdim=True))  # fp16, <= every member
        scale = fp16_up((xg.amax(red, keepdim=True) - lo.float()) / qmax)  # fp16, lo + qmax * scale >= max
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        q = torch.round((xg - lo.float()) / safe).clamp_(0, qmax).to(torch.int32).reshape(x.shape)  # [..., B, D]
        scales = torch.cat((scale.reshape(*x.shape[:-2], -1), lo.reshape(*x.shape[:-2], -1)), -1)  # [..., 2 * groups]
        return pack(q, self.bits).flatten(-2), scales  # codes [..., B // per_byte * D]

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        unpack_into(codes.unflatten(-1, (-1, D)), self.bits, out)  # [..., B, D] integer values
        scale, lo = scales.to(out.dtype).chunk(2, dim=-1)  # [..., groups] each
        og, _ = self.grouped(out)
        scale, lo = self.stats_view(scale, B, D), self.stats_view(lo, B, D)
        if self.axis == "channel":
            torch.addcmul(lo, og, scale, out=og)  # q * s + m in one pass
        else:  # NOTE: addcmul is 5x slower than mul_ + add_ when the broadcast dim is the innermost one (CPU)
            og.mul_(scale).add_(lo)
        return out


class Int4Codec(_AffineCodec):
    """Asymmetric int4: ``q = round((x - m) / s)`` in [0, 15], ``x ~ m + q * s``; fp16 scale `s` and minimum `m`.

    - Parameters: ``m = min(group)`` rounded *down* to fp16, ``s = (max(group) - m) / 15`` rounded *up*, so the
      group's range is covered and nothing clips. A constant group gets ``s = 0`` (or one fp16 step) and decodes
      to within fp16 rounding of its value.
    - Grouping: ``axis="channel"``: per channel over the block's tokens (keys); ``axis="token"``: per token, groups of
      `group_size` channels (values). Scales are stored `[scales..., minimums...]`, fp16.
    - Packing: two codes per byte, low nibble first, split by token halves of the block: byte ``(t, c)`` of the
      `[block_size / 2, dim]` code array holds token `t` (bits 0-3) and token ``t + block_size / 2`` (bits 4-7) of
      channel `c`. Unpacking then writes two contiguous half-blocks, about 2.5x faster on CPU than interleaved
      pairs (needs an even `block_size`).
    - Error bound: ``|x - x_hat| <= s / 2`` (plus fp32 rounding), about (max - min) / 30 per group.
    """

    name = "int4"
    bits = 4


class Int2Codec(_AffineCodec):
    """Asymmetric int2: ``q = round((x - m) / s)`` in [0, 3], ``x ~ m + q * s``; fp16 scale `s` and minimum `m`.

    - Parameters, grouping and scale layout as `Int4Codec`, with ``s = (max - m) / 3``.
    - Packing: four codes per byte, lowest bits first, split by token quarters of the block: byte ``(t, c)`` holds
      tokens `t`, ``t + B / 4``, ``t + B / 2``, ``t + 3 B / 4`` of channel `c` in bits 0-1, 2-3, 4-5, 6-7
      (`block_size` a multiple of 4).
    - Error bound: ``|x - x_hat| <= s / 2``, about (max - min) / 6 per group.
    """

    name = "int2"
    bits = 2


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes of whole blocks `[..., B, D]` (values < 2**bits) into bytes `[..., B // k, D]`,
    ``k = 8 // bits``: token part `i` (tokens ``i * B / k .. (i + 1) * B / k - 1``) goes to bits ``i * bits ..``."""
    k = 8 // bits
    parts = q.unflatten(-2, (k, q.shape[-2] // k))  # [..., k, B // k, D]
    packed = parts[..., 0, :, :].clone()
    for i in range(1, k):
        packed |= parts[..., i, :, :] << (i * bits)
    return packed.to(torch.uint8)  # [..., B // k, D]


def unpack_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: bytes `[..., B // k, D]` -> integer values written (as floats) into `out` `[..., B, D]`."""
    k, mask = 8 // bits, 2**bits - 1
    parts = out.unflatten(-2, (k, out.shape[-2] // k))  # [..., k, B // k, D]: contiguous token runs
    parts[..., 0, :, :].copy_(codes & mask)
    for i in range(1, k - 1):
        parts[..., i, :, :].copy_((codes >> (i * bits)) & mask)
    parts[..., k - 1, :, :].copy_(codes >> ((k - 1) * bits))  # uint8: a logical shift leaves only the top part
    return out
