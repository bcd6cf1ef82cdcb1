"""`RetentionPolicy`: what a retention policy tells the `Evictor` before each forward step."""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import torch


class EvictionPlan(NamedTuple):
    """What to evict before one forward step (one of the two fields is set, or neither: keep everything).

    drop_positions: logical block positions to free whole, in every row and layer (no tensor is touched).
    keep_tokens: the number of tokens each (row, layer, KV head) keeps; the policy's `select` picks which, and the
        kept tokens are compacted into fresh blocks.
    """

    drop_positions: list[int] = []
    keep_tokens: int | None = None


class RetentionPolicy:
    """The interface of a retention policy (one small frozen dataclass per method, as kvpress has one press each).

    Before each forward step the cache asks `plan(held, seen, new, block_size, step)` what to evict; a token-level
    policy also implements `select`. Tokens are counted in the cache's *logical* order: a row holds `held` tokens in its
    block slots ``0 .. held - 1`` (oldest first), after `seen - held` tokens were evicted.
    """

    name = "retention"
    #: a query-aware policy scores tokens by the attention of recorded queries (`QueryWindow`, given through the
    #: ``"hf_pagedkv"`` attention implementation) and says which steps it `observes`
    needs_queries = False
    #: a policy that compresses only through a reconstruction pass (`KVzip`, `hf_pagedkv.compress_context`),
    #: which it gets as `select`'s `observed` scores; it keeps `keep_for(held)` tokens (`ImportancePolicy`)
    reconstructs = False

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """What to evict before forward step number `step` (0 for the first) that adds `new` tokens to rows holding
        `held` (of `seen`) tokens."""
        raise NotImplementedError

    def observes(self, step: int) -> bool:
        """For a query-aware policy: whether the queries of forward step `step` (0 for the first) are needed."""
        return False

    def select(self, keys: torch.Tensor, keep: int, observed: tuple[torch.Tensor, float] | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """For a token-level policy: which `keep` held tokens each head keeps.

        Args:
            keys (`torch.Tensor` of shape `[batch, num_kv_heads, held, head_dim]`): one layer's held keys (RoPE
                applied, in logical order).
            keep (`int`): tokens to keep per head, ``0 < keep < held``.
            observed (`(queries, scaling)`, *optional*): for a query-aware policy (`needs_queries`), the recorded
                queries `[batch, num_heads, w, head_dim]` of the layer and its attention's scale.
            valid (`torch.BoolTensor` of shape `[batch, held]`, *optional*): False at each row's left padding.

        Returns:
            `torch.LongTensor` of shape `[batch, num_kv_heads, keep]`: logical indices, ascending per head.
        """
        raise NotImplementedError(f"{type(self).__name__} evicts whole blocks; it has no token selection.")

    #: tiers of full-attention layers, each its own layer group with its own budget (`PyramidKV`); 1: one group
    tiers = 1

    def is_tiered(self) -> bool:
        """Whether the policy splits the full-attention layers into layer groups of their own (`layer_tiers`), so
        a cache needs the model's config up front."""
        return self.tiers > 1

    def layer_tiers(self, num_layers: int) -> list[int]:
        """The tier (0 for the lowest layers) of each of a model's `num_layers` full-attention layers, in order;
        every layer in tier 0 unless the policy is tiered.

        Raises:
            ValueError: the policy cannot be used with that many layers (a tiered policy says why).
        """
        return [0] * num_layers

    def tier_budgets(self, keep: int, held: int, tier_sizes: list[int], block_size: int) -> list[int]:
        """Tokens each tier keeps per (row, layer, head) when the plan says `keep` (of `held`); `tier_sizes`: the
        layers of each tier. The tiers differ by whole blocks from the one keeping the most (the `Evictor` aligns
        their tables); an untiered policy keeps `keep` everywhere."""
        return [keep] * len(tier_sizes)

    def score_budgets(self, scores: list[list[torch.Tensor]], keep: int, held: int,
                      block_size: int, valid: torch.Tensor | None = None) -> list[int] | None:
        """For a policy scored by a reconstruction pass (`KVzip`): the tokens each tier keeps, chosen from the
        `scores` (per tier, its layers' `[rows, num_kv_heads, held]` scores; `valid`: `[rows, held]`, False at left
        padding) for a uniform budget `keep` of `held`; or None to use `tier_budgets`."""
        return None

    def max_held(self, new: int, block_size: int) -> int | None:
        """The most tokens a row may hold after a step of `new` tokens (for invariant 3), or None (no bound)."""
        return None


def builtin_numbers(policy) -> None:
    """Turn a frozen dataclass policy's numpy (or other `numbers`) integer and real scalars into Python's `int` and
    `float`, so ``budget=np.int64(512)`` is the budget 512, as ``compression_ratio=np.float32(0.5)`` is 0.5; bools
    (and `numpy.bool_`) stay as they are, for the checks to refuse."""
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, bool) or type(value) in (int, float):
            continue
        if isinstance(value, numbers.Integral):
            object.__setattr__(policy, f.name, int(value))
        elif isinstance(value, numbers.Real):
            object.__setattr__(policy, f.name, float(value))


def check_int(name: str, value, low: int) -> None:
    """Raise `ValueError` unless `value` is an int >= `low` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
