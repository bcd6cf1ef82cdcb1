"""Fake K/V for driving `PagedCache.update` directly: 1 layer, 1 KV head, head_dim 2, fp32.

Token `p` of a row labelled `label` has key ``(label, p)`` and value ``(-label, p)``, so what a row reads back names
the write it came from and its position.
"""

from __future__ import annotations

import torch

from hf_pagedkv import PagedCache

BYTES_PER_TOKEN = 1 * (2 + 2) * 4  # 1 KV head x (key_dim + value_dim) x fp32


def kv(batch: int, start: int, n: int, label: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake K/V `[batch, 1, n, 2]` for positions `start .. start + n - 1` of rows labelled `label + row`."""
    return kv_labels([label + r for r in range(batch)], start, n)


def kv_labels(row_labels: list[float], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake K/V `[len(row_labels), 1, n, 2]` for positions `start .. start + n - 1`, one label per row."""
    batch = len(row_labels)
    pos = torch.arange(start, start + n, dtype=torch.float32).expand(batch, n)
    lab = torch.tensor(row_labels, dtype=torch.float32)[:, None].expand(batch, n)
    k = torch.stack([lab, pos], -1)[:, None]  # [batch, 1, n, 2]
    v = torch.stack([-lab, pos], -1)[:, None]  # [batch, 1, n, 2]
    return k.contiguous(), v.contiguous()


def labels(cache: PagedCache, layer_idx: int = 0) -> list[list[int]]:
    """The label of each token of each row, read back through the cache (checking keys, values and positions)."""
    k, v = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
    if k is None:
        return [[] for _ in range(cache.num_rows)]
    assert torch.equal(k[..., 0], -v[..., 0]) and torch.equal(k[..., 1], v[..., 1])
    assert torch.equal(k[:, 0, :, 1], torch.arange(k.shape[2], dtype=torch.float32).expand(k.shape[0], -1))
    return k[:, 0, :, 0].long().tolist()
