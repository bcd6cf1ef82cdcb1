"""`BlockStorage`: the block-addressed tensors of a page store: segments, growth, copies, exports, poison."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_pagedkv.storage.segmented_tensor import SegmentedTensor

Fill = float | int | None  # what storage is filled with (None: left uninitialized)


@dataclass(frozen=True)
class BlockTensor:
    """One storage tensor of one layer, as `BlockStorage` sees it.

    The tensor is `[d0, num_blocks * entries_per_block, d2]`; one block of one `d0` index (a head) has the shape
    `block_shape`, whose last dim is `d2` and whose other dims are flattened into the block's entries: a
    full-precision store's keys are `(block_size, head_dim)` (one entry, a slot, per token), a quantized store's codes
    `(code_size,)` (one entry per block).
    """

    name: str  # the tensor's name within its layer in `export_blocks` ("keys", "key_codes", ...)
    tensor: SegmentedTensor  # [d0, num_blocks * entries_per_block, d2]
    block_shape: tuple[int, ...]  # one block of one head: (entries_per_block, d2), or (d2,) for one entry per block
    fill: Fill  # what new storage holds outside debug mode
    poison: Fill  # debug mode: what new storage and freed blocks hold (None: not poisoned; `fill` is used)

    @property
    def entries_per_block(self) -> int:
        return math.prod(self.block_shape[:-1])

    def new_fill(self, debug: bool) -> Fill:
        """What a new segment is filled with."""
        return self.poison if debug and self.poison is not None else self.fill


class BlockStorage:
    """The tensors of every layer of a store, addressed by block id: one implementation of segmented growth,
    shrinking, block copies, block export/import and debug poisoning for `PageStore` and `QuantizedPageStore`.

    Each layer holds some `BlockTensor`s (keys and values; or key/value codes and scales), all with the same segments
    along dim 1: segment `i` holds blocks ``sum(segment_blocks[:i]) .. sum(segment_blocks[:i + 1]) - 1``. Growing
    appends one segment to every tensor, copying nothing (a growing pool never holds its old and a new full-size
    tensor at once); shrinking drops trailing segments whole. New storage holds each tensor's `fill`, or its `poison`
    in debug mode.

    Invariant: every tensor of every layer has the segments `segment_blocks` (``num_blocks`` blocks in all): a growth
    adds a segment to every one of them or, an allocation failing, to none.
    """

    def __init__(self, debug: bool = False) -> None:
        self.debug = debug  # poison new storage and freed blocks; set by the owning store
        self.num_blocks = 0  # blocks allocated in every tensor; changed by `grow` / `shrink` only
        self.segment_blocks: list[int] = []  # blocks of each storage segment, in id order; sums to num_blocks
        self.layers: dict[int, tuple[BlockTensor, ...]] = {}  # layer_idx -> its tensors; set once by `add_layer`

    def tensors(self) -> list[torch.Tensor]:
        """Every segment of every tensor, layer by layer (for byte accounting checks)."""
        return [seg for bts in self.layers.values() for bt in bts for seg in bt.tensor.segments]

    # -- segments ---------------------------------------------------------------------------------------------------
    def _append_segment(self, bt: BlockTensor, n: int) -> None:
        bt.tensor.append_segment(n * bt.entries_per_block, bt.new_fill(self.debug))

    def add_layer(self, layer_idx: int, tensors: tuple[BlockTensor, ...]) -> None:
        """Storage for a new layer: `tensors` (empty `SegmentedTensor`s) get the segments of the other layers."""
        assert layer_idx not in self.layers, f"layer {layer_idx} already has storage"
        self.layers[layer_idx] = tensors
        for n in self.segment_blocks:
            for bt in tensors:
                self._append_segment(bt, n)

    def grow(self, num_blocks: int) -> None:
        """Extend every tensor to `num_blocks` blocks by one new segment; existing blocks are not touched (no copy).
        All or nothing: when an allocation fails, the segments added to the other tensors are dropped again."""
        assert num_blocks >= self.num_blocks
        if num_blocks == self.num_blocks:
            return
        n = num_blocks - self.num_blocks
        grown: list[SegmentedTensor] = []
        try:
            for bts in self.layers.values():
                for bt in bts:
                    self._append_segment(bt, n)
                    grown.append(bt.tensor)
        except BaseException:
            for t in grown:
                t.pop_segment()
            raise
        self.segment_blocks.append(n)
        self.num_blocks = num_blocks

    def shrink(self, num_blocks: int) -> int:
        """Drop the trailing segments that lie wholly at or past block `num_blocks` (the caller made sure no block
        there is held); return the new `num_blocks` (at least `num_blocks`: a segment is dropped whole or kept)."""
        while self.segment_blocks and self.num_blocks - self.segment_blocks[-1] >= num_blocks:
            n = self.segment_blocks.pop()
            for bts in self.layers.values():
                for bt in bts:
                    bt.tensor.pop_segment()
            self.num_blocks -= n
        return self.num_blocks

    # -- blocks -----------------------------------------------------------------------------------------------------
    @staticmethod
    def entries(blocks: list[int], per_block: int, device: torch.device) -> torch.Tensor:
        """The dim-1 entries of `blocks`, block by block: `[len(blocks) * per_block]` int64 on `device`."""
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        if per_block == 1:
            return b
        offsets = torch.arange(per_block, device=device)
        return (b[:, None] * per_block + offsets).reshape(-1)  # [len(blocks) * per_block]

    def _each(self, blocks: list[int], layers=None):
        """Yield `(layer_idx, BlockTensor, entries of blocks)` for every tensor of `layers` (default: all)."""
        for idx in self.layers if layers is None else layers:
            index: dict[tuple[int, torch.device], torch.Tensor] = {}  # (entries per block, device) -> entries
            for bt in self.layers[idx]:
                key = (bt.entries_per_block, bt.tensor.device)
                if key not in index:
                    index[key] = self.entries(blocks, *key)
                yield idx, bt, index[key]

    def fill_blocks(self, blocks: list[int], value: float | int, layer_idx: int | None = None) -> None:
        """Fill whole `blocks` with `value` in every tensor of every layer (or of layer `layer_idx` only)."""
        for _, bt, e in self._each(blocks, None if layer_idx is None else [layer_idx]):
            bt.tensor.index_fill_(1, e, value)

    def poison(self, blocks: list[int]) -> None:
        """Debug mode: fill `blocks` with each tensor's `poison`, so that a stale read cannot pass unnoticed."""
        if not self.debug or not blocks:
            return
        for _, bt, e in self._each(blocks):
            if bt.poison is not None:
                bt.tensor.index_fill_(1, e, bt.poison)

    def written_layers(self, blocks: list[int]) -> list[int]:
        """The layers in which `blocks` hold anything but zeros."""
        bad: list[int] = []
        for idx, bt, e in self._each(blocks):
            if idx not in bad and bool(bt.tensor.index_select(1, e).ne(0).any()):
                bad.append(idx)
        return bad

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every tensor of every layer."""
        if not src:
            return
        for (_, bt, s), (_, _, d) in zip(self._each(src), self._each(dst)):
            bt.tensor.index_copy_(1, d, bt.tensor.index_select(1, s))

    # -- whole blocks out and in ------------------------------------------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of whole blocks in every tensor, in the order of `blocks`: ``"{layer}.{name}"`` ->
        `[d0, len(blocks), *block_shape]`, on the tensor's device (new tensors: later writes do not change them)."""
        out = {}
        for idx, bt, e in self._each(blocks):
            t = bt.tensor.index_select(1, e)  # [d0, n * entries_per_block, d2]
            out[f"{idx}.{bt.name}"] = t.view(t.shape[0], len(blocks), *bt.block_shape)  # [d0, n, *block_shape]
        return out

    def export_shapes(self, num_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The (shape, dtype) of each tensor `export_blocks` returns for `num_blocks` blocks, in its order."""
        return {f"{idx}.{bt.name}": ((bt.tensor.d0, num_blocks, *bt.block_shape), bt.tensor.dtype)
                for idx, bts in self.layers.items() for bt in bts}

    def write_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite whole `blocks` with an export (from any device) already checked against `export_shapes`."""
        for idx, bt, e in self._each(blocks):
            t = tensors[f"{idx}.{bt.name}"].to(bt.tensor.device)  # [d0, n, *block_shape]
            src = t.reshape(t.shape[0], e.shape[0], t.shape[-1])  # [d0, n * entries_per_block, d2]
            bt.tensor.index_copy_(1, e, src)

    def import_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite whole `blocks` with what `export_blocks` returned (from any device).

        Raises:
            ValueError: a tensor missing, or not of the shape and dtype `export_blocks` gives (nothing is written
                then).
        """
        check_block_tensors(self.export_shapes(len(blocks)), tensors)
        self.write_blocks(blocks, tensors)


def check_block_tensors(want: dict[str, tuple[tuple[int, ...], torch.dtype]],
                        tensors: dict[str, torch.Tensor]) -> None:
    """Raise `ValueError` unless `tensors` holds every name of `want` with its (shape, dtype)."""
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"import_blocks: no tensor {name!r} (a block export of another storage format?).")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"import_blocks: {name!r} is {t.dtype} {tuple(t.shape)}, this store needs {dtype} "
                             f"{shape}.")
