"""`AffineCodec`: the shared asymmetric integer scheme of `Int4Codec` and `Int2Codec`, and its bit packing."""

from __future__ import annotations

import torch

from hf_pagedkv.config import RANGE_FITS
from hf_pagedkv.storage.codecs.base import BlockLayout, Codec, check_finite, fp16_down, fp16_up

#: fractions of a group's range by which ``fit="mse"`` tries moving its minimum up and its maximum down (every pair)
CLIP_STEPS = (0.0, 0.025, 0.05, 0.075, 0.1)
#: least-squares refits of each group's (scale, minimum) to its codes (``fit="lsq"``; after the clip search: "mse")
NUM_REFITS = 2


class AffineCodec(Codec):
    """Asymmetric `bits`-bit codes with a fp16 scale and minimum per group, packed by token parts (see
    `Int4Codec`; `ReferenceCodec` is the specification of ``fit="minmax"``, and the tests check equality with it).

    Args:
        axis, group_size: see `Codec`.
        fit (`str`, *optional*, defaults to `"minmax"`): how `encode` picks each group's range (`fit_range`; the
            stored format and `decode` are the same for all three): `"minmax"` covers the group, so no element clips;
            `"lsq"` refits min/max's range by least squares; `"mse"` also searches clipped ranges.

    Raises:
        ValueError: an unknown `fit` (and as `Codec`).
    """

    is_affine = True

    def __init__(self, axis: str, group_size: int = 64, fit: str = "minmax") -> None:
        super().__init__(axis, group_size)
        if fit not in RANGE_FITS:
            raise ValueError(f"`fit` must be one of {', '.join(RANGE_FITS)}; got {fit!r}.")
        self.fit = fit  # how encode picks each group's range; fixed

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + (f", fit={self.fit!r})" if self.fit != "minmax" else ")")

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
        lo, scale = fit_range(xg, red, qmax, self.fit)  # fp16, broadcastable against xg
        q = quantize(xg, lo, scale, qmax).to(torch.int32).reshape(x.shape)  # [..., B, D]
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


def quantize(xg: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Codes ``round((x - lo) / scale)`` clamped to ``[0, qmax]``, float32, shaped as `xg` (grouped fp32 values;
    `lo` and `scale` fp16, broadcastable; a zero scale gives code 0)."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return torch.round((xg - lo.float()) / safe).clamp_(0, qmax)


def squared_error(xg: torch.Tensor, red: int, lo: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Each group's sum of squared reconstruction errors, fp32, keepdim over `red` (arguments as `quantize`)."""
    return (quantize(xg, lo, scale, qmax).mul_(scale.float()).add_(lo.float()).sub_(xg)).square_().sum(red,
                                                                                                       keepdim=True)


def fit_range(xg: torch.Tensor, red: int, qmax: int, fit: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's fp16 minimum and scale for ``qmax + 1`` levels, `[...]` keepdim over `red` (`xg`: grouped fp32
    values, dim `red` running over each group's members).

    - ``"minmax"``: ``m = min`` rounded down to fp16, ``s = (max - m) / qmax`` rounded up, so the levels cover the
      group and nothing clips: ``|x - x_hat| <= s / 2``.
    - ``"lsq"``: from ``"minmax"``'s parameters, `NUM_REFITS` times, the least-squares line through each group's
      (code, value) pairs gives a new scale and minimum (rounded to the nearest fp16), and the codes are taken
      again.
    - ``"mse"``: first the candidates that move the minimum up and the maximum down by every pair of `CLIP_STEPS`
      fractions of the range (rounded to the nearest fp16), then ``"lsq"``'s refits from the best of them.

    For ``"lsq"`` and ``"mse"``, a group keeps a candidate only when its squared error is strictly lower than the
    best so far, so its error never exceeds ``"minmax"``'s, and a group no candidate helps keeps exactly
    ``"minmax"``'s parameters.
    Clipped elements may err by more than ``s / 2``. On SmolLM2's rotated values (int4, groups of 64) the mean
    squared error falls by about 10% (``"lsq"``) or 18% (``"mse"``, about what halving the group size gives); the
    encode takes about 3x (``"lsq"``) or 20x (``"mse"``) min/max's elementwise work. A lower squared error is not
    always less drift (docs/quantization.md): stores refit rotated values only (`QuantConfig.value_fit`) and keep
    ``"minmax"`` for keys.

    Raises:
        ValueError: a range beyond fp16.
    """
    mn, mx = xg.amin(red, keepdim=True), xg.amax(red, keepdim=True)
    lo = fp16_down(mn)  # fp16, <= every member
    scale = fp16_up((mx - lo.float()) / qmax)  # fp16, lo + qmax * scale >= max
    if fit == "minmax":
        return lo, scale
    best = squared_error(xg, red, lo, scale, qmax)
    width = mx - mn

    def keep(lo_c: torch.Tensor, scale_c: torch.Tensor) -> None:
        nonlocal lo, scale, best
        err = squared_error(xg, red, lo_c, scale_c, qmax)
        better = err < best
        lo, scale, best = torch.where(better, lo_c, lo), torch.where(better, scale_c, scale), torch.minimum(err, best)

    steps = CLIP_STEPS if fit == "mse" else ()
    for a in steps:
        for b in steps:
            if a or b:
                lo_c = (mn + a * width).half()
                keep(lo_c, ((mx - b * width - lo_c.float()) / qmax).clamp_(min=0).half())
    n = xg.shape[red]
    for _ in range(NUM_REFITS):  # x ~ m + s * q: least squares over each group's members
        q = quantize(xg, lo, scale, qmax)
        sq, sx = q.sum(red, keepdim=True), xg.sum(red, keepdim=True)
        det = n * q.square().sum(red, keepdim=True) - sq * sq  # 0 iff every code is equal
        ok = det > 0
        s_c = torch.where(ok, (n * (q * xg).sum(red, keepdim=True) - sq * sx) / torch.where(ok, det, 1.0),
                          scale.float())
        lo_c = torch.where(ok, (sx - s_c * sq) / n, lo.float())
        keep(lo_c.half(), s_c.clamp_(min=0).half())
    return lo, scale


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
