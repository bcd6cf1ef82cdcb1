"""`StagingStore`: full-precision storage for the blocks of a quantized pool that are not encoded yet."""

from __future__ import annotations

import torch

from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.storage.page_store import LayerSpec

# NOTE: a stage is a full-precision block (in an fp32 model as large as ~8 encoded int4 blocks), so capacity grows by
# a quarter of itself (at least one stage), not by doubling from 8: a batch-1 pool holds one or two stages, not 8.
_GROWTH_FRACTION = 4  # a full store grows by num_stages // _GROWTH_FRACTION stages, at least 1


class StagingStore:
    """The residual window of a quantized pool: one full-precision *stage* per partial block.

    A block of a quantized pool is written token by token into a stage until its last slot is written; then it is
    encoded once and its stage is returned. So the stages in use are about one per sequence (its partial last block),
    and the store is sized by the number of live sequences, not by the pool. Layout, per layer::

        keys[layer]:   [num_kv_heads, num_stages * block_size, key_dim]     (model dtype)
        values[layer]: [num_kv_heads, num_stages * block_size, value_dim]

    Stage `s` holds slots ``s * block_size .. (s + 1) * block_size - 1``. Invariant: a stage id is either free
    (in `_free`) or owned by exactly one block of the pool (the owner, `QuantizedPageStore`, keeps that map).
    Capacity grows by a quarter of itself (at least one stage) when full, in every layer or (an allocation failing)
    in none, so it follows the number of live sequences (`tests/storage/test_staging_store.py`); it never shrinks.
    New stages are zero, and new and freed stages are NaN in debug mode only.

    A pool with a byte budget (`BlockPool(max_memory=...)`) sets `capacity`: the store then never
    holds more than that many stages (its bytes are part of the budget), and `allocate` raises `PoolExhaustedError`
    when all are in use; the pool checks `num_available` before a step, so a step fails before it changes anything.
    """

    def __init__(self, block_size: int, debug: bool = False) -> None:
        self.block_size = block_size  # tokens per stage (= block size); fixed
        self.debug = debug  # poison freed stages with NaN; set by the owning store
        self.num_stages = 0  # stages allocated in every layer's tensors; changed by `_grow` only
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.keys: dict[int, torch.Tensor] = {}  # layer_idx -> [num_kv_heads, num_stages * block_size, key_dim]
        self.values: dict[int, torch.Tensor] = {}  # layer_idx -> [num_kv_heads, num_stages * block_size, value_dim]
        # free stage ids, popped from the end: a freed stage goes on top (reused first, most recently freed first);
        # the ids a growth adds go in when the list is empty, lowest on top
        self._free: list[int] = []
        self.capacity: int | None = None  # most stages ever allocated (a fixed budget), or None; set by the pool

    @property
    def num_used(self) -> int:
        return self.num_stages - len(self._free)

    def num_available(self) -> int | None:
        """Stages `allocate` can still hand out (free, or within `capacity` not yet allocated); None: no limit."""
        return None if self.capacity is None else self.capacity - self.num_used

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor this store owns (for byte accounting checks)."""
        return [*self.keys.values(), *self.values.values()]

    def bytes_in_use(self) -> int:
        """Bytes of the stages handed out (`num_used` of them), every layer."""
        return self.num_used * self.bytes_per_stage()

    def bytes_reserved(self) -> int:
        """Bytes of every stage allocated, in use or free: the bytes of `tensors()`."""
        return self.num_stages * self.bytes_per_stage()

    def bytes_per_stage(self) -> int:
        """Bytes of one stage across all layers, keys plus values."""
        return sum(spec.bytes_per_token for spec in self.specs.values()) * self.block_size

    @torch.inference_mode(False)  # never inference tensors: they outlive the call (see PageStore._new)
    def _new(self, spec: LayerSpec, dim: int, num_stages: int) -> torch.Tensor:
        fill = float("nan") if self.debug and spec.dtype.is_floating_point else 0
        return torch.full((spec.num_kv_heads, num_stages * self.block_size, dim), fill, dtype=spec.dtype,
                          device=spec.device)

    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        assert layer_idx not in self.specs, f"layer {layer_idx} already has stages"
        self.specs[layer_idx] = spec
        self.keys[layer_idx] = self._new(spec, spec.key_dim, self.num_stages)
        self.values[layer_idx] = self._new(spec, spec.value_dim, self.num_stages)

    def _grow(self) -> None:
        new_num = self.num_stages + max(1, self.num_stages // _GROWTH_FRACTION)
        if self.capacity is not None:
            new_num = min(new_num, self.capacity)
        grown = []  # every layer's new tensors first: a failed allocation leaves the store as it was
        for idx, spec in self.specs.items():
            for store, dim in ((self.keys, spec.key_dim), (self.values, spec.value_dim)):
                new = self._new(spec, dim, new_num)
                new[:, : store[idx].shape[1]] = store[idx]
                grown.append((store, idx, new))
        for store, idx, new in grown:
            store[idx] = new
        self._free = list(range(new_num - 1, self.num_stages - 1, -1)) + self._free
        self.num_stages = new_num

    def allocate(self) -> int:
        """A free stage id (growing the tensors if none is free).

        Raises:
            PoolExhaustedError: all `capacity` stages are in use (nothing changed).
        """
        if not self._free:
            if self.capacity is not None and self.num_stages >= self.capacity:
                raise PoolExhaustedError(
                    f"BlockPool is full: all {counted(self.capacity, 'full-precision stage')} of its budget are in use "
                    "(a quantized pool holds each row's partial last block in full precision). Raise max_memory, "
                    "run fewer rows at once, or release finished caches.")
            self._grow()
        return self._free.pop()

    def free(self, stage: int, poison: bool = True) -> None:
        """Return `stage`; NaN-fill it in debug mode (unless `poison` is False: the caller calls `poison` once its
        bookkeeping is done). Freeing a free stage, or an id past the tensors, is a bookkeeping bug of the owner: it
        would hand one stage to two blocks later, so it raises here instead."""
        assert 0 <= stage < self.num_stages, (  # the message is built only on failure
            f"free of unknown stage {stage} (the store has "
            f"{f'stages 0..{self.num_stages - 1}' if self.num_stages else 'no stages'})")
        assert stage not in self._free, f"double free of stage {stage}"
        self._free.append(stage)
        if poison:
            self.poison([stage])

    def poison(self, stages: list[int]) -> None:
        """NaN-fill free `stages` in debug mode (a read of a freed stage then shows at once)."""
        if not self.debug:
            return
        for stage in stages:
            for store in (self.keys, self.values):
                for t in store.values():
                    if t.dtype.is_floating_point:
                        t[:, stage * self.block_size: (stage + 1) * self.block_size] = float("nan")

    def block(self, store: dict[int, torch.Tensor], layer_idx: int, stage: int) -> torch.Tensor:
        """Stage `stage` of one layer's keys or values, a view `[num_kv_heads, block_size, dim]`."""
        return store[layer_idx].narrow(1, stage * self.block_size, self.block_size)

    def blocks(self, store: dict[int, torch.Tensor], layer_idx: int) -> torch.Tensor:
        """All stages of one layer's keys or values, a view `[num_kv_heads, num_stages, block_size, dim]`."""
        t = store[layer_idx]
        return t.view(t.shape[0], self.num_stages, self.block_size, t.shape[-1])

    def copy_stages(self, layer_idx: int, pairs: list[tuple[int, int]]) -> None:
        """Copy stage `s` -> stage `d` for each `(s, d)` of `pairs`, keys and values of one layer."""
        for store in (self.keys, self.values):
            for s, d in pairs:
                self.block(store, layer_idx, d).copy_(self.block(store, layer_idx, s))

    def read_stages(self, store: dict[int, torch.Tensor], layer_idx: int, stages: list[int],
                    length: int) -> torch.Tensor:
        """Copies of the first `length` tokens of `stages` of one layer's keys or values, in that order,
        `[num_kv_heads, len(stages), length, dim]` (contiguous)."""
        every = self.blocks(store, layer_idx)  # [num_kv_heads, num_stages, block_size, dim]
        idx = torch.tensor(stages, dtype=torch.long, device=every.device)
        return every.index_select(1, idx)[:, :, :length].contiguous()

    def write_stages(self, store: dict[int, torch.Tensor], layer_idx: int, stages: list[int],
                     src: torch.Tensor) -> None:
        """Overwrite the first ``src.shape[2]`` tokens of `stages` of one layer's keys or values with `src`
        `[num_kv_heads, len(stages), length, dim]` (from any device)."""
        every = self.blocks(store, layer_idx)  # [num_kv_heads, num_stages, block_size, dim]
        idx = torch.tensor(stages, dtype=torch.long, device=every.device)
        every[:, :, : src.shape[2]].index_copy_(1, idx, src.to(every.device))
