"""`ReferenceCodec`: the plain-torch specification of the integer codecs, written for reading, not for speed."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.base import BlockLayout, Codec, check_finite, fp16_down, fp16_up


class ReferenceCodec(Codec):
    """The integer schemes spelled out group by group and byte by byte; `Int8Codec`, `Int4Codec` and `Int2Codec`
    must reproduce its codes, scales and reconstruction exactly (with min/max ranges, ``fit="minmax"``: the other
    range fits choose other parameters of the same format).

    - 8 bits, symmetric: ``s = absmax / 127`` (fp16, rounded up), ``q = round(x / s)`` in [-127, 127], one int8
      per byte, ``x_hat = q * s``. Scales: one fp16 per group.
    - 4 and 2 bits, asymmetric: ``m = min`` (fp16, rounded down), ``s = (max - m) / (2**bits - 1)`` (fp16, rounded
      up), ``q = round((x - m) / s)``, ``x_hat = q * s + m``. Scales: all `s`, then all `m`, fp16.
    - Groups: ``axis="channel"``: the block's tokens of one channel; ``axis="token"``: `group_size` consecutive
      channels of one token. Groups are numbered channel-major (channel axis) or token-major (token axis).
    - Packing (4 and 2 bits): ``k = 8 // bits`` codes per byte; token `t` of channel `c` goes to byte
      ``(t % (B / k), c)`` of the `[B / k, D]` code array, bits ``(t // (B / k)) * bits`` upwards (lowest first).
    - Error bound: ``|x - x_hat| <= s / 2`` per element (plus fp32 rounding).

    Args:
        bits (`int`): 8, 4 or 2.
        axis, group_size: see `Codec`.
    """

    name = "reference"

    def __init__(self, bits: int, axis: str, group_size: int = 64) -> None:
        super().__init__(axis, group_size)
        if bits not in (8, 4, 2):
            raise ValueError(f"ReferenceCodec `bits` must be 8, 4 or 2, got {bits!r}.")
        self.bits = bits

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        per_scale = 1 if self.bits == 8 else 2
        if block_size % (8 // self.bits):
            raise ValueError(f"{8 // self.bits} tokens share a byte: block_size={block_size} must be a multiple.")
        groups = self.num_groups(block_size, dim)
        return BlockLayout(block_size * dim * self.bits // 8, torch.uint8, per_scale * groups, torch.float16)

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., B, D]` -> `[..., num_groups, members]`, groups numbered as in the class docstring."""
        B, D = x.shape[-2:]
        if self.axis == "channel":
            return x.transpose(-1, -2)  # [..., D, B]: row c = channel c over the tokens
        g = self.group(D)
        return x.reshape(*x.shape[:-2], B * (D // g), g)  # row t * (D // g) + j = channels j*g..(j+1)*g of token t

    def _ungroup(self, xg: torch.Tensor, B: int, D: int) -> torch.Tensor:
        return xg.transpose(-1, -2) if self.axis == "channel" else xg.reshape(*xg.shape[:-2], B, D)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_finite(x)
        B, D = x.shape[-2:]
        rows = self._groups(x.float())  # [..., groups, members]
        if self.bits == 8:
            s = fp16_up(rows.abs().amax(-1) / 127)  # [..., groups]
            q = torch.round(rows / torch.where(s == 0, 1.0, s.float()).unsqueeze(-1)).clamp(-127, 127)
            codes = self._ungroup(q, B, D).to(torch.int8).view(torch.uint8).reshape(*x.shape[:-2], B * D)
            return codes, s
        qmax = 2**self.bits - 1
        m = fp16_down(rows.amin(-1))  # [..., groups]
        s = fp16_up((rows.amax(-1) - m.float()) / qmax)
        q = torch.round((rows - m.float().unsqueeze(-1)) / torch.where(s == 0, 1.0, s.float()).unsqueeze(-1))
        q = self._ungroup(q.clamp(0, qmax), B, D).to(torch.int64)  # [..., B, D]
        k = 8 // self.bits
        packed = torch.zeros((*x.shape[:-2], B // k, D), dtype=torch.int64)
        for t in range(B):  # one token at a time, as the docstring says
            packed[..., t % (B // k), :] |= q[..., t, :] << ((t // (B // k)) * self.bits)
        return packed.to(torch.uint8).reshape(*x.shape[:-2], -1), torch.cat((s, m), -1)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, D = out.shape[-2:]
        if self.bits == 8:
            q = codes.view(torch.int8).reshape(*codes.shape[:-1], B, D).float()
            x = self._ungroup(self._groups(q) * scales.float().unsqueeze(-1), B, D)
            return out.copy_(x)
        k = 8 // self.bits
        byte = codes.to(torch.int64).reshape(*codes.shape[:-1], B // k, D)
        q = torch.empty((*codes.shape[:-1], B, D))
        for t in range(B):
            q[..., t, :] = ((byte[..., t % (B // k), :] >> ((t // (B // k)) * self.bits)) & (2**self.bits - 1)).float()
        s, m = scales.float().chunk(2, dim=-1)  # [..., groups]
        return out.copy_(self._ungroup(self._groups(q) * s.unsqueeze(-1) + m.unsqueeze(-1), B, D))
