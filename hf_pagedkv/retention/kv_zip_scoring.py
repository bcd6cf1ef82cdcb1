"""`KVzipScoring`: how `KVzip` turns its reconstruction scores into a ranking, and its named presets."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from hf_pagedkv.retention.policy import builtin_numbers
from hf_pagedkv.retention.score_pooling import check_pooling, pool_scores

#: how `KVzip` divides its budget over the layers: the same everywhere, or by its ranking across layers
LAYER_BUDGETS = ("uniform", "global")
# the largest `value_power`: at 8 a token with twice the mean value norm already weighs 256 times as much
MAX_VALUE_POWER = 8


@dataclass(frozen=True)
class KVzipScoring:
    """The ranking of a `KVzip` policy: pooling, per-layer budgets, shared heads and value weighting. Most users pick
    a preset by name (`KVZIP_PRESETS`); this class is for a setting none of them gives.

    Args:
        kernel_size (`int`, *optional*, defaults to 1): a pooling of the scores over this many neighbouring tokens,
            odd (SnapKV's clustering step, so a kept token keeps its neighbours; 1: none, KVzip's own scores).
        pooling (`str`, *optional*, defaults to `"max"`): `"max"` (a token scores as its best neighbour) or `"avg"`
            (as the mean of its window; past either end only the tokens there are counted), as `SnapKV`'s.
        layer_budgets (`str`, *optional*, defaults to `"uniform"`): `"uniform"`: every (layer, KV head) keeps
            `keep_for(held)` tokens. `"global"`: KVzip's own ranking across layers. The (pooled) scores of every
            (layer, KV head, token) are ranked together, and each layer keeps as many tokens per head as its heads
            have, on average, in the top `keep_for(held)` times the number of (layer, head) pairs (the sinks and the
            last `recent_tokens` are kept anyway and not ranked). The heads of a layer share its blocks, so they
            keep the same number. Each full-attention layer is then a retention tier, a layer group of its own
            with its own block tables (`KVzip.score_budgets`), and the cache needs ``config=``. The layers' budgets
            are rounded to whole blocks below the largest, and their total never exceeds the uniform total.
        safeguard (`float`, *optional*, defaults to 0.0): with ``layer_budgets="global"``, in [0, 1]: each (layer,
            KV head) first gets its best ``int(safeguard * ranked)`` tokens, `ranked` being the tokens a uniform
            budget ranks per head, and the ranking across layers fills the rest (AdaKV's safeguard: Feng et al.,
            "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", arXiv 2407.11550, which guards
            a fifth); 1 gives the uniform budgets, 0 the plain ranking.
        share_heads (`bool`, *optional*, defaults to `False`): `True`: the KV heads of a layer keep the same tokens,
            ranked by the mean of their scores over the heads, then pooled (for ``pooling="avg"`` the same as the
            mean of the pooled scores; for ``"max"`` the best neighbour of the mean), so a layer sees one consistent
            part of the context instead of each head a different one. With ``layer_budgets="global"`` the layers'
            budgets come from the same means. How many tokens a layer keeps, and so the bytes held, do not change.
        value_weighted (`bool`, *optional*, defaults to `False`): `True`: each token's score is multiplied by the
            L2 norm of its value in that KV head, divided by the mean norm over the context's real tokens in that
            (row, layer, KV head), before the pooling and the ranking (`weigh`). A token's contribution to the
            attention output is its weight times its value, so a token attended to but with a small value matters
            less: Guo et al., "Attention Score is not All You Need for Token Importance Indicator in KV Cache
            Reduction: Value Also Matters" (VATP, arXiv 2406.12335). The bytes held do not change, and
            `compress_context` still returns the pass's own scores.
        value_power (`float`, *optional*, defaults to 1.0): with ``value_weighted=True``, the exponent of the
            relative value norm (``scores * (norm / mean_norm) ** value_power``), a number in (0, 8]; 2 weighs the
            values more. Without ``value_weighted`` it must stay 1.

    Raises:
        ValueError: `kernel_size` not an odd int >= 1; `pooling` not one of `POOLINGS`; `layer_budgets` not one of
            `LAYER_BUDGETS`; `safeguard` not a number in [0, 1], or not 0 with uniform budgets; `share_heads` or
            `value_weighted` not a bool; `value_power` not a number in (0, 8], or not 1 without ``value_weighted``.
    """

    kernel_size: int = 1  # odd pooling width in tokens (1: none)
    pooling: str = "max"  # "max" or "avg"
    layer_budgets: str = "uniform"  # "uniform" or "global" (ranked across layers; one tier per layer)
    safeguard: float = 0.0  # share of each head's uniform budget kept before the ranking across layers
    share_heads: bool = False  # the KV heads of a layer rank by their mean score
    value_weighted: bool = False  # scores times the relative value norm (VATP)
    value_power: float = 1.0  # the exponent of that relative norm

    def __post_init__(self) -> None:
        builtin_numbers(self)  # (np.uint8(3) is the kernel 3)
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
        if self.safeguard and self.layer_budgets != "global":
            raise ValueError(f"`safeguard` applies to the ranking across layers only: pass layer_budgets=\"global\" "
                             f"with it (got layer_budgets={self.layer_budgets!r}, safeguard={self.safeguard!r}).")

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
            (row, KV head); `scores` itself without ``value_weighted``.
        """
        if not self.value_weighted:
            return scores
        norms = values.float().norm(dim=-1).to(scores.device)  # [rows, num_kv_heads, held]
        if valid is None:
            mean = norms.mean(dim=-1, keepdim=True)
        else:
            real = valid.to(scores.device)[:, None, :].float()  # [rows, 1, held]
            mean = (norms * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp_min(1)
        relative = norms / mean.clamp_min(torch.finfo(torch.float32).tiny)
        # saturate instead of overflowing: a relative norm can reach `held` (one token holding all of the norm),
        # and inf would rank as noise (and 0 * inf is NaN); in the usual range both clamps change nothing
        largest = torch.finfo(torch.float32).max
        weight = relative.clamp_max(largest ** (1 / self.value_power) / 2) ** self.value_power
        return (scores.float() * weight).clamp_max(largest)

    def pool(self, scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """`scores` (`[rows, num_kv_heads, held]`) pooled over `kernel_size` tokens, float32; with `share_heads` each
        head's row is the mean over the layer's heads (so every head ranks the tokens alike). `valid` (bool,
        broadcastable to `scores`, False at left padding) is left out of an average pooling."""
        if not self.share_heads:
            return pool_scores(scores.float(), self.kernel_size, self.pooling, valid)
        mean = scores.float().mean(dim=1, keepdim=True)  # [rows, 1, held]: pooled once, then given to every head
        return pool_scores(mean, self.kernel_size, self.pooling, valid).expand(scores.shape).contiguous()


#: The named rankings of `KVzip(scoring=...)`. On SmolLM2-135M's passkey task (docs/retention.md, "KVzip settings"),
#: `"weighted"` answered 78 of 81 held-out examples at ratio 0.5 (98.7% of the full cache) and is the default.
KVZIP_PRESETS = {
    # Kim et al.'s own: raw reconstruction scores, the same budget in every (layer, KV head); the eval's `kv_zip`
    "plain": KVzipScoring(),
    # KVzip's ranking across layers over max-pooled scores (kernel 7); the eval's `kv_zip_global`
    "global": KVzipScoring(kernel_size=7, layer_budgets="global"),
    # the best measured: avg-pooled over 3 tokens, ranked across layers, weighted by the squared relative value norm;
    # the eval's `kv_zip_global --kv-zip-pooling avg --kv-zip-kernel 3 --kv-zip-value-weighted --kv-zip-value-power 2`
    "weighted": KVzipScoring(kernel_size=3, pooling="avg", layer_budgets="global", value_weighted=True,
                             value_power=2.0),
}
DEFAULT_PRESET = "weighted"


def resolve_scoring(scoring: str | KVzipScoring) -> KVzipScoring:
    """`scoring` as a `KVzipScoring`: a preset name looked up in `KVZIP_PRESETS`, or the object itself.

    Raises:
        ValueError: an unknown preset name, or neither a name nor a `KVzipScoring`.
    """
    if isinstance(scoring, KVzipScoring):
        return scoring
    if isinstance(scoring, str) and scoring in KVZIP_PRESETS:
        return KVZIP_PRESETS[scoring]
    raise ValueError(f"`scoring` must be one of the presets {tuple(KVZIP_PRESETS)} or a KVzipScoring(...) "
                     f"(hf_pagedkv.retention.KVzipScoring), got {scoring!r}.")
