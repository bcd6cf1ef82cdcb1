"""`QuantizedPageStore`: the K/V of a quantized pool, as codes + scales per block plus a full-precision staging area."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs import BlockLayout, codec_name, make_codec
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_read import QuantizedReadMixin
from hf_pagedkv.storage.quantized_write import QuantizedWriteMixin, WritePlan
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor
from hf_pagedkv.storage.staging_store import StagingStore

_CODE_SENTINEL = 0xFF  # debug mode: freed code bytes (their scales become NaN, so a decode shows NaN)


class QuantizedPageStore(QuantizedWriteMixin, QuantizedReadMixin):
    """Preallocated quantized K/V storage for every layer of a pool (the `PageStore` of a `QuantConfig` pool).

    Layout, per layer, head-major so that a row whose blocks have consecutive ids reads its codes as a view::

        codes[layer]  = [key_codes, value_codes]:    [num_kv_heads, num_blocks, code_size]   uint8 (identity: dtype)
        scales[layer] = [key_scales, value_scales]:  [num_kv_heads, num_blocks, scale_size]  fp16

    each a `SegmentedTensor`: growth appends a segment of blocks (`segment_blocks`), copying nothing, and codes of
    consecutive blocks in one segment are read as views.

    where one block of one head is encoded by the layer's codec (`codecs/`, see `layouts`): keys per channel over the
    block's tokens, values per token in groups along head_dim (KIVI, arXiv 2402.02750). Blocks not encoded yet live in
    full precision in a `StagingStore`, sized by the number of sequences, not by the pool. Each block is in one state:

    - *fresh*: just allocated (or free), no stage, not encoded;
    - *open*: `_stage_of[b]` names its stage; the partial last block of a sequence, written token by token;
    - *encoded*: its codes hold it. A block is encoded once, by the `write` that fills its last slot, and then
      read by decoding; it is never de-quantized and re-quantized. A block encoded in the current step keeps its
      stage until the next step starts (`_pending`), because a mid-step `_unshare` may still need its first tokens.

    Sink: the first `quant.sink_tokens` tokens of each sequence (block 0 of its table, the same block for every
    sequence sharing it) are also written to a small full-precision `StagingStore` of `sink_tokens`-token stages
    (`_sink_of[b]`), and reads take them from there instead of the decoded codes. A block keeps its sink stage until
    it is released; copies (copy-on-write) copy it.

    Crop into an encoded block leaves it encoded and readable; the next write into it *reopens* it (decodes its kept
    tokens into a new stage) and it is encoded again when it refills. That is the one case where tokens are quantized
    twice (error up to twice the codec's bound). The store sees a crop only through that write, which starts inside
    the encoded block: a write that starts at offset 0 of an encoded block is a fault (it would re-encode the block
    without a crop). `_num_encodes` counts each block's encodes since it was last freed or (re)opened, so
    `check` can report a block encoded twice (invariant 4). Debug mode fills freed codes with 0xFF and their scales
    with NaN, and freed stages with NaN.
    """

    is_quantized = True

    def __init__(self, block_size: int, quant: QuantConfig, debug: bool = False) -> None:
        if quant.sink_tokens > block_size:
            raise ValueError(f"QuantConfig.sink_tokens={quant.sink_tokens} exceeds the block size {block_size}; "
                             "use at most one block of sink tokens (or a larger block_size).")
        self.block_size = block_size  # tokens per block; fixed
        self.quant = quant  # the storage format; fixed
        self.key_codec = make_codec(codec_name(quant.backend, quant.key_bits), "channel")  # fixed
        self.value_codec = make_codec(codec_name(quant.backend, quant.value_bits), "token", quant.value_group_size)
        for codec in self.codecs:  # fail here, not at the first forward pass
            if codec.bits in (4, 2) and block_size % (8 // codec.bits):
                raise ValueError(f"{codec.bits}-bit codes pack {8 // codec.bits} tokens per byte: block_size="
                                 f"{block_size} must be a multiple of {8 // codec.bits} (quantized pools default to "
                                 "32).")
        self.staging = StagingStore(block_size, debug)  # full-precision stages of open blocks
        self.sink_tokens = quant.sink_tokens  # tokens per sink stage; fixed
        self.sinks = StagingStore(max(1, self.sink_tokens), debug)  # full-precision sink tokens of first blocks
        self.num_blocks = 0  # blocks allocated in every layer's tensors; changed by `grow` / `shrink` only
        self.segment_blocks: list[int] = []  # blocks of each storage segment, in id order; sums to num_blocks
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.layouts: dict[int, tuple[BlockLayout, BlockLayout]] = {}  # layer_idx -> (key, value) block layouts
        self.codes: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_codes, value_codes]
        self.scales: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_scales, value_scales]
        self._stage_of: dict[int, int] = {}  # block -> its stage (open blocks, and pending ones)
        self._sink_of: dict[int, int] = {}  # first block of a sequence -> its sink stage
        self._encoded = bytearray()  # _encoded[b] == 1 iff block b's codes hold it
        self._pending: set[int] = set()  # blocks encoded in the current step that still hold a stage
        # _num_encodes[b]: steps that encoded block b since it was last freed or (re)opened (1 when encoded, else 0;
        # 2 or more breaks invariant 4). A step counts once: every layer encodes the block once in that step.
        self._num_encodes = bytearray()
        # blocks encoded by the current step: a second plan of the step (another device, or after `_unshare`)
        # encodes them for the remaining layers, not again
        self._encoded_in_step: set[int] = set()
        self._debug = debug

    @property
    def debug(self) -> bool:
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = self.staging.debug = self.sinks.debug = bool(value)

    @property
    def codecs(self) -> tuple:
        return self.key_codec, self.value_codec

    # -- storage ---------------------------------------------------------------------------------------------------
    def block_layouts(self, spec: LayerSpec) -> tuple[BlockLayout, BlockLayout]:
        """Key and value layout of one block of one head (raises `ValueError` for dims the codecs cannot pack)."""
        return (self.key_codec.layout(self.block_size, spec.key_dim, spec.dtype),
                self.value_codec.layout(self.block_size, spec.value_dim, spec.dtype))

    def block_bytes(self, spec: LayerSpec) -> int:
        """Bytes of one encoded block of one layer with this spec (codes + scales, keys + values)."""
        return spec.num_kv_heads * sum(layout.bytes for layout in self.block_layouts(spec))

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one encoded block across all known layers."""
        return sum(self.block_bytes(spec) for spec in self.specs.values())

    def bytes_in_use(self, num_used_blocks: int) -> int:
        """Bytes held for the blocks in use: their codes + scales, plus every full-precision stage handed out (the
        open, partial blocks, and a block encoded in the current step until the next step returns its stage) and
        every sink stage (the first tokens of each sequence)."""
        return num_used_blocks * self.bytes_per_block + self.staging.bytes_in_use() + self.sinks.bytes_in_use()

    def bytes_reserved(self) -> int:
        """Bytes of every storage tensor this store owns (`tensors()`): codes + scales of all blocks, plus the
        stages and sink stages allocated."""
        return self.num_blocks * self.bytes_per_block + self.staging.bytes_reserved() + self.sinks.bytes_reserved()

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor this store owns: codes, scales, stages and sink stages of every layer."""
        own = [seg for idx in self.specs for t in self.codes[idx] + self.scales[idx] for seg in t.segments]
        return own + self.staging.tensors() + self.sinks.tensors()

    def _append_segment(self, layer_idx: int, n: int) -> None:
        """A segment of `n` blocks at the end of one layer's codes and scales: zero, or poisoned in debug mode."""
        for layout, codes, scales in zip(self.layouts[layer_idx], self.codes[layer_idx], self.scales[layer_idx]):
            fill = (float("nan") if layout.code_dtype.is_floating_point else _CODE_SENTINEL) if self.debug else 0
            codes.append_segment(n, fill)
            scales.append_segment(n, float("nan") if self.debug else 0.0)

    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        """Storage for a new layer, with the same segments as the other layers."""
        assert layer_idx not in self.specs, f"layer {layer_idx} already has storage"
        layouts = self.block_layouts(spec)  # may raise ValueError before anything changes
        self.specs[layer_idx], self.layouts[layer_idx] = spec, layouts
        h, dev = spec.num_kv_heads, spec.device
        self.codes[layer_idx] = [SegmentedTensor(h, lay.code_size, lay.code_dtype, dev) for lay in layouts]
        self.scales[layer_idx] = [SegmentedTensor(h, lay.scale_size, lay.scale_dtype, dev) for lay in layouts]
        for n in self.segment_blocks:
            self._append_segment(layer_idx, n)
        self.staging.add_layer(layer_idx, spec)
        self.sinks.add_layer(layer_idx, spec)

    def grow(self, num_blocks: int) -> None:
        """Extend every layer to `num_blocks` blocks by one new segment; existing blocks are not touched (no copy)."""
        assert num_blocks >= self.num_blocks
        if num_blocks == self.num_blocks:
            return
        n = num_blocks - self.num_blocks
        for idx in self.specs:
            self._append_segment(idx, n)
        self.segment_blocks.append(n)
        self._encoded.extend(bytes(n))
        self._num_encodes.extend(bytes(n))
        self.num_blocks = num_blocks

    def shrink(self, num_blocks: int) -> int:
        """Drop the trailing segments that lie wholly at or past block `num_blocks` (the caller made sure those
        blocks are free, hence hold no stage); return the new `num_blocks`."""
        while self.segment_blocks and self.num_blocks - self.segment_blocks[-1] >= num_blocks:
            n = self.segment_blocks.pop()
            for idx in self.specs:
                for t in self.codes[idx] + self.scales[idx]:
                    t.pop_segment()
            self.num_blocks -= n
        assert not any(b >= self.num_blocks for b in (*self._stage_of, *self._sink_of)), "shrink of held blocks"
        del self._encoded[self.num_blocks:], self._num_encodes[self.num_blocks:]
        return self.num_blocks

    # -- block lifecycle -------------------------------------------------------------------------------------------
    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0: return their stages, forget their codes, poison them in debug mode."""
        for b in blocks:
            stage = self._stage_of.pop(b, None)
            if stage is not None:
                self.staging.free(stage)
            sink = self._sink_of.pop(b, None)
            if sink is not None:
                self.sinks.free(sink)
            self._encoded[b] = self._num_encodes[b] = 0
            self._pending.discard(b)
            self._encoded_in_step.discard(b)
        if self.debug and blocks:
            idx = torch.tensor(blocks, dtype=torch.long)
            for layer in self.specs:
                for t in self.codes[layer] + self.scales[layer]:
                    t.index_fill_(1, idx.to(t.device), float("nan") if t.dtype.is_floating_point else _CODE_SENTINEL)

    def poison_slots(self, slots: list[int]) -> None:
        """Debug mode: NaN-fill single staged slots (the tail of a cropped open block). Encoded blocks are poisoned
        past the kept tokens when they are reopened."""
        if not self.debug:
            return
        B = self.block_size
        for slot in slots:
            stage = self._stage_of.get(slot // B)
            if stage is not None:
                for store in (self.staging.keys, self.staging.values):
                    for t in store.values():
                        t[:, stage * B + slot % B] = float("nan")

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks `src[i]` -> `dst[i]` (fresh blocks) in every layer: codes, scales, state and stage."""
        if not src:
            return
        stages, sinks = [], []
        for s, d in zip(src, dst):
            self._encoded[d], self._num_encodes[d] = self._encoded[s], self._num_encodes[s]
            if s in self._encoded_in_step:  # a mid-step copy (`_unshare`): the step's re-plan encodes it, once
                self._encoded_in_step.add(d)
            if s in self._stage_of:
                self._stage_of[d] = self.staging.allocate()
                stages.append((self._stage_of[s], self._stage_of[d]))
            if s in self._sink_of:
                self._sink_of[d] = self.sinks.allocate()
                sinks.append((self._sink_of[s], self._sink_of[d]))
            if s in self._pending:
                self._pending.add(d)
        for idx in self.specs:
            for t in self.codes[idx] + self.scales[idx]:
                s_t, d_t = (torch.tensor(x, dtype=torch.long, device=t.device) for x in (src, dst))
                t.index_copy_(1, d_t, t.index_select(1, s_t))
            for area, pairs in ((self.staging, stages), (self.sinks, sinks)):
                for store in (area.keys, area.values):
                    for s, d in pairs:
                        area.block(store, idx, d).copy_(area.block(store, idx, s))

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks (in use or cached-idle), each as (invariant number, text):

        4. a full block is encoded once: no block was encoded twice since it was last freed or reopened by a crop,
           and a block is in the encoded state iff one encode is counted for it;
        6. every stage and sink stage is owned by exactly one live block, and no stage is lost.
        """
        problems = []
        twice = [b for b, n in enumerate(self._num_encodes) if n > 1][:10]
        if twice:
            counts = [self._num_encodes[b] for b in twice]
            problems.append((4, f"blocks {twice} encoded {counts} times since they were last opened"))
        odd = [b for b in range(self.num_blocks) if self._encoded[b] != min(1, self._num_encodes[b])][:10]
        if odd:
            states, counts = [self._encoded[b] for b in odd], [self._num_encodes[b] for b in odd]
            problems.append((4, f"blocks {odd} in state encoded={states} with {counts} encodes counted"))
        for name, owner, area in (("stage", self._stage_of, self.staging), ("sink stage", self._sink_of, self.sinks)):
            dead = sorted(b for b in owner if b not in live)
            if dead:
                problems.append((6, f"{name}s held by free blocks {dead[:10]}"))
            distinct = len(set(owner.values()))
            if distinct != len(owner) or len(owner) != area.num_used:
                problems.append((6, f"{len(owner)} blocks own {distinct} distinct {name}s, {area.num_used} in use"))
        return problems

    def _release_pending(self) -> None:
        for b in self._pending:
            stage = self._stage_of.pop(b, None)
            if stage is not None:
                self.staging.free(stage)
        self._pending.clear()

    def _reopen(self, opens: list[tuple[int, int, int]]) -> None:
        """Decode encoded blocks into their new stages, in every layer: `(block, stage, first new offset)`."""
        for idx in self.specs:
            for half, store in enumerate((self.staging.keys, self.staging.values)):
                for b, stage, first in opens:
                    out = self.staging.block(store, idx, stage).unsqueeze(1)  # [num_kv_heads, 1, block_size, dim]
                    self._decode_blocks(idx, half, torch.tensor([b]), out)
                    if self.debug:
                        out[:, :, first:] = float("nan")


__all__ = ["QuantizedPageStore", "WritePlan"]
