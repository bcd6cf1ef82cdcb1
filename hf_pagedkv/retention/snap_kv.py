"""`SnapKV`: keep the prompt tokens the last observation-window queries attend to (Li et al., arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.policy import EvictionPlan, check_int
from hf_pagedkv.retention.score_pooling import check_pooling, pool_scores


@dataclass(frozen=True)
class SnapKV(ImportancePolicy):
    """Query-aware prompt compression: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
    (arXiv 2404.14469). At the end of the prefill, each (layer, KV head) scores every prompt token by the attention
    it receives from the queries of the last `recent_tokens` prompt tokens (the *observation window*): the softmax
    weights of those queries (causal inside the window) summed over the window, smoothed by a 1-D pooling of
    `kernel_size` tokens (the paper's clustering step, so a kept token keeps its neighbours), and summed over the
    query heads that share the KV head (GQA). Each (layer, KV head) keeps its best-scored tokens and the window,
    compacted into fresh blocks as `ImportancePolicy` describes; the blocks beyond the budget go back to the pool.

    The compression happens once, before the second forward step (the question after a context, or the first decoded
    token): the prompt is compressed to `budget` tokens, or by `compression_ratio`; everything after it is kept.

    The cache does not see queries: load the model with ``attn_implementation="hf_pagedkv"`` (or call
    ``model.set_attn_implementation("hf_pagedkv")``), whose attention hands each layer's last window of queries to
    the cache during the prefill. With another attention the second step raises before anything is evicted.

    Args:
        budget (`int`, *optional*): tokens each (layer, KV head) keeps of the prompt, the window included (SnapKV's
            "KV cache size").
        compression_ratio (`float`, *optional*): in (0, 1), the fraction of the prompt removed.
        sink_tokens (`int`, *optional*, defaults to 0): leading tokens always kept (SnapKV has none: sinks score high
            anyway).
        recent_tokens (`int`, *optional*, defaults to 32): the observation window (the paper's `window_size`): its
            queries score the prompt, and its tokens are always kept.
        kernel_size (`int`, *optional*, defaults to 7): the pooling kernel in tokens, odd (1: no pooling).
        pooling (`str`, *optional*, defaults to `"max"`): `"max"` or `"avg"`. The defaults are the SnapKV
            repository's published configuration (window 32, kernel 7, max-pooling; kvpress uses avg-pooling over
            5). NOTE: on SmolLM2-135M, avg-pooling over 5 kept a needle but lost one of its digits (57115 read as
            57125) where max-pooling over 7 kept it whole (3 examples, question in the prompt): the pooling is what
            keeps a detail's neighbours.

    Raises:
        ValueError: as `ImportancePolicy`; `kernel_size` not an odd int >= 1; `pooling` not one of `POOLINGS`;
            at the compression, a layer whose attention gave no queries (the model does not use
            ``attn_implementation="hf_pagedkv"``).

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> from hf_pagedkv.retention import SnapKV
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_pagedkv")
    >>> cache = PagedCache(config=model.config, retention=SnapKV(compression_ratio=0.5))
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    ```
    """

    sink_tokens: int = 0
    recent_tokens: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    name = "snap_kv"
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("recent_tokens", self.recent_tokens, 1)  # the observation window holds at least one query
        check_pooling(self.kernel_size, self.pooling)

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """Compact the prompt once, before the second step (`step == 1`), to `budget` or by the ratio."""
        if step != 1 or held == 0 or seen != held:
            return EvictionPlan()
        keep = self.keep_for(held)
        return EvictionPlan(keep_tokens=keep if keep < held else None)

    def max_held(self, new: int, block_size: int) -> int | None:
        return None  # the prompt is compressed once; what comes after is kept

    def observes(self, step: int) -> bool:
        """Whether the queries of forward step `step` are needed (those of the step before the compression)."""
        return step == 0

    def scores(self, keys: torch.Tensor, observed: tuple[torch.Tensor, float] | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """SnapKV's votes for each held token.

        Args:
            keys (`torch.Tensor` of shape `[batch, num_kv_heads, held, head_dim]`): one layer's held keys (RoPE
                applied), the last `w` of them the observation window's.
            observed (`(queries, scaling)`): the window's queries `[batch, num_heads, w, head_dim]` (RoPE applied,
                `num_heads` a multiple of `num_kv_heads`) and the attention's softmax scale.

        Returns:
            `torch.Tensor` of shape `[batch, num_kv_heads, held]`, float32.
        """
        if observed is None:
            raise ValueError("SnapKV scores tokens by the attention of the prefill's last queries, and none were "
                             'recorded: load the model with attn_implementation="hf_pagedkv".')
        queries, scaling = observed
        batch, H, n, d = keys.shape
        _, num_heads, w, _ = queries.shape
        G = num_heads // H
        q = queries.float().reshape(batch, H, G * w, d)  # [batch, H, G*w, d]: query head h*G+g, token j
        s = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scaling)  # [batch, H, G*w, n]
        s = s.view(batch, H, G, w, n)
        pos_q = torch.arange(n - w, n, device=keys.device)  # window token j sits at position n - w + j
        future = torch.arange(n, device=keys.device)[None, :] > pos_q[:, None]  # [w, n]: causal inside the window
        s.masked_fill_(future, float("-inf"))
        votes = s.softmax(dim=-1).sum(dim=3)  # [batch, H, G, n]: summed over the window's queries
        return pool_scores(votes, self.kernel_size, self.pooling).sum(dim=2)  # [batch, H, n]: over the group's heads
