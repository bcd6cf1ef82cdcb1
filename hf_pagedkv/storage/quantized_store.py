"""`QuantizedPageStore`: the K/V of a quantized pool, as codes + scales per block plus a full-precision staging area."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.codecs import BlockLayout, codec_name, make_codec
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_read import QuantizedReadMixin
from hf_pagedkv.storage.quantized_write import QuantizedWriteMixin, WritePlan
from hf_pagedkv.storage.staging_store import StagingStore

_CODE_SENTINEL = 0xFF  # debug mode: freed code bytes (their scales become NaN, so a decode shows NaN)


class QuantizedPageStore(QuantizedWriteMixin, QuantizedReadMixin):
    """Preallocated quantized K/V storage for every layer of a pool (the `PageStore` of a `QuantConfig` pool).

    Layout, per layer, head-major so that a row whose blocks have consecutive ids reads its codes as a view::

        codes[layer]  = [key_codes, value_codes]:    [num_kv_heads, num_blocks, code_size]   uint8 (identity: dtype)
        scales[layer] = [key_scales, value_scales]:  [num_kv_heads, num_blocks, scale_size]  fp16

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
        self.num_blocks = 0  # blocks allocated in every layer's tensors; changed by `grow` only
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.layouts: dict[int, tuple[BlockLayout, BlockLayout]] = {}  # layer_idx -> (key, value) block layouts
        self.codes: dict[int, list[torch.Tensor]] = {}  # layer_idx -> [key_codes, value_codes]
        self.scales: dict[int, list[torch.Tensor]] = {}  # layer_idx -> [key_scales, value_scales]
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
        """Codes + scales of the blocks in use, plus the full-precision stages of open (partial) blocks and sinks."""
        num_open = sum(1 for b in self._stage_of if not self._encoded[b])
        return (num_used_blocks * self.bytes_per_block + num_open * self.staging.bytes_per_stage()
                + len(self._sink_of) * self.sinks.bytes_per_stage())

    def bytes_reserved(self) -> int:
        return (self.num_blocks * self.bytes_per_block + self.staging.num_stages * self.staging.bytes_per_stage()
                + self.sinks.num_stages * self.sinks.bytes_per_stage())

    @torch.inference_mode(False)  # never inference tensors: they outlive the call (see PageStore._new)
    def _new(self, layer_idx: int, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        spec, codes, scales = self.specs[layer_idx], [], []
        for layout in self.layouts[layer_idx]:
            fill = (float("nan") if layout.code_dtype.is_floating_point else _CODE_SENTINEL) if self.debug else 0
            codes.append(torch.full((spec.num_kv_heads, num_blocks, layout.code_size), fill, dtype=layout.code_dtype,
                                    device=spec.device))
            scales.append(torch.full((spec.num_kv_heads, num_blocks, layout.scale_size),
                                     float("nan") if self.debug else 0.0, dtype=layout.scale_dtype, device=spec.device))
        return codes, scales

    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        assert layer_idx not in self.specs, f"layer {layer_idx} already has storage"
        layouts = self.block_layouts(spec)  # may raise ValueError before anything changes
        self.specs[layer_idx], self.layouts[layer_idx] = spec, layouts
        self.codes[layer_idx], self.scales[layer_idx] = self._new(layer_idx, self.num_blocks)
        self.staging.add_layer(layer_idx, spec)
        self.sinks.add_layer(layer_idx, spec)

    def grow(self, num_blocks: int) -> None:
        """Resize every layer to `num_blocks` blocks, keeping the content of the existing ones."""
        assert num_blocks >= self.num_blocks
        for idx in self.specs:
            codes, scales = self._new(idx, num_blocks)
            for new, old in zip(codes + scales, self.codes[idx] + self.scales[idx]):
                new[:, : old.shape[1]] = old
            self.codes[idx], self.scales[idx] = codes, scales
        self._encoded.extend(bytes(num_blocks - self.num_blocks))
        self._num_encodes.extend(bytes(num_blocks - self.num_blocks))
        self.num_blocks = num_blocks

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
