"""`ContextScores`: the running max of the attention each held context token receives, per layer (KVzip)."""

from __future__ import annotations

import functools
import weakref

import torch

from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.attention.query_window import attach_recorder
from hf_pagedkv.errors import counted

#: query rows scored at once (bounds the `[batch, num_kv_heads, group * rows, keys]` score tensor of a layer)
QUERY_TILE = 256


class ContextScores:
    """What the reconstruction pass of KVzip (`hf_pagedkv.compress_context`) measures: for every layer, the highest
    softmax attention weight each of the first `num_context` held tokens received from any query of the steps run
    while scoring, per KV head (max over the queries and over the query heads of the KV head's GQA group).

    The cache tags the keys it returns (`tag`); the ``"hf_pagedkv"`` attention calls the tag with the layer's query
    and scaling before it attends, and `record` folds the query's attention into the running max, with the causal
    softmax normalisation the attention uses: query `i` of a step of `q` tokens over `n` keys sees keys
    ``0 .. n - q + i``. Only the max is kept, never the queries.

    With `key_valid` (a left-padded batch) the softmax also leaves out the keys at padding, as the model's attention
    mask does, and queries at padding score nothing: a pad token scores 0 and a row's real tokens score as they
    would in a batch of that row alone.

    Invariant: `scores[layer]` is `[batch, num_kv_heads, num_context]` float32 with the batch of the cache's rows in
    their current order (`select_rows`), every entry in [0, 1], 0 at the padding `key_valid` names; `key_valid`
    follows the rows too.

    Args:
        num_context (`int`): the held tokens to score (the first of every step's keys).
        key_valid (`torch.BoolTensor` of shape `[batch, positions]`, *optional*): False at the left padding of each
            row, over the context and every token the scored steps add (the reconstruction pass); None: no padding.
    """

    def __init__(self, num_context: int, key_valid: torch.Tensor | None = None) -> None:
        self.num_context = num_context  # the held tokens being scored (the context); fixed
        self.scores: dict[int, torch.Tensor] = {}  # layer index -> [batch, num_kv_heads, num_context]; via `record`
        self.key_valid = key_valid  # [batch, positions] bool, False at padding; None: no padding

    def tag(self, keys: torch.Tensor, layer_idx: int) -> None:
        """Ask the attention of layer `layer_idx` to score the context with its query (through the keys the cache
        returns to it, `[batch, num_kv_heads, n, head_dim]`; held weakly, so the tag keeps nothing alive)."""
        attach_recorder(keys, functools.partial(self.record, layer_idx, weakref.ref(keys)))

    def record(self, layer_idx: int, keys_ref, query: torch.Tensor, scaling: float) -> None:
        """Fold the attention of `query` `[batch, num_heads, q, head_dim]` over the tagged keys into the running max
        of layer `layer_idx`.

        Raises:
            ValueError: the keys are gone, the step's keys do not cover the context, or `key_valid` does not cover
                them or the batch.
        """
        keys = keys_ref()
        if keys is None:
            raise ValueError(f"ContextScores: the keys of layer {layer_idx} were freed before its attention ran.")
        view = PagedView.of(keys)
        if view is not None and view.is_placeholder(keys):  # a short step read in place: get the real keys
            keys = view.materialize()[0]
        batch, H, n, d = keys.shape
        _, num_heads, q, _ = query.shape
        if n - q < self.num_context or num_heads % H:
            raise ValueError(f"ContextScores: layer {layer_idx} attends {counted(q, 'query', 'queries')} over "
                             f"{counted(n, 'key')} ({counted(H, 'KV head')}, {num_heads} query heads); the "
                             f"{self.num_context} scored context tokens must come before the step's tokens.")
        valid = None if self.key_valid is None else self.key_valid[:, :n].to(keys.device)  # [batch, n]
        if valid is not None and tuple(valid.shape) != (batch, n):
            raise ValueError(f"ContextScores: layer {layer_idx} attends over {counted(batch, 'row')} of "
                             f"{counted(n, 'key')}, but the padding mask covers {tuple(self.key_valid.shape)} (rows, "
                             "positions).")
        G = num_heads // H
        k = keys.float().transpose(-1, -2)  # [batch, H, d, n]
        best = self.scores.get(layer_idx)
        if best is None:
            best = torch.zeros(batch, H, self.num_context, device=keys.device)
        for lo in range(0, q, QUERY_TILE):
            hi = min(q, lo + QUERY_TILE)
            t = hi - lo
            qs = query[:, :, lo:hi].float().reshape(batch, H, G * t, d)  # query head h*G+g, token lo + j
            s = torch.matmul(qs, k).mul_(scaling).view(batch, H, G, t, n)  # [batch, H, G, t, n]
            pos = torch.arange(n - q + lo, n - q + hi, device=keys.device)  # absolute positions of the queries
            s.masked_fill_(torch.arange(n, device=keys.device)[None, :] > pos[:, None], float("-inf"))
            if valid is not None:  # (a query at a real position sees itself, so no row is all -inf)
                s.masked_fill_(~valid[:, None, None, None, :], float("-inf"))
            w = s.softmax(dim=-1)[..., : self.num_context]  # [batch, H, G, t, num_context]
            if valid is not None:  # queries at padding score nothing
                w = w.masked_fill(~valid[:, None, None, n - q + lo: n - q + hi, None], 0.0)
            best = torch.maximum(best, w.amax(dim=(2, 3)))
        self.scores[layer_idx] = best

    def check(self, num_rows: int, num_kv_heads: dict[int, int]) -> list[str]:
        """The broken parts of the invariant for a cache of `num_rows` rows whose layer `i` has ``num_kv_heads[i]``
        KV heads (empty: it holds)."""
        problems = []
        for layer, s in self.scores.items():
            if tuple(s.shape) != (num_rows, num_kv_heads.get(layer, -1), self.num_context):
                problems.append(f"layer {layer}: scores of shape {tuple(s.shape)}, expected "
                                f"{(num_rows, num_kv_heads.get(layer), self.num_context)}")
            elif s.numel() and not (0 <= float(s.min()) and float(s.max()) <= 1):
                problems.append(f"layer {layer}: scores outside [0, 1]")
            elif self.key_valid is not None and bool(
                    s.masked_select(~self.key_valid[:, None, : self.num_context].to(s.device)).any()):
                problems.append(f"layer {layer}: a pad token scored above 0")
        if self.key_valid is not None and self.key_valid.shape[0] != num_rows:
            problems.append(f"the padding mask has {self.key_valid.shape[0]} rows, the cache {num_rows}")
        return problems

    def select_rows(self, idx: list[int]) -> None:
        """Rows become copies of rows `idx` (the cache's `reorder_cache` / `batch_select_indices`)."""
        for layer, s in self.scores.items():
            self.scores[layer] = s[torch.tensor(idx, device=s.device)]  # [len(idx), H, num_context]
        if self.key_valid is not None:
            self.key_valid = self.key_valid[torch.tensor(idx, device=self.key_valid.device)]

    def context_valid(self) -> torch.Tensor | None:
        """`[batch, num_context]` bool, False at the context's padding; None without padding."""
        return None if self.key_valid is None else self.key_valid[:, : self.num_context]

    def copy(self) -> ContextScores:
        """An independent copy (tensors are shared: `record` replaces them, never writes them)."""
        other = ContextScores(self.num_context, self.key_valid)
        other.scores = dict(self.scores)
        return other
