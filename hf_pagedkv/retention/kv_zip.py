"""`KVzip`: keep the context tokens the model attends to when it repeats the context (Kim et al., arXiv 2505.23416)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.kv_zip_scoring import DEFAULT_PRESET, KVZIP_PRESETS, KVzipScoring, resolve_scoring
from hf_pagedkv.retention.policy import EvictionPlan, check_int

#: the instruction of the reconstruction pass, before the context is given again (KVzip's repeat prompt)
REPEAT_PROMPT = "Repeat the previous context exactly."
#: the most tokens `repeat_prompt_ids` can give (its text's bytes, plus one for a leading piece: at most one token per
#: byte with byte-level BPE or SentencePiece's byte fallback), for the planner's peak of the reconstruction pass
REPEAT_PROMPT_MAX_TOKENS = len(("\n\n" + REPEAT_PROMPT + "\n").encode()) + 1


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
        scoring (`str` or `KVzipScoring`, *optional*, defaults to `"weighted"`): how the scores rank the tokens, a
            preset of `KVZIP_PRESETS` or a `KVzipScoring` for another setting. `"weighted"` (the best measured on
            SmolLM2's passkey task, `docs/retention.md`): scores avg-pooled over 3 tokens, weighted by the squared
            relative value norm and ranked across layers (each layer its own budget, so the cache needs
            ``config=``). `"global"`: max-pooled over 7 tokens, ranked across layers. `"plain"`: Kim et al.'s raw
            scores with the same budget in every (layer, KV head). `settings` is the `KVzipScoring` in force;
            `with_scoring(...)` changes some of its fields.

    Raises:
        ValueError: as `ImportancePolicy`; `chunk_tokens` not an int >= 1; `scoring` neither a preset name nor a
            `KVzipScoring` (whose own checks are listed there).

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
    chunk_tokens: int = 1024  # reconstruction tokens per forward step
    scoring: str | KVzipScoring = DEFAULT_PRESET  # a preset name (`KVZIP_PRESETS`) or a KVzipScoring

    name = "kv_zip"
    reconstructs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_tokens", self.chunk_tokens, 1)
        settings = resolve_scoring(self.scoring)  # (raises on an unknown name)
        # one spelling per setting, so that equal policies compare equal: a preset's settings by the preset's name
        named = [name for name, preset in KVZIP_PRESETS.items() if preset == settings]
        object.__setattr__(self, "scoring", named[0] if named else settings)

    @property
    def settings(self) -> KVzipScoring:
        """The ranking in force: the `scoring` preset looked up, or the `KVzipScoring` given."""
        return resolve_scoring(self.scoring)

    def with_scoring(self, **changes) -> KVzip:
        """This policy with some fields of its `KVzipScoring` changed, e.g. ``KVzip(compression_ratio=0.5,
        scoring="plain").with_scoring(kernel_size=3)``. Raises `ValueError` as `KVzipScoring` does."""
        return dataclasses.replace(self, scoring=dataclasses.replace(self.settings, **changes))

    def is_tiered(self) -> bool:
        return self.settings.layer_budgets == "global"

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
        guard = int(self.settings.safeguard * per_head)
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
        """The reconstruction scores that rank the tokens (`KVzipScoring.weigh`: with ``value_weighted``, times the
        relative value norm to the power `value_power`; else `scores` itself). Shapes: `scores` `[rows,
        num_kv_heads, held]`, `values` `[rows, num_kv_heads, held, head_dim]`, `valid` `[rows, held]` bool."""
        return self.settings.weigh(scores, values, valid)

    def _pooled(self, scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """`scores` (`[rows, num_kv_heads, held]`) pooled as `KVzipScoring.pool` pools them, float32."""
        return self.settings.pool(scores, valid)
