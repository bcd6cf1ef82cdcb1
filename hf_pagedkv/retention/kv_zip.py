"""`KVzip`: keep the context tokens the model attends to when it repeats the context (Kim et al., arXiv 2505.23416)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.policy import EvictionPlan, check_int
from hf_pagedkv.retention.score_pooling import check_pooling, pool_scores

#: the instruction of the reconstruction pass, before the context is given again (KVzip's repeat prompt)
REPEAT_PROMPT = "Repeat the previous context exactly."
#: the most tokens `repeat_prompt_ids` can give (its text's bytes, plus one for a leading piece: at most one token per
#: byte with byte-level BPE or SentencePiece's byte fallback), for the planner's peak of the reconstruction pass
REPEAT_PROMPT_MAX_TOKENS = len(("\n\n" + REPEAT_PROMPT + "\n").encode()) + 1
#: how `KVzip` divides its budget over the layers: the same everywhere, or by its ranking across layers
LAYER_BUDGETS = ("uniform", "global")
# the largest `value_power`: at 8 a token with twice the mean value norm already weighs 256 times as much
MAX_VALUE_POWER = 8


@dataclass(frozen=True)
class KVzip(ImportancePolicy):
    """Query-agnostic context compression: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction" (arXiv 2505.23416). After the context is prefilled, `hf_pagedkv.compress_context` runs a
    *reconstruction* pass through the cache: a repeat prompt (`REPEAT_PROMPT`) and then the context tokens again,
    in steps of `chunk_tokens`. Each cached context token is scored, per (layer, KV head), by the highest softmax
    attention weight it receives from any reconstruction query (max over the queries and over the query heads of the
    KV head's GQA group; `ContextScores`): a token the model needs to reproduce the context is one a later question
    may need too, whatever the question. The reconstruction tokens are then cropped, and each (layer, KV head) keeps
    its best-scored context tokens (plus the protected sinks and recent tokens), compacted into fresh blocks as
    `ImportancePolicy` describes; the blocks beyond the budget go back to the pool. Keys keep their RoPE positions,
    and later steps (the question) attend exactly to what is kept.

    Unlike the other policies it never evicts on its own: nothing is evicted until `compress_context` is called (a
    cache used without it keeps everything). Its cost is one extra forward pass over the context (plus the prompt),
    and the scores' matmul per layer (about the attention's own).

    The cache does not see queries: load the model with ``attn_implementation="hf_pagedkv"``.

    Args:
        budget (`int`, *optional*): context tokens each (layer, KV head) keeps.
        compression_ratio (`float`, *optional*): in (0, 1), the fraction of the context removed.
        sink_tokens (`int`, *optional*, defaults to 4): leading tokens always kept.
        recent_tokens (`int`, *optional*, defaults to 16): trailing context tokens always kept.
        chunk_tokens (`int`, *optional*, defaults to 1024): reconstruction tokens per forward step (bounds the peak
            memory of the pass; the scores do not depend on it).
        kernel_size (`int`, *optional*, defaults to 1): a pooling of the scores over this many neighbouring
            tokens, odd (SnapKV's clustering step, so a kept token keeps its neighbours; 1: none, KVzip's own
            scores).
        pooling (`str`, *optional*, defaults to `"max"`): `"max"` (a token scores as its best neighbour) or `"avg"`
            (as the mean of its window; past either end only the tokens there are counted), as `SnapKV`'s.
        layer_budgets (`str`, *optional*, defaults to `"uniform"`): `"uniform"`: every (layer, KV head) keeps
            `keep_for(held)` tokens. `"global"`: KVzip's own ranking across layers. The (pooled) scores of every
            (layer, KV head, token) are ranked together, and each layer keeps as many tokens per head as its heads
            have, on average, in the top `keep_for(held)` times the number of (layer, head) pairs (the sinks and the
            last `recent_tokens` are kept anyway and not ranked). The heads of a layer share its blocks, so they
            keep the same number. Each full-attention layer is then a retention tier, a layer group of its own
            with its own block tables (`score_budgets`), and the cache needs ``config=``. The layers' budgets are
            rounded to whole blocks below the largest, and their total never exceeds the uniform total.
        safeguard (`float`, *optional*, defaults to 0.0): with ``layer_budgets="global"``, in [0, 1]: each (layer,
            KV head) first gets its best ``int(safeguard * ranked)`` tokens, `ranked` being the tokens a uniform
            budget ranks per head, and the ranking across layers fills the rest (AdaKV's safeguard: Feng et al.,
            "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", arXiv 2407.11550, which guards
            a fifth); 1 gives the uniform budgets, 0 the plain ranking.
        share_heads (`bool`, *optional*, defaults to `False`): `True`: the KV heads of a layer keep the same tokens,
            ranked by the mean of their scores over the heads, then pooled (for ``pooling="avg"`` the same as the
            mean of the pooled scores; for ``"max"`` the best neighbour of the mean), so a layer sees one consistent
            part of the context instead of each head a different one (on SmolLM2's passkey task a head-masked run
            answered when the needle was kept whole in every head and missed when each head kept a different half
            of it). With ``layer_budgets="global"`` the layers' budgets come from the same means. How many tokens
            a layer keeps, and so the bytes held, follow the same rules as without it.
        value_weighted (`bool`, *optional*, defaults to `False`): `True`: each token's score is multiplied by the
            L2 norm of its value in that KV head, divided by the mean norm over the context's real tokens in that
            (row, layer, KV head), before the pooling and the ranking (`weigh`). A token's contribution to the
            attention output is its weight times its value, so a token attended to but with a small value matters
            less: Guo et al., "Attention Score is not All You Need for Token Importance Indicator in KV Cache
            Reduction: Value Also Matters" (VATP, arXiv 2406.12335). The bytes held do not change, and
            `compress_context` still returns the pass's own scores.
        value_power (`float`, *optional*, defaults to 1.0): with ``value_weighted=True``, the exponent of the
            relative value norm (``scores * (norm / mean_norm) ** value_power``), a number in (0, 8]; 2 weighs the
            values more (on SmolLM2's passkey task, with ``kernel_size=3``, it kept more keys than 1 in a head-masked
            simulation, `docs/retention.md`). Without ``value_weighted`` it must stay 1.

    Raises:
        ValueError: as `ImportancePolicy`; `chunk_tokens` not an int >= 1; `kernel_size` not an odd int >= 1;
            `pooling` not one of `POOLINGS`; `layer_budgets` not one of `LAYER_BUDGETS`; `safeguard` not a number
            in [0, 1]; `share_heads` or `value_weighted` not a bool; `value_power` not a number in (0, 8], or not 1
            without ``value_weighted``.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache, cache_kwargs, compress_context
    >>> from hf_pagedkv.retention import KVzip
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_pagedkv")
    >>> cache = PagedCache(config=model.config, retention=KVzip(compression_ratio=0.5))
    >>> model(context_ids, **cache_kwargs(cache))                  # prefill the context
    >>> compress_context(model, cache, context_ids, tokenizer=tok)  # reconstruct, score, evict
    >>> out = model.generate(torch.cat([context_ids, question_ids], 1), **cache_kwargs(cache), max_new_tokens=32)
    ```
    """

    recent_tokens: int = 16
    chunk_tokens: int = 1024
    kernel_size: int = 1
    pooling: str = "max"
    layer_budgets: str = "uniform"
    safeguard: float = 0.0
    share_heads: bool = False
    value_weighted: bool = False
    value_power: float = 1.0

    name = "kv_zip"
    reconstructs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_tokens", self.chunk_tokens, 1)
        check_pooling(self.kernel_size, self.pooling)
        if self.layer_budgets not in LAYER_BUDGETS:
            raise ValueError(f"`layer_budgets` must be one of {LAYER_BUDGETS} (\"global\": KVzip's ranking of the "
                             f"scores across layers), got {self.layer_budgets!r}.")
        if isinstance(self.safeguard, bool) or not isinstance(self.safeguard, numbers.Real) \
                or not 0 <= self.safeguard <= 1:
            raise ValueError(f"`safeguard` must be a number in [0, 1] (the share of each head's uniform budget it "
                             f"keeps before the ranking across layers), got {self.safeguard!r}.")
        if not isinstance(self.share_heads, bool):
            raise ValueError(f"`share_heads` must be a bool (True: the KV heads of a layer keep the same tokens), got "
                             f"{self.share_heads!r}.")
        if not isinstance(self.value_weighted, bool):
            raise ValueError(f"`value_weighted` must be a bool (True: scores times the tokens' value norms), got "
                             f"{self.value_weighted!r}.")
        if isinstance(self.value_power, bool) or not isinstance(self.value_power, numbers.Real) \
                or not 0 < self.value_power <= MAX_VALUE_POWER:  # (False for NaN)
            raise ValueError(f"`value_power` must be a number in (0, {MAX_VALUE_POWER}] (the exponent of the relative "
                             f"value norm; 1 is VATP's weighting, 2 the passkey eval's best), "
                             f"got {self.value_power!r}.")
        if self.value_power != 1 and not self.value_weighted:
            raise ValueError(f"`value_power` is the exponent of the value weighting: pass value_weighted=True with it "
                             f"(got value_power={self.value_power!r}, value_weighted=False).")
        if self.safeguard and not self.is_tiered():
            raise ValueError(f"`safeguard` applies to the ranking across layers only: pass layer_budgets=\"global\" "
                             f"with it (got layer_budgets={self.layer_budgets!r}, safeguard={self.safeguard!r}).")

    def is_tiered(self) -> bool:
        return self.layer_budgets == "global"

    def layer_tiers(self, num_layers: int) -> list[int]:
        """With ``layer_budgets="global"`` every full-attention layer is a tier of its own; else all in tier 0."""
        return list(range(num_layers)) if self.is_tiered() else [0] * num_layers

    def score_budgets(self, scores: list[list[torch.Tensor]], keep: int, held: int,
                      block_size: int, valid: torch.Tensor | None = None) -> list[int] | None:
        """The tokens each tier keeps per (row, layer, KV head), from KVzip's ranking across layers
        (``layer_budgets="global"``; None otherwise, which keeps `keep` everywhere).

        Args:
            scores (`list[list[torch.Tensor]]`): per tier, its layers' reconstruction scores, `[rows, num_kv_heads,
                held]` each (`ContextScores`), pooled here as `select` pools them.
            keep (`int`): the uniform budget (`keep_for(held)`), ``0 < keep < held``.
            held (`int`): context tokens held.
            block_size (`int`): tokens per block.
            valid (`torch.BoolTensor` of shape `[rows, held]`, *optional*): False at left padding, which is ranked
                last. NOTE: the sinks are still counted at the first positions there (`select` keeps each row's
                first real tokens), so a padded row's budget is estimated, not exact.

        Returns:
            `list[int]`: each tier's keep count, tier 0 first; each at least ``sink_tokens + recent_tokens + 1`` (or
            `held`, if smaller) and at most `held`, all a whole number of blocks below the largest, with
            ``sum(k * layers)`` at most ``keep * layers`` (all tiers).
        """
        if not self.is_tiered():
            return None
        lo, hi = min(self.sink_tokens, held), max(min(self.sink_tokens, held), held - self.recent_tokens)
        protected = held - (hi - lo)  # kept by every head, not ranked

        def rank(s: torch.Tensor) -> torch.Tensor:  # [rows, num_kv_heads, held] -> the ranked part, padding -inf
            real = None if valid is None else valid.to(s.device)[:, None, :]  # [rows, 1, held]
            pooled = self._pooled(s, real)
            if real is not None:
                pooled = pooled.masked_fill(~real, float("-inf"))
            return pooled[..., lo:hi]

        ranked = [[rank(s) for s in tier] for tier in scores]
        pairs = sum(s.shape[1] for tier in ranked for s in tier)
        per_head = max(0, min(keep - protected, hi - lo))  # the ranked tokens a uniform budget keeps per head
        guard = int(self.safeguard * per_head)
        if guard:  # each head's best `guard` tokens first (AdaKV's safeguard), then the ranking across layers
            ranked = [[torch.where(s.isneginf(), s, s.scatter(-1, s.topk(guard, dim=-1).indices, float("inf")))
                       for s in tier] for tier in ranked]
        flat = torch.cat([s.reshape(s.shape[0], -1) for tier in ranked for s in tier], dim=1)  # [rows, pairs * m]
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        if per_head:
            chosen.scatter_(1, flat.topk(per_head * pairs, dim=1).indices, True)
            chosen &= ~flat.isneginf()  # (padding, where a row has fewer real tokens than the budget)
        means, at = [], 0  # per tier: the ranked tokens its heads hold on average, over rows, layers and heads
        for tier in ranked:
            width = sum(s.shape[1] * s.shape[2] for s in tier)
            heads = sum(s.shape[1] for s in tier)
            means.append(protected + chosen[:, at: at + width].sum().item() / (heads * flat.shape[0]))
            at += width
        return self._on_block_grid(means, [len(t) for t in scores], keep, held, block_size)

    def _on_block_grid(self, wanted: list[float], sizes: list[int], keep: int, held: int, B: int) -> list[int]:
        """Round each tier's `wanted` keep count to whole blocks below the largest (at least the protected tokens
        plus one), then move blocks so the total (weighted by the tiers' `sizes` in layers) is at most the uniform
        ``keep * layers`` and no tier below the span could take one more block without passing it."""
        span = min(held, math.ceil(max(wanted)))
        low = min(span, self.sink_tokens + self.recent_tokens + 1)
        keeps = []
        for w in wanted:
            drop = max(0, round((span - w) / B)) * B
            while drop and span - drop < low:
                drop -= B
            keeps.append(span - drop)
        budget = keep * sum(sizes)
        while sum(k * n for k, n in zip(keeps, sizes)) > budget:  # too many: take a block from the most rounded up
            down = [t for t, k in enumerate(keeps) if k - B >= low]
            if not down:
                break
            t = max(down, key=lambda t: keeps[t] - wanted[t])
            keeps[t] -= B
        if sum(k * n for k, n in zip(keeps, sizes)) > budget:
            # NOTE: no block can go without a tier falling below the protected tokens (blocks large against the
            # budgets' spread): the uniform budgets then, which the grid always holds
            return [keep] * len(sizes)
        while True:  # room left: give a block to the most rounded down (below the span, so the grid holds)
            up = [t for t, k in enumerate(keeps) if k + B <= max(keeps)
                  and sum(k * n for k, n in zip(keeps, sizes)) + B * sizes[t] <= budget]
            if not up:
                break
            t = min(up, key=lambda t: keeps[t] - wanted[t])
            keeps[t] += B
        return keeps

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """Nothing: KVzip compresses only through `compress_context` (`keep_for`)."""
        return EvictionPlan()

    def max_held(self, new: int, block_size: int) -> int | None:
        return None  # the context is compressed once; what comes after is kept

    def scores(self, keys: torch.Tensor, observed: torch.Tensor | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction scores of the held tokens.

        Args:
            keys (`torch.Tensor` of shape `[batch, num_kv_heads, held, head_dim]`): one layer's held keys.
            observed (`torch.Tensor` of shape `[batch, num_kv_heads, held]`): the layer's `ContextScores`.
            valid (`torch.BoolTensor` of shape `[batch, held]`, *optional*): False at left padding, which average
                pooling leaves out of each window, as a row alone has nothing there.

        Returns:
            `torch.Tensor` of shape `[batch, num_kv_heads, held]`, float32: `observed` (with `share_heads`, its mean
            over the heads, the same for every head), max- or average-pooled (`pooling`) over `kernel_size` tokens.

        Raises:
            ValueError: no scores, or scores of another shape (the reconstruction pass did not run on this context).
        """
        if observed is None or tuple(observed.shape) != tuple(keys.shape[:3]):
            got = None if observed is None else tuple(observed.shape)
            raise ValueError(f"KVzip scores tokens by a reconstruction pass: expected scores of shape "
                             f"{tuple(keys.shape[:3])}, got {got}. Call hf_pagedkv.compress_context(model, cache, "
                             "context_ids) after the prefill.")
        return self._pooled(observed, None if valid is None else valid.to(observed.device)[:, None, :])

    def weigh(self, scores: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction scores that rank the tokens: `scores` as they are, or with ``value_weighted=True``
        times each token's relative value norm to the power `value_power` (VATP, arXiv 2406.12335).

        Args:
            scores (`torch.Tensor` of shape `[rows, num_kv_heads, held]`): one layer's `ContextScores`.
            values (`torch.Tensor` of shape `[rows, num_kv_heads, held, head_dim]`): the layer's held values.
            valid (`torch.BoolTensor` of shape `[rows, held]`, *optional*): False at left padding, left out of the
                mean norm (padding scores 0 either way).

        Returns:
            `torch.Tensor` of shape `[rows, num_kv_heads, held]`, float32: ``scores * (norm / mean_norm) **
            value_power``, the norm the L2 norm of each token's value and the mean over the row's real tokens, per
            (row, KV head).
        """
        if not self.value_weighted:
            return scores
        norms = values.float().norm(dim=-1).to(scores.device)  # [rows, num_kv_heads, held]
        if valid is None:
            mean = norms.mean(dim=-1, keepdim=True)
        else:
            real = valid.to(scores.device)[:, None, :].float()  # [rows, 1, held]
            mean = (norms * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp_min(1)
        mean = mean.clamp_min(torch.finfo(torch.float32).tiny)
        if self.value_power == 1:  # VATP's weighting, rounded as before value_power existed (the committed runs)
            return scores.float() * norms / mean
        relative = norms / mean
        # saturate instead of overflowing: a relative norm can reach `held` (one token holding all of the norm),
        # and inf would rank as noise (and 0 * inf is NaN); in the usual range both clamps change nothing
        largest = torch.finfo(torch.float32).max
        weight = relative.clamp_max(largest ** (1 / self.value_power) / 2) ** self.value_power
        return (scores.float() * weight).clamp_max(largest)

    def _pooled(self, scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """`scores` (`[rows, num_kv_heads, held]`) pooled over `kernel_size` tokens, float32; with `share_heads` each
        head's row is the mean over the layer's heads (so every head ranks the tokens alike)."""
        if not self.share_heads:
            return pool_scores(scores.float(), self.kernel_size, self.pooling, valid)
        mean = scores.float().mean(dim=1, keepdim=True)  # [rows, 1, held]: pooled once, then given to every head
        return pool_scores(mean, self.kernel_size, self.pooling, valid).expand(scores.shape).contiguous()
