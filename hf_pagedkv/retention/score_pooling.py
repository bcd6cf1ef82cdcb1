"""SnapKV's clustering step: token scores pooled over a centred window of neighbours (Li et al., arXiv 2404.14469),
shared by the policies that take a `kernel_size` and a `pooling` (`SnapKV`, `PyramidKV`, `KVzip`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_pagedkv.retention.policy import check_int

POOLINGS = ("avg", "max")


def check_pooling(kernel_size: int, pooling: str) -> None:
    """Raise `ValueError` unless `kernel_size` is an odd int >= 1 and `pooling` one of `POOLINGS`."""
    check_int("kernel_size", kernel_size, 1)
    if kernel_size % 2 == 0:
        raise ValueError(f"`kernel_size` must be odd (the pooling is centred on each token), got {kernel_size}.")
    if pooling not in POOLINGS:
        raise ValueError(f"`pooling` must be one of {POOLINGS}, got {pooling!r}.")


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str, valid: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """`scores` (`[..., n]`) pooled along the last dim over `kernel_size` tokens centred on each (`"max"`: the best
    neighbour; `"avg"`: the mean of the window, counting only the tokens inside at either end); `kernel_size` 1
    returns `scores` itself. `valid` (bool, broadcastable to `scores`; False at left padding) leaves padding out of
    the average as the ends are (a padded row pools as it would alone; scores are >= 0, so padding, which scores 0,
    never changes a max). Returns a tensor of the same shape."""
    if kernel_size == 1:
        return scores
    flat, pad = scores.reshape(-1, 1, scores.shape[-1]), kernel_size // 2  # [rows, 1, n] for the 1-D pooling
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    elif valid is None or bool(valid.all()):
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=False)
    else:  # window sums over the real tokens, divided by how many real tokens each window holds (>= 1 at a real one)
        real = valid.expand(scores.shape).reshape(flat.shape).to(flat.dtype)
        sums = F.avg_pool1d(flat * real, kernel_size, stride=1, padding=pad, count_include_pad=True)
        counts = F.avg_pool1d(real, kernel_size, stride=1, padding=pad, count_include_pad=True)
        pooled = (sums / counts.clamp_min(1 / kernel_size)).masked_fill_(real == 0, 0.0)
    return pooled.view(scores.shape)


__all__ = ["POOLINGS", "check_pooling", "pool_scores"]
