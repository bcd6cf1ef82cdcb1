"""`KeyDiff`: keep the tokens whose keys differ most from the head's mean key direction (arXiv 2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy


@dataclass(frozen=True)
class KeyDiff(ImportancePolicy):
    """Query-free importance by key diversity: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for
    Long-Context LLM Inference in Resource-Constrained Environments" (arXiv 2504.15364), keep the keys least similar
    (by cosine) to the anchor, the mean of the head's normalised keys: distinctive keys are the ones attention singles
    out, keys close to the mean add little. Budget, ratio and protected tokens as in `ImportancePolicy`.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> from hf_pagedkv.retention import KeyDiff
    >>> cache = PagedCache(config=model.config, retention=KeyDiff(compression_ratio=0.5))
    ```
    """

    name = "key_diff"

    def scores(self, keys: torch.Tensor, observed=None, valid=None) -> torch.Tensor:
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)  # [batch, num_kv_heads, held, head_dim]
        anchor = torch.nn.functional.normalize(unit.mean(dim=2, keepdim=True), dim=-1)  # [batch, heads, 1, dim]
        return -(unit * anchor).sum(-1)  # [batch, num_kv_heads, held]: minus the cosine to the anchor
