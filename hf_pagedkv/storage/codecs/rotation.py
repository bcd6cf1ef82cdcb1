"""`RotatedCodec`: any codec applied to keys or values turned by a fixed orthogonal (randomized Hadamard) rotation."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs.base import BlockLayout, Codec

#: seed of the random signs of `hadamard_rotation` (fixed: codes written by one process are read by another)
ROTATION_SEED = 0


def hadamard_rotation(dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The orthogonal matrix ``R = diag(signs) @ H / sqrt(dim)``, `[dim, dim]` float64, `H` Sylvester's Hadamard
    matrix and `signs` random +-1 drawn from `seed` (QuaRot's randomized Hadamard, arXiv 2404.00456): ``R @ R.T =
    I``, and ``x @ R`` spreads every channel over all `dim` channels with equal weight.

    Raises:
        ValueError: `dim` not a power of two.
    """
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"A Hadamard rotation needs head_dim a power of two; got {dim}. Use rotate_keys=False and "
                         "rotate_values=False.")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)  # Sylvester: [[H, H], [H, -H]]
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (dim,), generator=g).to(torch.float64).mul_(2).sub_(1)  # [dim] of +-1
    return signs[:, None] * h / dim**0.5  # [dim, dim]


class RotatedCodec(Codec):
    """Codes of ``x @ R`` by an inner codec, `R` the orthogonal `hadamard_rotation` of the head dim (QuaRot, arXiv
    2404.00456; TurboQuant, arXiv 2504.19874): a rotation spreads an outlier channel's energy over every channel, so
    each quantization group sees a flatter distribution and a smaller range.

    - `encode(x)`: the inner codec's codes and scales of ``x @ R`` (same layout and bytes as the inner codec).
    - `decode`: the inner reconstruction turned back, ``x_hat = inner_decode @ R.T``, so a dense read gets keys and
      values in the model's basis. `unpack` / `affine` give the inner parts, in the rotated basis: an attention that
      reads key codes in place turns the query instead, ``q . x_hat = (q @ R) . (x_hat @ R)`` (`matrix`); one that
      reads value codes in place sums them as stored and turns its output back once, ``(p @ (V R)) @ R.T = p @ V``.
      Either reads the full-precision tokens (sink, staged block, the step's own) turned by `R` as well.
    - Error bound: the inner codec's bound on ``x @ R`` (a rotation keeps the L2 norm of the error:
      ``||x - x_hat|| = ||x @ R - inner_x_hat||`` per token), so per element at most ``sqrt(dim)`` times the inner
      per-element bound, typically about the same as it.

    Values (per token, groups along head_dim): an outlier channel sets the scale of its whole group; turned, its
    energy is spread over every channel, and the int4 error of a group with one 12x channel halves
    (tests/storage/test_codecs_v2.py). fp8 codes gain nothing: their error is relative per element.

    NOTE: keys stay grouped per channel over the block (KIVI). A per-channel offset (the usual form of an outlier
    channel) stays a per-channel offset after the turn, which the minimum of each group absorbs either way; what
    the turn changes is the spread within each channel, evened out over channels. On SmolLM2's keys the relative
    error of int4 codes is about the same with or without it, but the error it leaves lies less along the
    directions the queries read: attention drift is lower (docs/quantization.md).

    Args:
        inner (`Codec`): the codec of the rotated keys or values.

    Raises:
        ValueError: (`layout`, `encode`) a head dim that is not a power of two.
    """

    name = "rotated"
    rotated = True

    def __init__(self, inner: Codec) -> None:
        super().__init__(inner.axis, inner.group_size)
        self._inner = inner  # the codec of the rotated values; fixed
        self.bits = inner.bits
        self.is_affine = inner.is_affine
        self.scale_dtype = inner.scale_dtype
        self._cast: dict[tuple, torch.Tensor] = {}  # (dim, dtype, device) -> the rotation, made on first use

    def __repr__(self) -> str:
        return f"RotatedCodec({self._inner!r})"

    @property
    def inner(self) -> Codec:
        return self._inner

    def matrix(self, dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """`hadamard_rotation(dim)` as `dtype` on `device`, `[dim, dim]` (kept per triple).

        Raises:
            ValueError: `dim` not a power of two.
        """
        key = (dim, dtype, torch.device(device))
        if key not in self._cast:
            self._cast[key] = hadamard_rotation(dim).to(dtype=dtype, device=device)
        return self._cast[key]

    def layout(self, block_size: int, dim: int, dtype: torch.dtype) -> BlockLayout:
        self.matrix(dim, torch.float32, "cpu")  # a head dim the rotation cannot turn fails here
        return self._inner.layout(block_size, dim, dtype)

    def check_block_size(self, block_size: int) -> None:
        self._inner.check_block_size(block_size)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.matrix(x.shape[-1], torch.float32, x.device)
        return self._inner.encode(torch.matmul(x.float(), r))  # [..., B, D] rotated, then the inner codes

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._inner.decode(codes, scales, out)  # [..., B, D] in the rotated basis
        return out.copy_(torch.matmul(out, self.matrix(out.shape[-1], out.dtype, out.device).T))  # back: x_hat @ R.T

    def unpack(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._inner.unpack(codes, out)  # rotated basis

    def affine(self, scales: torch.Tensor, dtype: torch.dtype):
        return self._inner.affine(scales, dtype)  # rotated basis
