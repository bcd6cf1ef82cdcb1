"""`LayerRegistry`: the layer groups of a pool (made on first use), the model layers each holds, and how many blocks
each gets."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hf_pagedkv.pool.block_group import BlockGroup
from hf_pagedkv.pool.pool_settings import PoolSettings, host_memory_bytes
from hf_pagedkv.storage.device_budget import blocks_for_budget, check_device_share, check_preallocation
from hf_pagedkv.storage.page_store import LayerSpec

if TYPE_CHECKING:
    from hf_pagedkv.observe.events import EventLog
    from hf_pagedkv.pool.host_tiers import HostTiers

logger = logging.getLogger(__name__)


class LayerRegistry:
    """The layer groups of a `BlockPool` (`groups`, made on first use by `group_for`), the model layers each holds
    (each with one `LayerSpec`), and their size: a fixed pool's `num_blocks` per group, or a `max_memory` pool's
    budget turned into blocks per group when its first layer is registered (the bytes of a block are known then);
    a growable pool's groups start empty.

    Invariants: `groups[i].index == i`, and each (window, tier) names one group; a layer is registered in one group
    only, with one spec (a pool is shared by caches of one model); once `budget_blocks` is set, every group holds at
    least that many blocks (a step reserves in all of them). Every method is called with the pool's lock held.

    Args:
        settings (`PoolSettings`): the pool's settings.
        host (`HostTiers`, *optional*): the pool's host tier, given to each group.
    """

    def __init__(self, settings: PoolSettings, host: HostTiers | None) -> None:
        self.settings = settings  # the pool's settings; fixed
        self.host = host  # the pool's host tier, or None; fixed
        self.groups: list[BlockGroup] = []  # layer groups; group 0 is full attention; appended by group_for only
        self.debug = settings.debug  # poison freed blocks, in the groups made from now on; changed by `set_debug`
        self._index: dict = {}  # window (None: full attention), or (window, tier) for a tier > 0 -> group index
        self._events: EventLog | None = None  # the pool's event log, given to every group; set once by `events`
        self.budget_blocks: int | None = None  # with max_memory: blocks per group once the first layer sized it
        self.budget_stages: int | None = None  # quantized, with max_memory: each group's stage capacity (the same)

    def set_debug(self, debug: bool) -> None:
        """Poison freed blocks (or stop), in every group, made or to be made."""
        self.debug = debug
        for group in self.groups:
            group.store.debug = debug

    @property
    def max_memory(self) -> int | None:
        return self.settings.max_memory

    @property
    def events(self) -> EventLog | None:
        return self._events

    @events.setter
    def events(self, log: EventLog) -> None:
        """Set the event log once (the pool makes it after group 0), for every group, made or to be made."""
        assert self._events is None, "the event log is set once"
        self._events = log
        for group in self.groups:
            group.events = log

    def group_for(self, window: int | None, tier: int = 0) -> int:
        """The index of the layer group of layers with this sliding window (`None`: full attention) and retention
        tier, made on first use with `blocks_per_group` blocks (see `BlockPool.group_for`)."""
        key = window if not tier else (window, tier)
        gi = self._index.get(key)
        if gi is None:
            s, gi = self.settings, len(self.groups)
            group = BlockGroup(gi, window, s.block_size, s.quant.for_window(window), debug=self.debug,
                               prefix_caching=s.prefix_caching, tier=tier, growable=s.growable, host=self.host)
            if self._events is not None:
                group.events = self._events
            self.groups.append(group)
            self._index[key] = gi
            if self.blocks_per_group is not None:
                group.add_blocks(self.blocks_per_group)
            if self.budget_stages is not None:
                group.store.set_stage_capacity(self.budget_stages)
            if gi and self._events is not None and self._events.enabled:
                logger.debug("BlockPool: new layer group %d (%s)", gi, group.name)
        return gi

    @property
    def blocks_per_group(self) -> int | None:
        """Blocks a new layer group gets: a fixed pool's, or a `max_memory` pool's once sized; None: it grows."""
        return self.settings.num_blocks if self.settings.num_blocks is not None else self.budget_blocks

    def max_idle_blocks(self, group: int) -> int | None:
        """Cached-idle blocks `group` keeps at most (`prefix_cache_memory`); None without prefix caching, or before
        any layer is known (a size budget needs the bytes of a block, over every group's layers)."""
        if self.settings.prefix_budget is None:
            return None
        per_block = sum(g.store.bytes_per_block for g in self.groups)
        return self.settings.prefix_budget.max_idle_blocks(self.groups[group].allocator.num_blocks, per_block)

    def check_group(self, layer_idx: int, group: int) -> None:
        """Raise `ValueError` if layer `layer_idx` is held in a layer group other than `group` (a cache of another
        model, or with other retention tiers). No side effects."""
        target = self.groups[group]
        for other in self.groups:
            if other is target or layer_idx not in other.store.specs:
                continue
            if (other.tier or target.tier) and other.window == target.window:
                raise ValueError(
                    f"This BlockPool holds layer {layer_idx} in its {other.name} layer group, but a cache uses "
                    f"it as {target.name}: a tiered retention policy (PyramidKV, KVzip with global layer budgets) "
                    "gives each tier of layers its own layer group, so the caches sharing a pool must all use the "
                    "same tiers; use a separate BlockPool for caches with other tiers."
                )
            raise ValueError(
                f"This BlockPool holds layer {layer_idx} in its {other.name} layer group, but a cache uses "
                f"it as {target.name}; a pool is shared only by caches of one model (build each cache with "
                "the same config=, or none)."
            )

    def register(self, layer_idx: int, spec: LayerSpec, num_layers: int | None, group: int) -> None:
        """Make sure layer group `group` has storage for `layer_idx` with this spec.

        With `max_memory`, the first layer sizes the pool (`device_budget.blocks_for_budget`) and every layer's
        device share is checked against that device's memory before its storage is allocated
        (`device_budget.check_device_share`): with `device_map`, layers on different devices count against their
        own device. With `num_blocks`, the same device share and, given `num_layers`, the whole pool are checked
        (`device_budget.check_preallocation`).

        Raises:
            ValueError: the pool already holds this layer with another shape, dtype or device (a pool shared
                between different models) or in another group; `max_memory` cannot be resolved without the number
                of layers (`num_layers`), is below one block, is more than the devices have, or would put more on
                this layer's device than it has; `num_blocks` blocks of every layer would not fit the devices
                (nothing is allocated for this layer then).
        """
        target = self.groups[group]
        for other in self.groups:
            known = other.store.specs.get(layer_idx)
            if known is None:
                continue
            if known != spec:
                raise ValueError(
                    f"This BlockPool holds layer {layer_idx} as {_describe(known)}, but got {_describe(spec)}. "
                    "A pool is shared only by caches of one model (same layer shapes and dtype); use a "
                    "separate BlockPool for each model."
                )
            self.check_group(layer_idx, group)
            return
        if self.max_memory is not None:  # sized by the first layer; each layer's device share checked
            # NOTE: every group gets the same number of blocks, so the groups together stay within the budget
            # (each layer belongs to one group); a sliding group rarely needs them all.
            # NOTE: a quantized pool's budget also holds the full-precision stages of open blocks (`budget_split`)
            store, budget, stages = target.store, self.max_memory, None
            block_bytes = store.budget_block_bytes
            if self.budget_blocks is None:
                stages, budget = store.budget_split(self.max_memory, spec, num_layers)
            n = self.budget_blocks or blocks_for_budget(budget, spec, num_layers, block_bytes, device_memory)
            known = [s for g in self.groups for s in g.store.specs.values()]
            check_device_share(layer_idx, spec, known, block_bytes, n, self.max_memory, device_memory)
            if self.budget_blocks is None:  # every group gets its blocks now: a step reserves in all of them
                self.budget_blocks, self.budget_stages = n, stages
                for g in self.groups:
                    if g.allocator.num_blocks == 0:
                        g.add_blocks(n)
                    if stages is not None:
                        g.store.set_stage_capacity(stages)
        elif self.settings.num_blocks is not None:  # a fixed pool preallocates every block of the layer: fits?
            held = sum(g.store.block_bytes(s) for g in self.groups for s in g.store.specs.values()
                       if s.device == spec.device) * self.settings.num_blocks
            check_preallocation(layer_idx, spec, num_layers, held, target.store.block_bytes(spec),
                                self.settings.num_blocks, self.settings.block_size, device_memory)
        target.store.add_layer(layer_idx, spec)
        if target.pad_block is not None:  # the new layer's storage of the pad block holds zeros too
            target.store.zero_blocks([target.pad_block], layer_idx)


def _describe(spec: LayerSpec) -> str:
    return (f"[num_kv_heads={spec.num_kv_heads}, head_dim={spec.key_dim}/{spec.value_dim}] "
            f"{str(spec.dtype).removeprefix('torch.')} on {spec.device}")


def device_memory(device: torch.device) -> int | None:
    """Total bytes of memory on `device` (physical RAM for the CPU), or None when it cannot be told."""
    if device.type == "cpu":
        return host_memory_bytes()
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None
