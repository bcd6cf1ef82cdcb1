"""`KeyNorm`: keep the tokens whose keys have the smallest L2 norm (Devoto et al., arXiv 2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy


@dataclass(frozen=True)
class KeyNorm(ImportancePolicy):
    """Query-free importance by key norm: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression" (arXiv 2406.11430), find that tokens whose keys have a *low* L2 norm receive high attention, so each
    (layer, KV head) keeps its lowest-norm keys (kvpress's `KnormPress`). Budget, ratio and protected tokens as in
    `ImportancePolicy`.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> from hf_pagedkv.retention import KeyNorm
    >>> cache = PagedCache(config=model.config, retention=KeyNorm(budget=512))
    ```
    """

    name = "key_norm"

    def scores(self, keys: torch.Tensor, observed=None, valid=None) -> torch.Tensor:
        return -keys.float().norm(dim=-1)  # [batch, num_kv_heads, held]
