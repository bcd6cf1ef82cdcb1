"""`QueryWindow`: the last queries of a prefill, per layer, handed from the attention to a query-aware policy."""

from __future__ import annotations

import functools
from typing import Callable

import torch

_ATTR = "hf_pagedkv_query_recorder"  # the attribute of the keys `PagedCache.update` returns that asks for queries


def recorder_of(keys: torch.Tensor) -> Callable[[torch.Tensor, float], None] | None:
    """The recorder the cache attached to `keys` (`QueryWindow.tag`), or None: the ``"hf_pagedkv"`` attention calls
    it with the layer's query and scaling."""
    return getattr(keys, _ATTR, None)


def attach_recorder(keys: torch.Tensor, record: Callable[[torch.Tensor, float], None]) -> None:
    """Ask the ``"hf_pagedkv"`` attention that receives `keys` to call ``record(query, scaling)`` before it attends
    (`QueryWindow.tag`, `ContextScores.tag`)."""
    setattr(keys, _ATTR, record)


class QueryWindow:
    """The queries of the last `window` tokens of one forward step, per layer, as the attention saw them.

    The cache does not see queries: while a query-aware policy (`SnapKV`) waits for them, `PagedCache.update` tags the
    keys it returns (`tag`), and the opt-in ``"hf_pagedkv"`` attention implementation calls the tag with the layer's
    query (RoPE applied) and its softmax scaling before it attends. Any other attention (`sdpa`, eager) ignores the
    tag, so `missing` then names the layers without queries and the policy refuses to guess.

    Invariant: every recorded query has the batch of the cache's rows in their current order (`select_rows` follows
    beam reordering and row selection); `queries[layer]` is `[batch, num_heads, <= window, head_dim]`.
    """

    def __init__(self, window: int) -> None:
        self.window = window  # query tokens kept per layer; fixed
        self.queries: dict[int, torch.Tensor] = {}  # layer index -> [batch, num_heads, w, head_dim]; via `record`
        self.scaling: dict[int, float] = {}  # layer index -> the softmax scale its attention uses; via `record`

    def tag(self, keys: torch.Tensor, layer_idx: int) -> None:
        """Ask the attention of layer `layer_idx` for its queries (through the keys the cache returns to it)."""
        attach_recorder(keys, functools.partial(self.record, layer_idx))

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        """Keep the last `window` queries of `query` `[batch, num_heads, q, head_dim]` (a copy: the step's query
        tensor is not kept alive)."""
        self.queries[layer_idx] = query[:, :, -self.window:].detach().clone()  # [batch, num_heads, w, head_dim]
        self.scaling[layer_idx] = float(scaling)

    def missing(self, layer_indices: list[int]) -> list[int]:
        """The layers of `layer_indices` with no recorded queries."""
        return [i for i in layer_indices if i not in self.queries]

    def select_rows(self, idx: list[int]) -> None:
        """Rows become copies of rows `idx` (the cache's `reorder_cache` / `batch_select_indices`)."""
        for layer, q in self.queries.items():
            self.queries[layer] = q[torch.tensor(idx, device=q.device)]  # [len(idx), num_heads, w, head_dim]

    def clear(self) -> None:
        self.queries.clear()
        self.scaling.clear()

    def copy(self) -> QueryWindow:
        """An independent copy (tensors are shared: they are never written)."""
        other = QueryWindow(self.window)
        other.queries, other.scaling = dict(self.queries), dict(self.scaling)
        return other
