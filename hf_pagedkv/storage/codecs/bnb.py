"""`BnbCodec`: blockwise NF4 / int8 from bitsandbytes (optional: the `quant` extra, ``pip install -e '.[quant]'`` in a
clone of hf_pagedkv, or ``pip install bitsandbytes``)."""

from __future__ import annotations

import torch

from hf_pagedkv.errors import install_hint
from hf_pagedkv.storage.codecs.base import BlockLayout, Codec, check_finite, fp16_up

_INSTALL = install_hint("quant", "'bitsandbytes>=0.45'")


def _bnb():
    try:
        import bitsandbytes.functional as F
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"QuantConfig(backend='bitsandbytes') needs bitsandbytes: {_INSTALL}") from e
    return F


class BnbCodec(Codec):
    """bitsandbytes blockwise quantization, symmetric (absmax) with a non-uniform code book.

    - 4 bits: NF4 (Dettmers et al. 2023, QLoRA, arXiv 2305.14314), 16 normal-quantile levels scaled by the group's
      absmax; packed two per byte in bitsandbytes' order (first element in the high nibble).
    - 8 bits: bitsandbytes' dynamic blockwise int8 map (arXiv 2110.02861), 256 levels scaled by the absmax.
    - Grouping: a bitsandbytes block is a run of contiguous elements, so ``axis="channel"`` (keys) transposes each
      block to `[dim, block_size]` and uses `block_size` as the bitsandbytes block size (per channel over the
      block's tokens), and ``axis="token"`` (values) uses `group_size` channels of one token.
    - Scales: the absmax per group, stored fp16 (rounded up; bitsandbytes computes in fp32, the relative
      difference is below 2**-11).
    - Error bound: NF4 about absmax / 10 at worst (levels are densest near 0), typically below the uniform
      `Int4Codec` on Gaussian data; int8 dynamic about absmax / 100 at worst near the ends of the range.

    Args:
        bits (`int`): 8 or 4.
        axis, group_size: see `Codec`.
    """

    name = "bitsandbytes"

    def __init__(self, bits: int, axis: str, group_size: int = 64) -> None:
        super().__init__(axis, group_size)
        if bits not in (8, 4):
            raise ValueError(f"BnbCodec `bits` must be 8 or 4, got {bits!r}.")
        self.bits = bits
        self._code = None  # bitsandbytes' 256-entry dynamic map for 8 bits, built on first use

    def _blocksize(self, block_size: int, dim: int) -> int:
        return block_size if self.axis == "channel" else self.group(dim)

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        if self._blocksize(block_size, dim) not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"bitsandbytes needs a group of 32..4096 (a power of two) elements; got "
                             f"{self._blocksize(block_size, dim)} (block_size={block_size}, head_dim={dim}).")
        return BlockLayout(block_size * dim * self.bits // 8, torch.uint8, self.num_groups(block_size, dim),
                           torch.float16)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., B, D]` -> contiguous `[..., D, B]` (channel axis) or `[..., B, D]` (token axis)."""
        return (x.transpose(-1, -2) if self.axis == "channel" else x).contiguous()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        F = _bnb()
        check_finite(x)
        lead, (B, D) = x.shape[:-2], x.shape[-2:]
        bs = self._blocksize(B, D)
        rows = self._rows(x.float()).reshape(-1)  # flat, groups of `bs` contiguous elements
        if rows.numel() == 0:
            layout = self.layout(B, D, x.dtype)
            return (x.new_empty((*lead, layout.code_size), dtype=torch.uint8),
                    x.new_empty((*lead, layout.scale_size), dtype=torch.float16))
        if self.bits == 4:
            q, state = F.quantize_4bit(rows, blocksize=bs, quant_type="nf4")
        else:
            q, state = F.quantize_blockwise(rows, blocksize=bs)
            self._code = state.code
        absmax = fp16_up(state.absmax.float())
        return q.reshape(*lead, -1), absmax.reshape(*lead, -1)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        F = _bnb()
        B, D = out.shape[-2:]
        bs = self._blocksize(B, D)
        if codes.numel() == 0:
            return out
        shape = (*out.shape[:-2], D, B) if self.axis == "channel" else out.shape
        absmax = scales.reshape(-1).float()
        if self.bits == 4:  # NOTE: bitsandbytes' `out=` has no CPU kernel; pass a QuantState instead
            state = F.QuantState(absmax=absmax, shape=torch.Size(shape), blocksize=bs, quant_type="nf4",
                                 dtype=torch.float32)
            tmp = F.dequantize_4bit(codes.reshape(-1, 1), quant_state=state)
        else:
            if self._code is None:
                self._code = F.create_dynamic_map().to(out.device)
            tmp = F.dequantize_blockwise(codes.reshape(-1), absmax=absmax, code=self._code, blocksize=bs).view(shape)
        return out.copy_(tmp.transpose(-1, -2) if self.axis == "channel" else tmp)
