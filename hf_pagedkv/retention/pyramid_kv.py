"""`PyramidKV`: SnapKV's scores with a budget that shrinks with depth (Cai et al., arXiv 2406.02069)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_pagedkv.retention.policy import check_int
from hf_pagedkv.retention.snap_kv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """Pyramidal prompt compression: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling" (arXiv 2406.02069). Attention scatters over the prompt in the lower layers and funnels
    into a few tokens in the upper ones, so the lower layers keep more tokens and the upper ones fewer, the total the
    same as a uniform budget. Each (layer, KV head) scores the prompt as `SnapKV` does (the attention of the
    observation window's queries, pooled; the same `scores`) and keeps its best tokens and the window; only the
    number kept differs per layer.

    The schedule is the paper's arithmetic one (as in its KVCache-Factory code and kvpress's `PyramidKVPress`): with
    `P` = ``sink_tokens + recent_tokens`` protected tokens and a uniform budget `K` of the `held` prompt tokens, the
    scored part ``S = K - P`` runs linearly from ``top = 2 S - S / beta`` in layer 0 to ``S / beta`` in the last
    layer (capped at ``held - P``: then ``top = held - P`` and the bottom is ``2 S - top``), so the layers average
    `K`. Layer `l` of `L` keeps ``P + top - l * (top - bottom) / (L - 1)`` tokens (`budgets`).

    Memory is freed per layer: a block id spans every layer of its layer group, so the full-attention layers are
    split into `tiers` contiguous tiers, each its own layer group with its own block tables, and each tier keeps the
    mean of its layers' budgets (`tier_budgets`; the tiers differ by whole blocks, rounded to the nearest, so their
    tables end at the same position). ``tiers=1`` is exactly `SnapKV` with the same budget.

    Args:
        budget (`int`, *optional*): the uniform budget `K`: tokens a (layer, KV head) keeps of the prompt on average.
        compression_ratio (`float`, *optional*): in (0, 1), the fraction of the prompt removed on average.
        tiers (`int`, *optional*, defaults to 4): layer groups the full-attention layers are split into (contiguous,
            the first ones one layer larger when the layers do not divide evenly).
        beta (`int` or `float`, *optional*, defaults to 20): the pyramid's shape (the paper's beta): the last layer
            keeps ``S / beta`` scored tokens; larger is steeper.
        sink_tokens, recent_tokens, kernel_size, pooling: as `SnapKV` (defaults 0, 32, 7, ``"max"``).

    Raises:
        ValueError: as `SnapKV`; `tiers` not an int >= 1; `beta` not a number >= 1; at the cache's construction
            (`layer_tiers`), more tiers than full-attention layers, or a `budget` that leaves a tier fewer than
            ``sink_tokens + recent_tokens + 1`` tokens; a `PagedCache` without `config=` when `tiers > 1`.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache
    >>> from hf_pagedkv.retention import PyramidKV
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_pagedkv")
    >>> policy = PyramidKV(compression_ratio=0.5, tiers=4)
    >>> policy.tier_budgets(512, 1024, [8, 8, 7, 7], 16)   # what each tier keeps of a 1024-token prompt
    >>> cache = PagedCache(config=model.config, retention=policy)
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    ```
    """

    tiers: int = 4
    beta: float = 20

    name = "pyramid_kv"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("tiers", self.tiers, 1)
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta >= 1:
            raise ValueError(f"`beta` must be a number >= 1 (the last layer keeps 1/beta of the scored budget), got "
                             f"{self.beta!r}.")

    def budgets(self, num_layers: int, held: int, keep: int | None = None) -> list[float]:
        """The paper's per-layer budgets (tokens kept per KV head, not rounded), layer 0 first.

        Args:
            num_layers (`int`): full-attention layers.
            held (`int`): prompt tokens held before the compression.
            keep (`int`, *optional*): the uniform budget; by default `keep_for(held)`.

        Returns:
            `list[float]` of `num_layers` budgets, non-increasing, averaging `keep` (or `held` when nothing is evicted).
        """
        keep = self.keep_for(held) if keep is None else min(keep, held)
        P = self.sink_tokens + self.recent_tokens
        S = keep - P
        bottom = S / self.beta
        top = 2 * S - bottom
        if top > held - P:  # the first layers cannot keep more than the prompt
            top = held - P
            bottom = 2 * S - top
        if num_layers == 1:
            return [float(keep)]
        step = (top - bottom) / (num_layers - 1)
        return [P + top - layer * step for layer in range(num_layers)]

    def tiers_of(self, num_layers: int) -> list[list[int]]:
        """The layers (0-based among the full-attention ones) of each tier: contiguous, sizes differing by at most
        one (the lower tiers the larger)."""
        if num_layers < self.tiers:
            raise ValueError(f"{type(self).__name__}(tiers={self.tiers}) needs at least {self.tiers} full-attention "
                             f"layers, the model has {num_layers}: lower `tiers`.")
        size, extra = divmod(num_layers, self.tiers)
        out, lo = [], 0
        for t in range(self.tiers):
            n = size + (t < extra)
            out.append(list(range(lo, lo + n)))
            lo += n
        return out

    def layer_tiers(self, num_layers: int) -> list[int]:
        """Each full-attention layer's tier (`tiers_of`); with a `budget`, checks that every tier keeps at least
        ``sink_tokens + recent_tokens + 1`` tokens of any prompt longer than the budget."""
        tiers = self.tiers_of(num_layers)
        if self.budget is not None:  # the schedule only flattens when the prompt is short: its worst case is here
            low = self.sink_tokens + self.recent_tokens + 1
            per_layer = self.budgets(num_layers, 1 << 40)
            worst = sum(per_layer[i] for i in tiers[-1]) / len(tiers[-1])
            if worst < low:
                raise ValueError(
                    f"{self!r}: with {num_layers} layers in {self.tiers} tiers, the top tier keeps {worst:.1f} "
                    f"tokens, fewer than sink_tokens + recent_tokens + 1 = {low}; raise `budget`, or lower `beta` "
                    "(flatter) or sink_tokens/recent_tokens.")
        return [t for t, layers in enumerate(tiers) for _ in layers]

    def tier_budgets(self, keep: int, held: int, tier_sizes: list[int], block_size: int) -> list[int]:
        """Tokens each tier keeps per (row, layer, KV head) for a uniform budget `keep` of `held` prompt tokens: the
        mean of its layers' `budgets`, then every tier's difference from tier 0 rounded to the nearest whole block
        (so the tiers' tables end at the same position; the total moves by at most half a block per layer); at
        least ``sink_tokens + recent_tokens + 1`` (whole blocks up) and at most `held`.

        Args:
            keep (`int`): the uniform budget (`plan`'s keep count).
            held (`int`): prompt tokens held.
            tier_sizes (`list[int]`): layers per tier, lowest first.
            block_size (`int`): tokens per block.

        Returns:
            `list[int]`, non-increasing, tier 0 first.
        """
        per_layer = self.budgets(sum(tier_sizes), held, keep)
        means, lo = [], 0
        for n in tier_sizes:
            means.append(sum(per_layer[lo: lo + n]) / n)
            lo += n
        top = min(held, round(means[0]))
        low = min(top, self.sink_tokens + self.recent_tokens + 1)
        out = []
        for mean in means:
            drop = max(0, round((top - mean) / block_size)) * block_size
            while drop and top - drop < low:  # never below the protected tokens plus one
                drop -= block_size
            out.append(top - drop)
        return out

    def __repr__(self) -> str:
        size = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        return (f"PyramidKV({size}, tiers={self.tiers}, beta={self.beta}, sink_tokens={self.sink_tokens}, "
                f"recent_tokens={self.recent_tokens}, recent_share={self.recent_share}, kernel_size={self.kernel_size}, pooling={self.pooling!r})")
