"""`RetentionStats`: a snapshot of what a cache's retention policy kept and evicted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionStats:
    """Tokens seen vs held by one `PagedCache` (per batch row: rows of a batch move together).

    Attributes:
        policy (`str` or `None`): the policy's name (`SinkWindow.name`, ...), None without a retention policy.
        tokens_seen (`int`): every token the row has been given (`get_seq_length()`, what positions count from).
        tokens_held (`int`): tokens stored now (what attention reads before the next step's new tokens); with a
            tiered policy (`PyramidKV`), the mean over layers, rounded down.
        num_evictions (`int`): forward steps that evicted something.
        blocks_freed (`int`): block references let go by evictions, summed over rows and layer groups (shared
            blocks count per row).
        tokens_held_per_layer (`tuple[int, ...]`): with a tiered policy, the tokens each layer holds (in layer
            order); empty when every layer holds `tokens_held`.
    """

    policy: str | None
    tokens_seen: int
    tokens_held: int
    num_evictions: int
    blocks_freed: int
    tokens_held_per_layer: tuple[int, ...] = ()

    @property
    def tokens_evicted(self) -> int:
        return self.tokens_seen - self.tokens_held

    @property
    def kept_fraction(self) -> float:
        """Held over seen, in [0, 1] (1.0 for an empty cache)."""
        return self.tokens_held / self.tokens_seen if self.tokens_seen else 1.0
