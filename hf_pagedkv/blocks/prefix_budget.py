"""`PrefixCacheBudget`: how much a pool's prefix cache may keep in cached-idle blocks. Pure Python."""

from __future__ import annotations

from hf_pagedkv.config import parse_bytes

#: What a growable pool's prefix cache keeps by default: idle blocks up to 1 GiB (all layers, keys + values).
DEFAULT_GROWABLE_BYTES = 2**30


class PrefixCacheBudget:
    """The most cached-idle blocks (published, refcount 0) a layer group keeps before evicting the least recently
    used ones, from `BlockPool(prefix_cache_memory=...)`.

    A size (``"1GiB"``, ``"512MB"``, bytes as an int) counts the idle blocks' bytes across every layer group's
    layers; a float in ``(0, 1]`` is a fraction of the group's blocks. The default (`None`): a fixed pool keeps
    idle blocks in any block not in use (fraction 1.0: they are evicted only when an allocation needs the space);
    a growable pool keeps up to `DEFAULT_GROWABLE_BYTES` and grows rather than evicting within that budget, so a
    prompt sent again later still hits (without a budget it would evict before every growth and keep nothing).

    Args:
        setting (`int`, `str` or `float`, *optional*): the budget, as above.
        growable (`bool`): whether the pool grows on demand.

    Raises:
        ValueError: a fraction outside ``(0, 1]``, or a size that `parse_bytes` refuses.
    """

    def __init__(self, setting: int | str | float | None, growable: bool) -> None:
        self.fraction: float | None = None  # of a group's blocks; or None
        self.bytes: int | None = None  # across all groups' layers; or None
        if setting is None:
            if growable:
                self.bytes = DEFAULT_GROWABLE_BYTES
            else:
                self.fraction = 1.0
        elif isinstance(setting, float):
            if not 0.0 < setting <= 1.0:
                raise ValueError(f"`prefix_cache_memory` as a fraction of the pool must be in (0, 1], got {setting!r}; "
                                 "give a size such as '1GiB' for an absolute budget.")
            self.fraction = setting
        else:
            self.bytes = parse_bytes(setting, "prefix_cache_memory")

    def max_idle_blocks(self, num_blocks: int, bytes_per_block: int) -> int | None:
        """Idle blocks a group of `num_blocks` blocks may keep; `bytes_per_block` is one block across every group's
        layers (0 before any layer is known: no limit yet, None)."""
        if self.fraction is not None:
            return int(self.fraction * num_blocks)
        return None if bytes_per_block == 0 else self.bytes // bytes_per_block

    def describe(self) -> str:
        return f"{self.fraction:.0%} of the pool" if self.fraction is not None else f"{self.bytes / 2**20:.0f} MiB"
