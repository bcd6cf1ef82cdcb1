"""`Codec`: the interface every block codec implements, and the grouping / fp16 helpers the integer codecs share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch

AXES = ("channel", "token")


class BlockLayout(NamedTuple):
    """What one encoded block of one head takes in the page store: `code_size` elements of `code_dtype` plus
    `scale_size` elements of `scale_dtype`."""

    code_size: int
    code_dtype: torch.dtype
    scale_size: int
    scale_dtype: torch.dtype

    @property
    def bytes(self) -> int:
        """Bytes of one block of one head (codes + scales)."""
        return (self.code_size * torch.empty((), dtype=self.code_dtype).element_size()
                + self.scale_size * torch.empty((), dtype=self.scale_dtype).element_size())


class Codec(ABC):
    """Encodes whole blocks of one layer's keys or values; never sees a partial block.

    A batch of blocks is `x` of shape `[..., block_size, dim]` (one block = `block_size` tokens of one head).
    `encode` returns `codes` `[..., code_size]` and `scales` `[..., scale_size]` (see `layout`); `decode` writes the
    reconstruction into `out` `[..., block_size, dim]`, which may be a strided view. Grouping (`axis`):

    - ``"channel"``: one group per channel over the block's tokens (keys; KIVI, arXiv 2402.02750);
    - ``"token"``: per token, groups of `group_size` consecutive channels (values).

    Args:
        axis (`str`): ``"channel"`` or ``"token"``.
        group_size (`int`, *optional*, defaults to 64): channels per group for ``axis="token"`` (capped at `dim`).

    Raises:
        ValueError: an unknown axis, or (in `layout`) a `dim` the group size or the packing does not divide.
    """

    name: ClassVar[str]  # registry name
    bits: ClassVar[int | None]  # bits per code, None for full precision
    scale_dtype: ClassVar[torch.dtype] = torch.float16
    #: whether the reconstruction is ``code * scale (+ zero)`` per group (`unpack` and `affine` then give the parts,
    #: so an attention can fold the scales into the query and the probabilities instead of de-quantizing)
    is_affine: ClassVar[bool] = False
    #: whether the codes are of ``x @ R``, `R` an orthogonal matrix (`RotatedCodec.matrix`): an attention that reads
    #: the codes in place then scores ``(q @ R) . code_values``
    rotated: ClassVar[bool] = False

    @property
    def inner(self) -> Codec:
        """The codec that encodes the (rotated) values: `self` for a plain codec."""
        return self

    def __init__(self, axis: str, group_size: int = 64) -> None:
        if axis not in AXES:
            raise ValueError(f"`axis` must be one of {AXES}, got {axis!r}.")
        self.axis = axis  # grouping axis; fixed
        self.group_size = group_size  # channels per group along dim (axis="token"); fixed

    def __repr__(self) -> str:
        group = "" if self.axis == "channel" else f", group_size={self.group_size}"
        return f"{type(self).__name__}(axis={self.axis!r}{group})"

    # -- grouping --------------------------------------------------------------------------------------------------
    def group(self, dim: int) -> int:
        """Channels per group along `dim` for ``axis="token"``."""
        g = min(self.group_size, dim)
        if dim % g:
            raise ValueError(f"value_group_size={self.group_size} does not divide head_dim={dim}; pick a divisor.")
        return g

    def num_groups(self, block_size: int, dim: int) -> int:
        """Quantization groups in one block of one head."""
        return dim if self.axis == "channel" else block_size * (dim // self.group(dim))

    def grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """`x` `[..., B, D]` as a view whose dim `reduce` runs over the members of each group."""
        if self.axis == "channel":
            return x, -2  # groups: [..., B, D] reduced over B
        g = self.group(x.shape[-1])
        if g == x.shape[-1]:
            return x, -1  # one group per token: [..., B, D] reduced over D
        return x.unflatten(-1, (x.shape[-1] // g, g)), -1  # [..., B, D // g, g] reduced over g

    def stats_view(self, stats: torch.Tensor, block_size: int, dim: int) -> torch.Tensor:
        """Flat per-group statistics `[..., num_groups]` -> broadcastable against `grouped(x)`."""
        if self.axis == "channel":
            return stats.unsqueeze(-2)  # [..., 1, D]
        g = self.group(dim)
        if g == dim:
            return stats.unsqueeze(-1)  # [..., B, 1]
        return stats.unflatten(-1, (block_size, dim // g)).unsqueeze(-1)  # [..., B, D // g, 1]

    # -- interface -------------------------------------------------------------------------------------------------
    @abstractmethod
    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        """Storage of one block of one head for inputs of `dtype`."""

    def check_block_size(self, block_size: int) -> None:
        """Raise `ValueError` when blocks of `block_size` tokens cannot be packed (a bit width sharing bytes
        between tokens); every size is fine by default."""

    def bytes_per_token(self, block_size: int, dim: int, dtype: torch.dtype = torch.float16) -> float:
        """Bytes one token of one head takes (codes + its share of the block's scales)."""
        return self.layout(block_size, dim, dtype).bytes / block_size

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[..., block_size, dim]` -> (codes `[..., code_size]`, scales `[..., scale_size]`)."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the reconstruction of (codes, scales) into `out` `[..., block_size, dim]` and return it."""

    # -- the parts of an affine reconstruction (read in place by `hf_pagedkv.attention`) ---------------------------
    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The integer code values of `codes` `[..., code_size]` as `out.dtype`, `[..., block_size, dim]` in token
        order: written into `out` (a contiguous buffer of that shape), or a view of `codes` when they are values
        already (identity). With `affine`: ``decode(codes, scales) == unpack(codes) * scale + zero`` per group,
        up to the rounding of the last operation.

        Raises:
            NotImplementedError: a codec that is not affine (`is_affine` is False; use `decode`).
        """
        raise NotImplementedError(f"{type(self).__name__} is not an affine codec; use decode().")

    def affine(self, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(scale, zero)` of each group from the stored `scales` `[..., scale_size]`, each `[..., num_groups]` in
        `dtype`, groups numbered as `stats_view` reads them (``axis="channel"``: one per channel; ``"token"``:
        token-major, ``t * (dim // group) + j``); `zero` is None for a symmetric codec, both are None when the
        codes are the values (identity)."""
        raise NotImplementedError(f"{type(self).__name__} is not an affine codec; use decode().")


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise `ValueError` if `x` holds NaN or inf: integer codes cannot represent them."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"Cannot quantize {what}: {bad} of {x.numel()} elements are NaN or inf. Quantized KV "
                         "storage needs finite keys/values (check the model's dtype for overflow, or use quant=None).")


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` to the nearest fp16 that is >= x (so a scale still covers its range).

    Raises:
        ValueError: `x` beyond the fp16 range.
    """
    h = x.to(torch.float16)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"Quantization scale {float(x.abs().max()):.4g} exceeds the fp16 range (65504).")
    return h


def fp16_down(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` to the nearest fp16 that is <= x (so a minimum still lies below its group).

    Raises:
        ValueError: `x` beyond the fp16 range.
    """
    h = x.to(torch.float16)
    h = torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"Quantization minimum {float(x.abs().max()):.4g} exceeds the fp16 range (65504).")
    return h
