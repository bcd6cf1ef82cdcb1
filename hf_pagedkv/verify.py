"""Consistency checks: PagedCache against DynamicCache and against recomputation without a cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """Bytes of keys plus values a `DynamicCache` holds, all layers."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
