"""`PageStore`: the K/V tensors of a pool, one pair per layer, addressed by slot. No refcounting here."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from hf_pagedkv.storage.block_storage import BlockStorage, BlockTensor
from hf_pagedkv.storage.read_request import ReadRequest
from hf_pagedkv.storage.row_gather import RowGather
from hf_pagedkv.storage.segment_split import SegmentSplit
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor


_MEMO_LIMIT = 4096  # memoized splits at most (entries of live index tensors; all dropped past it)


@dataclass(frozen=True)
class LayerSpec:
    """Shape, dtype and device of one layer's K/V, fixed by the first `update` of that layer."""

    num_kv_heads: int
    key_dim: int  # head_dim of the keys
    value_dim: int  # head_dim of the values (equal to key_dim for most models)
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer, keys plus values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.key_dim + self.value_dim) * itemsize

    @classmethod
    def of(cls, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerSpec:
        return cls(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.dtype,
                   key_states.device)


class PageStore:
    """Preallocated K/V storage for every layer of a pool.

    Layout, per layer (head-major, so that a row whose blocks have consecutive ids is already the
    `[num_kv_heads, seq_len, head_dim]` slice attention wants and is read as a view)::

        keys[layer]:   [num_kv_heads, num_blocks * block_size, key_dim]     (a `SegmentedTensor`)
        values[layer]: [num_kv_heads, num_blocks * block_size, value_dim]

    Slot `s` is token ``s % block_size`` of block ``s // block_size``; a block id names the same slot range
    in every layer. Storage grows by whole chunks of blocks (`grow`), never per token: each growth appends one
    *segment* of blocks to every layer (`segment_blocks`), copying nothing, so a growing pool never holds its old
    and a new full-size tensor at once; `shrink` drops trailing segments (both done by its `BlockStorage`,
    `storage`, which also copies, exports, imports and poisons whole blocks). A row whose consecutive blocks lie in
    one segment is read as a view; one that crosses a segment boundary is copied. In debug mode, freed blocks and
    new storage are filled with NaN (poisoned), so that a read of a slot no sequence owns shows up at once in the
    logits instead of as silent drift; outside debug mode new storage is left uninitialized (never read before
    written), so it costs no page until used.

    Invariant: every layer's keys and values have the segments `segment_blocks`, ``num_blocks`` blocks in all (a
    growth adds a segment to every one of them or, an allocation failing, to none).
    """

    is_quantized = False

    def __init__(self, block_size: int, debug: bool = False) -> None:
        self.block_size = block_size  # tokens per block; fixed
        self.storage = BlockStorage(debug)  # every layer's keys and values by block: segments, copies, exports
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.keys: dict[int, SegmentedTensor] = {}  # layer_idx -> [num_kv_heads, num_blocks * block_size, key_dim]
        self.values: dict[int, SegmentedTensor] = {}  # layer_idx -> [.., value_dim]
        # (id(index),) -> (weak ref to index, its SegmentSplit); (id(blocks), offset, length, d0) -> (weak ref to
        # blocks, its RowGather): the live steps' index tensors (one per cache of a packed step), split once for
        # every layer (all layers have the same segments; `_memo`). An entry goes when its index tensor does (so a
        # reused id never hits a stale entry), and all go on `grow` and `shrink`. Index tensors are never changed
        # in place.
        self._splits: dict[tuple[int, ...], tuple[weakref.ref, SegmentSplit | RowGather]] = {}

    @property
    def debug(self) -> bool:
        """Poison freed blocks and new storage with NaN; set by the pool."""
        return self.storage.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.storage.debug = value

    @property
    def num_blocks(self) -> int:
        """Blocks allocated in every layer's tensors (changed by `grow` / `shrink` only)."""
        return self.storage.num_blocks

    @property
    def segment_blocks(self) -> list[int]:
        """Blocks of each storage segment, in id order; sums to `num_blocks`."""
        return self.storage.segment_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all known layers, keys plus values."""
        return sum(spec.bytes_per_token for spec in self.specs.values()) * self.block_size

    def block_bytes(self, spec: LayerSpec) -> int:
        """Bytes of one block of one layer with this spec, keys plus values."""
        return spec.bytes_per_token * self.block_size

    # -- a byte budget: a full-precision store holds no stages -------------------------------------------------------
    def budget_block_bytes(self, spec: LayerSpec) -> int:
        """Bytes a byte budget counts per block of one layer: `block_bytes`."""
        return self.block_bytes(spec)

    def budget_split(self, max_memory: int, spec: LayerSpec, num_layers: int | None) -> tuple[int | None, int]:
        """No stages: the whole budget goes to blocks, ``(None, max_memory)``."""
        return None, max_memory

    def set_stage_capacity(self, stages: int) -> None:
        """A full-precision store holds no stages: nothing to limit."""

    def stage_capacity(self) -> int | None:
        return None

    def stages_available(self) -> int | None:
        return None

    def num_staged(self, blocks: list[int]) -> int:
        return 0

    def bytes_in_use(self, num_used_blocks: int) -> int:
        """Bytes of `num_used_blocks` blocks in every layer, keys plus values."""
        return num_used_blocks * self.bytes_per_block

    def bytes_reserved(self) -> int:
        """Bytes of every storage tensor this store owns (`tensors()`), in use or not."""
        return self.num_blocks * self.bytes_per_block

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor this store owns, segment by segment (for byte accounting checks)."""
        return self.storage.tensors()

    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0 (poisoned in debug mode)."""
        self.poison(blocks)

    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        """Storage for a new layer, with the same segments as the other layers. New storage is NaN in debug mode
        (float dtypes), else left uninitialized (never read before written)."""
        assert layer_idx not in self.specs, f"layer {layer_idx} already has storage"
        self.specs[layer_idx] = spec
        poison = float("nan") if spec.dtype.is_floating_point else None
        tensors = []
        for name, store, dim in (("keys", self.keys, spec.key_dim), ("values", self.values, spec.value_dim)):
            t = store[layer_idx] = SegmentedTensor(spec.num_kv_heads, dim, spec.dtype, spec.device)
            tensors.append(BlockTensor(name, t, (self.block_size, dim), None, poison))
        self.storage.add_layer(layer_idx, tuple(tensors))

    def _memo(self, key: tuple, source: torch.Tensor, build):
        """`build()` once per step for every layer: memoized under `key` while `source` (the step's index tensor
        the result is made from) is alive."""
        hit = self._splits.get(key)
        if hit is not None and hit[0]() is source:
            return hit[1]
        if len(self._splits) >= _MEMO_LIMIT:  # (only index tensors kept alive elsewhere count: a safety bound)
            self._splits.clear()
        value = build()
        splits = self._splits

        def forget(ref: weakref.ref) -> None:  # `source` died: drop its entry, unless a newer one took the key
            entry = splits.get(key)
            if entry is not None and entry[0] is ref:
                del splits[key]

        self._splits[key] = (weakref.ref(source, forget), value)
        return value

    def split(self, t: SegmentedTensor, index: torch.Tensor) -> SegmentSplit:
        """`t.split(index)`, computed once per step for all layers."""
        def build() -> SegmentSplit:
            split = t.split(index)
            if split.base_local is index:  # (an entry must not keep its own index alive: see `_splits`)
                split = dataclasses.replace(split, base_local=index.clone())
            return split

        return self._memo((id(index),), index, build)

    def token_gather(self, t: SegmentedTensor, blocks: torch.Tensor, offset: int, length: int) -> RowGather:
        """The `RowGather` of tokens ``offset .. offset + length - 1`` of the rows of `blocks` (`[batch, n]`, in
        token order), token by token, for every layer with `t`'s segments and heads: computed once per step."""
        def build() -> RowGather:
            B = self.block_size
            pos = torch.arange(offset, offset + length, device=blocks.device)  # [length] token within the blocks
            slots = blocks[:, pos // B] * B + pos % B  # [batch, length] slot of each token
            return t.row_gather(slots, 1)

        return self._memo((id(blocks), offset, length, t.d0), blocks, build)

    def grow(self, num_blocks: int) -> None:
        """Extend every layer to `num_blocks` blocks by one new segment; existing blocks are not touched (no copy).
        All or nothing: when an allocation fails, the segments added to the other layers are dropped again."""
        self._splits.clear()
        self.storage.grow(num_blocks)

    def shrink(self, num_blocks: int) -> int:
        """Drop the trailing segments that lie wholly at or past block `num_blocks` (the caller made sure no block
        there is held); return the new `num_blocks` (at least `num_blocks`: a segment is dropped whole or kept)."""
        self._splits.clear()
        return self.storage.shrink(num_blocks)

    # -- the store interface (shared with QuantizedPageStore) -------------------------------------------------------
    def prepare_write(self, slots: torch.Tensor, device: torch.device, *, new_step: bool = True, start: int = 0,
                      num_new: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The write target of a step's tokens for every layer on `device`: here the slot mapping itself.

        Args:
            slots (`torch.LongTensor` of shape `[rows * num_new_tokens]`, CPU): the slot mapping, row-major (or of
                the `[n]` tokens given to `write`, when a step stores only some of its tokens).
            device (`torch.device`): the layers' device.
            new_step, start, num_new, positions: what the quantized store needs (its block states); unused here.
        """
        return slots.to(device)

    def write(self, layer_idx: int, target: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write new tokens into their slots.

        Args:
            target (`torch.LongTensor` of shape `[rows * num_new_tokens]`): from `prepare_write`.
            key_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, key_dim]`).
            value_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, value_dim]`).
        """
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            heads, dim = new.shape[1], new.shape[-1]
            src = new.transpose(0, 1).reshape(heads, -1, dim)  # [num_kv_heads, rows * num_new_tokens, dim]
            t = store[layer_idx]
            t.index_copy_(1, target, src, split=self.split(t, target))

    def read(self, layer_idx: int, request: ReadRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``request.lo .. request.end - 1`` of every row: views when the single row's blocks are
        consecutive (`request.first_block`) or several rows' blocks are consecutive and evenly spaced in one storage
        segment (`request.rows`), a gather otherwise.

        Returns:
            keys, values of shape `[batch, num_kv_heads, end - lo, head_dim]`.
        """
        if request.first_block is not None:
            return self.read_view(layer_idx, request.first_block * self.block_size + request.lo,
                                  request.end - request.lo)
        if request.rows is not None:
            first, stride = request.rows
            batch = request.table.shape[0]
            args = (batch, first * self.block_size + request.lo, request.end - request.lo, stride * self.block_size)
            k = self.keys[layer_idx].strided_rows(*args)
            if k is not None:
                return k, self.values[layer_idx].strided_rows(*args)
        return self.read_blocks(layer_idx, request.blocks(self.keys[layer_idx].device),
                                request.lo % self.block_size, request.end - request.lo)

    def read_view(self, layer_idx: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one row stored in consecutive slots ``start .. start + length - 1``: views (no copy) when they lie
        in one storage segment, else a copy.

        Returns:
            keys, values of shape `[1, num_kv_heads, length, head_dim]`.
        """
        k = self.keys[layer_idx].narrow(1, start, length)  # [num_kv_heads, length, key_dim]
        v = self.values[layer_idx].narrow(1, start, length)  # [num_kv_heads, length, value_dim]
        return k.unsqueeze(0), v.unsqueeze(0)

    def read_gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of several rows, gathered into new tensors: one `index_select` per tensor for the whole batch.

        Args:
            slots (`torch.LongTensor` of shape `[batch, seq_len]`): slot of each token of each row.

        Returns:
            keys, values of shape `[batch, num_kv_heads, seq_len, head_dim]`: each row and head a contiguous
            `[seq_len, head_dim]` matrix, the batch and head strides swapped (a transposed view of the
            `[num_kv_heads, batch, seq_len, head_dim]` gather), which attention reads as it is.
        """
        batch, seq_len = slots.shape
        flat = slots.reshape(-1)
        out = []
        for store in (self.keys, self.values):
            t = store[layer_idx]  # [num_kv_heads, slots, dim]
            g = t.index_select(1, flat).view(t.shape[0], batch, seq_len, t.shape[-1])
            out.append(g.transpose(0, 1))  # [batch, num_kv_heads, seq_len, dim]
        return out[0], out[1]

    def read_blocks(self, layer_idx: int, blocks: torch.Tensor, offset: int,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of several rows, gathered into the contiguous `[batch, num_kv_heads, length, head_dim]` tensors
        `DynamicCache`'s `torch.cat` returns: one `index_select` of `head_dim`-element rows per tensor for the whole
        batch (exactly the tokens read, no slot past a row's last token), with row indices (`token_gather`)
        computed once per step for every layer.

        Args:
            blocks (`torch.LongTensor` of shape `[batch, n]`): each row's blocks, in token order.
            offset (`int`): the row's first token within its first block; `length`: tokens per row
                (``offset + length <= n * block_size``).

        Returns:
            keys, values of shape `[batch, num_kv_heads, length, head_dim]`, contiguous (new tensors).
        """
        out = []
        for store in (self.keys, self.values):
            t = store[layer_idx]  # [num_kv_heads, slots, dim]
            out.append(t.gather_rows(self.token_gather(t, blocks, offset, length)))  # [batch, heads, length, dim]
        return out[0], out[1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer (copy-on-write)."""
        self.storage.copy_blocks(src, dst)

    def poison(self, blocks: list[int]) -> None:
        """Fill `blocks` with NaN in every layer (debug mode), so a stale read cannot pass unnoticed."""
        self.storage.poison(blocks)

    def zero_blocks(self, blocks: list[int], layer_idx: int | None = None) -> None:
        """Fill whole `blocks` with zeros in every layer (or in layer `layer_idx` only): the pool's pad block, which
        reads as finite keys and values that attention masks."""
        self.storage.fill_blocks(blocks, 0, layer_idx)

    def check_zero_blocks(self, blocks: list[int]) -> list[str]:
        """Problems (empty when fine): `blocks` (the pad block) hold anything but zeros in some layer."""
        bad = self.storage.written_layers(blocks)
        return [f"blocks {blocks} were written in layers {bad[:10]}"] if bad else []

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks, as (invariant number, text): none, a full-precision block has no state
        beyond its refcount (the pool's)."""
        return []

    def poison_slots(self, slots: list[int]) -> None:
        """Fill single slots with NaN in every layer (debug mode; used for the tail of a cropped block)."""
        if not self.debug or not slots:
            return
        for idx, spec in self.specs.items():
            if spec.dtype.is_floating_point:
                s = torch.tensor(slots, dtype=torch.long, device=spec.device)
                self.keys[idx].index_fill_(1, s, float("nan"))
                self.values[idx].index_fill_(1, s, float("nan"))

    def block_slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        """All slots of `blocks`, block by block: `[len(blocks) * block_size]` int64."""
        return BlockStorage.entries(blocks, self.block_size, device)

    # -- whole blocks out and in (prefix-cache files, the host tier) --------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of whole blocks in every layer, in the order of `blocks`.

        Returns:
            `dict[str, torch.Tensor]`: ``"{layer}.keys"`` `[num_kv_heads, len(blocks), block_size, key_dim]` and
            ``"{layer}.values"`` `[num_kv_heads, len(blocks), block_size, value_dim]`, model dtype, on the layer's
            device (new tensors: later writes to the pool do not change them).
        """
        return self.storage.export_blocks(blocks)

    def import_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite whole blocks in every layer with what `export_blocks` returned (from any device).

        Raises:
            ValueError: a layer's tensor missing, or not of the shape and dtype `export_blocks` gives for this store
                (nothing is written then).
        """
        self.storage.import_blocks(blocks, tensors)
