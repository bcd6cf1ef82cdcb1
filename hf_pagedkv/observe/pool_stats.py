"""`PoolStats`: a snapshot of a pool's occupancy and prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupStats:
    """A snapshot of one layer group of a pool (see `BlockPool`). Bytes count keys plus values of its layers."""

    window: int | None  # sliding window in tokens, None for full attention
    layers: tuple[int, ...]  # model layers stored in this group
    num_blocks: int  # blocks the group holds storage for
    blocks_in_use: int  # blocks with refcount >= 1
    tokens_stored: int  # token slots filled in blocks in use (a shared block counts once)
    bytes_per_block: int  # bytes of one block across the group's layers
    bytes_in_use: int  # bytes of the blocks in use (quantized: + full-precision partial blocks and sinks)
    bytes_reserved: int  # bytes of storage the group has allocated


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's occupancy, summed over its layer groups (one `GroupStats` each in `groups`). Bytes
    count keys plus values of all layers; `tokens_stored` counts token slots, so a token held by a full-attention
    and a sliding-window group counts once in each."""

    block_size: int  # tokens per block
    num_blocks: int  # blocks the pool holds storage for (in use + cached-idle + free)
    blocks_in_use: int  # blocks with refcount >= 1
    blocks_free: int  # blocks that can be handed out
    tokens_stored: int  # tokens held in blocks in use; a block shared by several sequences counts once
    bytes_per_block: int  # bytes of one block across all layers (quantized: codes + scales)
    num_sequences: int  # live block tables (batch rows of live caches)
    bytes_in_use: int  # bytes of the blocks in use, all layers (quantized: + the full-precision partial blocks)
    bytes_reserved: int  # bytes of storage the pool has allocated, in use or not (quantized: + its staging area)
    blocks_cached: int = 0  # cached-idle blocks: refcount 0, still in the prefix index, evicted LRU beyond the budget
    bytes_cached: int = 0  # bytes of the cached-idle blocks (codes + scales when quantized), all layers
    prefix_cache_budget: int | None = None  # bytes cached-idle blocks may take (`prefix_cache_memory`), or None
    blocks_trapped: int = 0  # free blocks below the highest live one (storage fragmentation: `shrink` cannot return
    #                          them until `compact` moves the live blocks down)
    num_segments: int = 0  # storage segments held, all groups (one per growth)
    blocks_moved: int = 0  # blocks moved by `BlockPool.compact` since creation
    bytes_returned: int = 0  # storage bytes given back by `BlockPool.shrink` since creation
    lookups: int = 0  # prefix lookups (one per request attached with `PagedCache.from_prefix`)
    lookup_tokens: int = 0  # tokens those lookups asked about
    hit_tokens: int = 0  # tokens served from cached blocks instead of being computed
    evictions: int = 0  # cached-idle blocks evicted (hash dropped) to make room
    cow_copies: int = 0  # blocks copied because a shared (or published) block was about to be written
    groups: tuple[GroupStats, ...] = ()  # per layer group (group 0: full attention)
    # the host tier (`BlockPool(host_memory=...)`), all layer groups; host_memory is None without one, and the
    # block counts are 0 until the tier is sized (at its first use)
    host_memory: int | None = None  # byte budget of the host tier
    host_blocks: int = 0  # host blocks (capacity): free + in use + cached
    host_blocks_in_use: int = 0  # host blocks held by offloaded caches
    host_blocks_cached: int = 0  # prefix blocks kept in host memory for a hit (evicted from the device, or loaded)
    host_blocks_free: int = 0
    host_bytes_reserved: int = 0  # host memory allocated
    blocks_to_host: int = 0  # blocks copied device -> host since creation (offloaded + demoted)
    blocks_from_host: int = 0  # blocks copied host -> device since creation (prefetched + promoted)
    bytes_to_host: int = 0  # bytes of K/V copied device -> host (offloads, demotions, loaded overflow: host writes)
    bytes_from_host: int = 0  # bytes of K/V copied host -> device

    @property
    def hit_rate(self) -> float:
        """hit_tokens / lookup_tokens, in [0, 1] (0 before any lookup)."""
        return 0.0 if self.lookup_tokens == 0 else self.hit_tokens / self.lookup_tokens

    @property
    def fragmentation(self) -> float:
        """Unused slots inside allocated blocks / allocated slots (0 when nothing is allocated)."""
        slots = self.blocks_in_use * self.block_size
        return 0.0 if slots == 0 else 1.0 - self.tokens_stored / slots

    @property
    def usage(self) -> float:
        """Blocks in use / blocks held, in [0, 1]."""
        return 0.0 if self.num_blocks == 0 else self.blocks_in_use / self.num_blocks

    @property
    def host_usage(self) -> float:
        """Host blocks in use or cached / host blocks, in [0, 1] (0 without a sized host tier)."""
        used = self.host_blocks_in_use + self.host_blocks_cached
        return 0.0 if self.host_blocks == 0 else used / self.host_blocks
