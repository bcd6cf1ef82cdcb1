"""`PoolSettings`: the checked arguments of a `BlockPool`, fixed for its lifetime."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hf_pagedkv.blocks.prefix_budget import PrefixCacheBudget
from hf_pagedkv.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_QUANT_BLOCK_SIZE,
    check_block_size,
    check_positive_int,
    parse_bytes,
)
from hf_pagedkv.pool.group_quant import GroupQuant

_MAX_SHRINK_AFTER = 1e9  # seconds (about 30 years): a timer's delay must fit the platform's time_t
# host bytes the allocator keeps per block id of every layer group (refcount, fill, free set and heap entries;
# about 122 with CPython 3.11), whatever the model: what a fixed pool of `num_blocks` costs before any layer is known
_BOOKKEEPING_BYTES_PER_BLOCK = 128


@dataclass(frozen=True)
class PoolSettings:
    """What `BlockPool(...)` was asked for, checked and resolved (see `BlockPool` for each argument): sizes in
    bytes, the storage format a `GroupQuant` (one `QuantConfig` per kind of layer group), the block size defaulted
    from it: one block size for the whole pool, 32 tokens when any group is quantized, else 16.

    Build it with `PoolSettings.of(...)`, which takes `BlockPool`'s arguments and raises `ValueError` naming the
    first wrong one (the errors `BlockPool` documents).
    """

    block_size: int  # tokens per block
    num_blocks: int | None  # blocks per layer group of a fixed pool, or None
    max_memory: int | None  # byte budget of all layers' keys and values, or None
    debug: bool  # poison freed blocks (initially; `BlockPool.debug` may change it)
    prefix_caching: bool  # keep a prefix index
    quant: GroupQuant  # the storage format of each kind of layer group
    host_memory: int | None  # bytes of the host tier, or None
    prefix_budget: PrefixCacheBudget | None  # how many cached-idle blocks a group keeps; None without prefix caching
    shrink_after: float | None  # idle seconds before a growable pool shrinks by itself, or None

    @property
    def growable(self) -> bool:
        """Whether the pool grows on demand (neither `num_blocks` nor `max_memory`) instead of raising."""
        return self.num_blocks is None and self.max_memory is None

    @classmethod
    def of(cls, block_size=None, num_blocks=None, max_memory=None, debug=False, prefix_caching=False, quant=None,
           host_memory=None, prefix_cache_memory=None, shrink_after=None) -> PoolSettings:
        """Check `BlockPool`'s arguments, in its order, and resolve them.

        Raises:
            ValueError: as `BlockPool` documents, for the first wrong argument.
        """
        for name, flag in (("debug", debug), ("prefix_caching", prefix_caching)):
            if not isinstance(flag, bool):
                raise ValueError(f"BlockPool({name}={flag!r}): give True or False.")
        quant = GroupQuant.resolve(quant)
        if prefix_cache_memory is not None and not prefix_caching:
            raise ValueError(f"prefix_cache_memory={prefix_cache_memory!r} sizes the prefix cache; it needs "
                             "BlockPool(prefix_caching=True).")
        if block_size is None:  # NOTE: one block size for every group: a block id names one token range in all
            # groups' tables; a quantized group's key scales amortise over the block, so any quantized group picks 32
            block_size = DEFAULT_QUANT_BLOCK_SIZE if quant.is_quantized else DEFAULT_BLOCK_SIZE
        check_block_size(block_size)
        if num_blocks is not None:
            check_positive_int("num_blocks", num_blocks)
            check_bookkeeping(num_blocks, block_size)
        if num_blocks is not None and max_memory is not None:
            raise ValueError("Give `num_blocks` or `max_memory`, not both.")
        max_memory = None if max_memory is None else parse_bytes(max_memory)
        growable = num_blocks is None and max_memory is None
        if shrink_after is not None:
            if (isinstance(shrink_after, bool) or not isinstance(shrink_after, (int, float))
                    or not 0 < shrink_after <= _MAX_SHRINK_AFTER):
                raise ValueError(f"shrink_after={shrink_after!r}: give the idle time in seconds, a number > 0 and at "
                                 f"most {_MAX_SHRINK_AFTER:.0e} (or None to shrink only when pool.shrink() is called).")
            if not growable:
                raise ValueError("shrink_after= is for a growable pool (num_blocks=None and max_memory=None): a fixed "
                                 "pool keeps its preallocation.")
        prefix_budget = PrefixCacheBudget(prefix_cache_memory, growable) if prefix_caching else None
        host_memory = None if host_memory is None else parse_bytes(host_memory, name="host_memory")
        ram = host_memory_bytes()
        if host_memory is not None and ram is not None and host_memory > ram:
            raise ValueError(f"host_memory={host_memory:,} bytes is more than this machine's memory ({ram:,} bytes): "
                             "the host tier holds offloaded caches in RAM (pinned under CUDA), preallocated at its "
                             "first offload; lower host_memory.")
        return cls(block_size, num_blocks, max_memory, debug, prefix_caching, quant, host_memory, prefix_budget,
                   None if shrink_after is None else float(shrink_after))


def host_memory_bytes() -> int | None:
    """Physical RAM of this machine in bytes, or None when it cannot be told."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_bookkeeping(num_blocks: int, block_size: int) -> None:
    """Refuse a fixed pool whose block bookkeeping alone (`_BOOKKEEPING_BYTES_PER_BLOCK` host bytes per block id,
    made at construction, before any layer's storage) would not fit in this machine's RAM: it would raise a bare
    `MemoryError` or swap for minutes. The storage itself is checked when the layers register
    (`device_budget.check_preallocation`).

    Raises:
        ValueError: naming `num_blocks`, the bytes it would take, the RAM, and `max_memory` as the alternative.
    """
    need, have = num_blocks * _BOOKKEEPING_BYTES_PER_BLOCK, host_memory_bytes()
    if have is not None and need > have:
        raise ValueError(
            f"BlockPool(num_blocks={num_blocks:,}): a fixed pool preallocates its blocks, and their bookkeeping "
            f"alone would take {need:,} bytes of host memory ({_BOOKKEEPING_BYTES_PER_BLOCK} bytes per block), "
            f"more than this machine has ({have:,} bytes), before any layer's storage ({block_size} tokens of every "
            f"layer per block). Give fewer blocks (at most {have // _BOOKKEEPING_BYTES_PER_BLOCK:,} fit the "
            "bookkeeping, far fewer the storage), or size the pool from a byte budget with max_memory='4GiB'."
        )
