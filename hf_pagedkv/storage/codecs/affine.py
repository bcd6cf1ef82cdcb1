"""`AffineCodec`: the shared asymmetric integer scheme of `Int4Codec` and `Int2Codec`, and its bit packing."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.base import BlockLayout, Codec, check_finite, fp16_down, fp16_up


class AffineCodec(Codec):
    """Asymmetric `bits`-bit codes with a fp16 scale and minimum per group, packed by token parts (see
    `Int4Codec`; `ReferenceCodec` is the specification, and the tests check equality with it)."""

    is_affine = True

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        self.check_block_size(block_size)
        return BlockLayout(block_size * dim * self.bits // 8, torch.uint8, 2 * self.num_groups(block_size, dim),
                           torch.float16)

    @property
    def tokens_per_pack(self) -> int:
        """Tokens whose codes of one channel share whole bytes (`block_size` must be a multiple)."""
        return 8 // self.bits

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.tokens_per_pack:
            raise ValueError(f"{self.bits}-bit codes pack {self.tokens_per_pack} tokens together: block_size="
                             f"{block_size} must be a multiple of {self.tokens_per_pack} (quantized pools default "
                             "to 32).")

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """Integer codes `[..., B, D]` -> bytes `[..., code_size // D, D]` (`pack`)."""
        return pack(q, self.bits)


    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_finite(x)
        qmax = 2**self.bits - 1
        xg, red = self.grouped(x.float())
        lo = fp16_down(xg.amin(red, keepdim=True))  # fp16, <= every member
        scale = fp16_up((xg.amax(red, keepdim=True) - lo.float()) / qmax)  # fp16, lo + qmax * scale >= max
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        q = torch.round((xg - lo.float()) / safe).clamp_(0, qmax).to(torch.int32).reshape(x.shape)  # [..., B, D]
        scales = torch.cat((scale.reshape(*x.shape[:-2], -1), lo.reshape(*x.shape[:-2], -1)), -1)  # [..., 2 * groups]
        return self.pack(q).flatten(-2), scales  # codes [..., B // per_byte * D]

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        self.unpack(codes, out)  # [..., B, D] integer values
        scale, lo = scales.to(out.dtype).chunk(2, dim=-1)  # [..., groups] each
        og, _ = self.grouped(out)
        scale, lo = self.stats_view(scale, B, D), self.stats_view(lo, B, D)
        if self.axis == "channel":
            torch.addcmul(lo, og, scale, out=og)  # q * s + m in one pass
        else:  # NOTE: addcmul is 5x slower than mul_ + add_ when the broadcast dim is the innermost one (CPU)
            og.mul_(scale).add_(lo)
        return out

    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return unpack_into(codes.unflatten(-1, (-1, out.shape[-1])), self.bits, out)  # [..., B, D] values

    def affine(self, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scale, lo = scales.to(dtype).chunk(2, dim=-1)  # [..., groups] each: x_hat = q * s + m
        return scale, lo


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
