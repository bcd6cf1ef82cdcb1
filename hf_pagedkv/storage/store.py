"""`Store`: what the pool, the cache adapter, the host tier, prefix files and attention call on a page store."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from hf_pagedkv.storage.code_layout import CodeLayout
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.read_request import ReadRequest
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor


@runtime_checkable
class Store(Protocol):
    """The K/V storage of one layer group, addressed by block id: `PageStore` (full precision) and
    `QuantizedPageStore` (codes + scales) both satisfy it, so callers never ask which one they have except to read
    in place (`FullPrecisionStore`, `CodeStore`).

    A block id names the same slot range in every layer; slot `s` is token ``s % block_size`` of block
    ``s // block_size``. Storage grows and shrinks by whole segments of blocks (`segment_blocks`), copying nothing.
    Refcounts are the pool's: the store learns that a block is free through `release`.
    """

    block_size: int  # tokens per block; fixed
    is_quantized: bool  # False: `FullPrecisionStore`; True: `CodeStore`; fixed per class
    debug: bool  # poison freed blocks and new storage (NaN, or 0xFF codes); set by the pool
    specs: dict[int, LayerSpec]  # layer_idx -> shape, dtype, device of its K/V; set once per layer by `add_layer`

    @property
    def num_blocks(self) -> int:
        """Blocks allocated in every layer's tensors (changed by `grow` / `shrink` only)."""

    @property
    def segment_blocks(self) -> list[int]:
        """Blocks of each storage segment, in id order; sums to `num_blocks`."""

    # -- bytes ------------------------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all known layers (as stored: keys + values, or codes + scales)."""

    def block_bytes(self, spec: LayerSpec) -> int:
        """Bytes of one block of one layer with `spec`."""

    def bytes_in_use(self, num_used_blocks: int) -> int:
        """Bytes held for `num_used_blocks` blocks in use (a quantized store adds its stages)."""

    def bytes_reserved(self) -> int:
        """Bytes of every storage tensor this store owns (`tensors()`), in use or not."""

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor this store owns (for byte accounting checks)."""

    # -- a byte budget (`BlockPool(max_memory=...)`) ---------------------------------------------------------------
    def budget_block_bytes(self, spec: LayerSpec) -> int:
        """Bytes a byte budget counts per block of one layer (a quantized store adds the block's sink stage)."""

    def budget_split(self, max_memory: int, spec: LayerSpec, num_layers: int | None) -> tuple[int | None, int]:
        """``(stages, bytes left for blocks)`` of a budget of `max_memory` bytes: a quantized store keeps that many
        full-precision stages (`set_stage_capacity`) inside the budget; a full-precision one needs none (None)."""

    def set_stage_capacity(self, stages: int) -> None:
        """Hold at most `stages` full-precision stages (a quantized store with a byte budget)."""

    def stage_capacity(self) -> int | None:
        """The most full-precision stages this store holds, or None: no limit (or none needed)."""

    def stages_available(self) -> int | None:
        """Stages a step may still take (free, not yet allocated, or returned at the step's start); None: no limit."""

    def num_staged(self, blocks: list[int]) -> int:
        """How many of `blocks` hold a full-precision stage (0 for a full-precision store)."""

    # -- storage and block lifecycle --------------------------------------------------------------------------------
    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        """Storage for a new layer, with the same segments as the other layers."""

    def grow(self, num_blocks: int) -> None:
        """Extend every layer to `num_blocks` blocks by one new segment (all or nothing; no copy)."""

    def shrink(self, num_blocks: int) -> int:
        """Drop the trailing segments wholly at or past block `num_blocks` (all free); return the new `num_blocks`."""

    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0 (forgotten, poisoned in debug mode)."""

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` (fresh blocks) in every layer: copy-on-write, compaction."""

    def zero_blocks(self, blocks: list[int], layer_idx: int | None = None) -> None:
        """Make whole `blocks` hold zeros in every layer (or in layer `layer_idx` only): the pool's pad block."""

    def check_zero_blocks(self, blocks: list[int]) -> list[str]:
        """Problems (empty when fine) with `blocks` as the pad block: anything but zeros in some layer."""

    def poison_slots(self, slots: list[int]) -> None:
        """Debug mode: poison single slots (the tail of a cropped block)."""

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks, as (invariant number, text); empty when fine."""

    # -- whole blocks out and in (prefix-cache files, the host tier) ------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of whole blocks in every layer, as stored, in the order of `blocks`: tensors named
        ``"{layer}.{name}"`` with the blocks along dim 1 (new tensors, on the layer's device)."""

    def import_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Make `blocks` hold what `export_blocks` returned (from any device).

        Raises:
            ValueError: a tensor missing or not of the shape and dtype this store exports (nothing is written).
        """

    # -- write and read ---------------------------------------------------------------------------------------------
    def prepare_write(self, slots: torch.Tensor, device: torch.device, *, new_step: bool = True, start: int = 0,
                      num_new: int | None = None, positions: torch.Tensor | None = None) -> Any:
        """The write target of a step's tokens on `device`, for every layer: `slots` is the `[rows * num_new]`
        int64 slot mapping (row-major, CPU). A full-precision store returns the slots on `device`, a quantized one
        a `WritePlan`."""

    def write(self, layer_idx: int, target: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens, `[rows, num_kv_heads, num_new, head_dim]`, to `target` (`prepare_write`)."""

    def read(self, layer_idx: int, request: ReadRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``request.lo .. request.end - 1`` of every row: keys, values `[batch, num_kv_heads, n, head_dim]`
        in the model dtype."""


@runtime_checkable
class FullPrecisionStore(Store, Protocol):
    """A `Store` with ``is_quantized = False`` (`PageStore`), as an attention that reads blocks in place sees it."""

    keys: dict[int, SegmentedTensor]  # layer_idx -> [num_kv_heads, num_blocks * block_size, key_dim]
    values: dict[int, SegmentedTensor]  # layer_idx -> [num_kv_heads, num_blocks * block_size, value_dim]

    def read_view(self, layer_idx: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one row in consecutive slots ``start .. start + length - 1``, `[1, num_kv_heads, length, dim]`:
        views when they lie in one storage segment, else copies."""


@runtime_checkable
class CodeStore(Store, Protocol):
    """A `Store` with ``is_quantized = True`` (`QuantizedPageStore`), as an attention that reads codes in place sees
    it: the same tokens as `read`, as codes and scales."""

    @property
    def codecs(self) -> tuple:
        """The `(key codec, value codec)` pair the store encodes with (`storage/codecs`), fixed."""

    def read_codes(self, layer_idx: int, request: ReadRequest) -> CodeRead | None:
        """The encoded blocks of the range as gathered codes and scales, the rest in full precision (`CodeRead`)."""

    def code_table(self, layer_idx: int, request: ReadRequest) -> CodeTable | None:
        """The range where it lies, with each row's block ids (`CodeTable`)."""

    def code_layout(self, request: ReadRequest) -> CodeLayout | None:
        """The half of `code_table` that is the same for every layer of the store."""

    def layer_table(self, layer_idx: int, layout: CodeLayout,
                    new: tuple[int, torch.Tensor, torch.Tensor] | None) -> CodeTable:
        """Layer `layer_idx`'s `CodeTable` of a read whose `CodeLayout` is `layout`."""


__all__ = ["CodeStore", "FullPrecisionStore", "Store"]
