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


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable from `obj`: tensor subclasses (quanto's) through `__tensor_flatten__`,
    tuples/lists/dicts (HQQ's `(codes, meta)`) item by item; 0 for anything else."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            inner, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in inner)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0
