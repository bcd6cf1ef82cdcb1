"""`ImportancePolicy`: the common part of the query-free importance policies (score keys, keep the best per head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.retention.policy import EvictionPlan, RetentionPolicy, builtin_numbers, check_int


@dataclass(frozen=True)
class ImportancePolicy(RetentionPolicy):
    """Keep, per layer and per KV head, the `keep` held tokens with the highest score (`scores`, from the keys only:
    no query is needed, so it runs in the cache). Every (layer, head) keeps the same number of tokens, so each head's
    kept tokens are stored compactly in the row's blocks (slot `i` of head `h` holds that head's `i`-th kept token,
    in their original order; keys keep their RoPE) and the blocks beyond the budget go back to the pool.

    Give exactly one of:

    - `budget`: a streaming budget: before every forward step a row holding more than `budget` tokens is compacted
      to `budget` (the step's new tokens come on top, so a row holds at most ``budget + new`` tokens);
    - `compression_ratio`: the fraction of the context to remove (kvpress's term): the tokens held when the second
      forward step starts (the prompt, after a one-step prefill) are compacted once to
      ``int(held * (1 - compression_ratio))``; what comes after (a question, the answer) is kept.

    The first `sink_tokens` and the last `recent_tokens` held tokens are always kept (StreamingLLM's sinks; the local
    context the next tokens need most). `recent_share` widens that recent window to a fraction of each head's kept
    tokens, H2O's split (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models", arXiv 2306.14048, half heavy hitters and half recent tokens): of ``keep`` kept tokens, the last
    ``recent_for(keep)`` held tokens are kept whatever their score and the scores choose the rest.

    NOTE: a compaction reads each layer's held K/V, gathers the kept tokens and writes them into fresh blocks, so a
    streaming budget costs one gather of ``budget`` tokens per layer and step (about what `DynamicCache`'s `cat`
    costs). In a quantized pool the kept tokens are de-quantized and encoded again in their new blocks (a second
    quantization, error up to twice the codec's bound); `SinkWindow` evicts quantized blocks as blocks instead.

    Args:
        budget (`int`, *optional*): tokens each row keeps before a step.
        compression_ratio (`float`, *optional*): in (0, 1), the fraction of the prompt removed.
        sink_tokens (`int`, *optional*, defaults to 4): leading tokens always kept.
        recent_tokens (`int`, *optional*, defaults to 64): trailing held tokens always kept.
        recent_share (`float`, *optional*, defaults to 0.0): in [0, 1), the fraction of each head's kept tokens
            given to the most recent held tokens (H2O's recent window; 0.5 is the paper's split): at a compaction to
            ``keep`` tokens, the last ``max(recent_tokens, int(recent_share * keep))`` held tokens are kept (at most
            ``keep - sink_tokens``), the scores choose the others. 0: only `recent_tokens` (the default, unchanged).

    Raises:
        ValueError: neither or both of `budget` / `compression_ratio`; a budget below ``sink_tokens +
            recent_tokens + 1``; a ratio outside (0, 1); negative protected counts; `recent_share` not a float in
            [0, 1).
    """

    budget: int | None = None
    compression_ratio: float | None = None
    sink_tokens: int = 4
    recent_tokens: int = 64
    recent_share: float = 0.0

    def __post_init__(self) -> None:
        builtin_numbers(self)  # (np.int64(512) is a budget; the fields of the subclasses too)
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("recent_tokens", self.recent_tokens, 0)
        if isinstance(self.recent_share, bool) or not isinstance(self.recent_share, (int, float)) \
                or not 0 <= self.recent_share < 1:
            raise ValueError(f"`recent_share` must be a float in [0, 1) (the fraction of each head's kept tokens "
                             f"given to the most recent ones; 0.5 is H2O's split), got {self.recent_share!r}.")
        if (self.budget is None) == (self.compression_ratio is None):
            raise ValueError(f"{type(self).__name__}: give exactly one of `budget` (tokens) and `compression_ratio` "
                             f"(fraction removed); got budget={self.budget!r}, "
                             f"compression_ratio={self.compression_ratio!r}.")
        if self.budget is not None:
            low = self.sink_tokens + self.recent_tokens + 1
            if isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget < low:
                raise ValueError(f"`budget` must be >= {low}: sink_tokens={self.sink_tokens} + recent_tokens="
                                 f"{self.recent_tokens} are always kept, plus at least one scored token; got "
                                 f"{self.budget}. Lower sink_tokens/recent_tokens for a smaller budget.")
            check_int("budget", self.budget, low)
        elif isinstance(self.compression_ratio, bool) or not isinstance(self.compression_ratio, (int, float)) \
                or not 0 < self.compression_ratio < 1:
            raise ValueError(f"`compression_ratio` must be a float in (0, 1) (the fraction of the prompt removed), "
                             f"got {self.compression_ratio!r}.")

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """Compact to `budget` when a row holds more; with a ratio, compact once at the second step (`step == 1`).
        Idempotent: planning again after the eviction evicts nothing."""
        if self.budget is not None:
            return EvictionPlan(keep_tokens=self.budget if held > self.budget else None)
        if step != 1 or held == 0 or seen != held:  # once: seen > held after the compaction
            return EvictionPlan()
        keep = self.keep_for(held)
        return EvictionPlan(keep_tokens=keep if keep < held else None)

    def keep_for(self, held: int) -> int:
        """Tokens each (row, layer, KV head) keeps when `held` are compacted: `budget`, or
        ``int(held * (1 - compression_ratio))`` but at least ``sink_tokens + recent_tokens + 1``; at most `held`
        (then nothing is evicted)."""
        if self.budget is not None:
            return min(held, self.budget)
        return min(held, max(int(held * (1 - self.compression_ratio)), self.sink_tokens + self.recent_tokens + 1))

    def recent_for(self, keep: int) -> int:
        """The trailing held tokens a compaction to `keep` tokens per head keeps whatever their score:
        ``max(recent_tokens, int(recent_share * keep))``, at most ``keep - sink_tokens`` (so the sinks stay)."""
        return max(self.recent_tokens, min(int(self.recent_share * keep), keep - self.sink_tokens))

    def max_held(self, new: int, block_size: int) -> int | None:
        return None if self.budget is None else self.budget + new

    def scores(self, keys: torch.Tensor, observed: tuple[torch.Tensor, float] | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """Importance of each held token, `[batch, num_kv_heads, held]` float32 (higher: keep). `observed` is what a
        query-aware policy (`needs_queries`) gets from the attention (`QueryWindow`); the others ignore it. `valid`
        (`[batch, held]` bool, False at left padding; `select` ranks padding last whatever its score) is for a
        policy whose score of a token reads its neighbours' (`KVzip`'s average pooling)."""
        raise NotImplementedError

    def select(self, keys: torch.Tensor, keep: int, observed: tuple[torch.Tensor, float] | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """The `keep` highest-scoring tokens per head (ties: the older first), the protected sinks and the last
        `recent_for(keep)` tokens first; ascending. With `valid` (a left-padded batch) the sinks are each row's first
        real tokens and padding comes after every real token, so a row keeps padding only if it has fewer than
        `keep` real tokens; kept in ascending order, that padding sits where the row's attention mask masks it.

        Args:
            keys (`torch.Tensor` of shape `[batch, num_kv_heads, held, head_dim]`).
            keep (`int`): tokens kept per head.
            observed (`(queries, scaling)`, *optional*): for a query-aware policy, the observation window's queries
                `[batch, num_heads, w, head_dim]` and the attention's scale.
            valid (`torch.BoolTensor` of shape `[batch, held]`, *optional*): False at each row's left padding.

        Returns:
            `torch.LongTensor` of shape `[batch, num_kv_heads, keep]`.
        """
        held = keys.shape[2]
        s = self.scores(keys, observed, valid=valid).clone()  # [batch, num_kv_heads, held]
        if valid is None:
            s[..., : self.sink_tokens] = float("inf")
        else:  # the sinks: the first real tokens of each row
            first = (~valid).sum(dim=-1, keepdim=True)  # [batch, 1]: the row's padding
            pos = torch.arange(held, device=s.device)[None, :] - first.to(s.device)  # [batch, held]
            s.masked_fill_(((pos >= 0) & (pos < self.sink_tokens))[:, None, :], float("inf"))
        s[..., max(0, held - self.recent_for(keep)):] = float("inf")
        if valid is not None:
            s.masked_fill_(~valid.to(s.device)[:, None, :], float("-inf"))
        # NOTE: a stable sort, so equal scores keep the older token: equal scores are common (RoPE is a rotation, so
        # a repeated token has the same key norm at every position in the first layer), and the choice must not
        # depend on the kernel
        idx = s.argsort(dim=-1, descending=True, stable=True)[..., :keep]  # [batch, num_kv_heads, keep]
        return idx.sort(dim=-1).values
