"""`QuantizedPageStore`: the K/V of a quantized pool, as codes + scales per block plus a full-precision staging area."""

from __future__ import annotations

import math

import torch

from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.code_layout import CodeLayout
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.codecs import BlockLayout, check_finite, codecs_for
from hf_pagedkv.storage.page_store import LayerSpec, check_block_tensors
from hf_pagedkv.storage.quantized_block_states import QuantizedBlockStates
from hf_pagedkv.storage.read_request import ReadRequest
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor
from hf_pagedkv.storage.staging_store import StagingStore
from hf_pagedkv.storage.write_plan import WritePlan

_CODE_SENTINEL = 0xFF  # debug mode: freed code bytes (their scales become NaN, so a decode shows NaN)


class QuantizedPageStore:
    """Preallocated quantized K/V storage for every layer of a pool (the `PageStore` of a `QuantConfig` pool).

    Layout, per layer, head-major so that a row whose blocks have consecutive ids reads its codes as a view::

        codes[layer]  = [key_codes, value_codes]:    [num_kv_heads, num_blocks, code_size]   uint8 (identity: dtype)
        scales[layer] = [key_scales, value_scales]:  [num_kv_heads, num_blocks, scale_size]  fp16

    each a `SegmentedTensor`: growth appends a segment of blocks (`segment_blocks`), copying nothing, and codes of
    consecutive blocks in one segment are read as views.

    where one block of one head is encoded by the layer's codec (`codecs/`, see `layouts`): keys per channel over the
    block's tokens, values per token in groups along head_dim (KIVI, arXiv 2402.02750). Blocks not encoded yet live in
    full precision in a `StagingStore`, sized by the number of sequences, not by the pool. `states`
    (`QuantizedBlockStates`) says which blocks are fresh, open (staged) or encoded; a block is encoded once, by the
    `write` that fills its last slot, and then read by decoding; it is never de-quantized and re-quantized.

    Sink: the first `quant.sink_tokens` tokens of each sequence (block 0 of its table, the same block for every
    sequence sharing it) are also written to a small full-precision `StagingStore` of `sink_tokens`-token stages
    (`states.sink_of[b]`), and reads take them from there instead of the decoded codes. A block keeps its sink stage until
    it is released; copies (copy-on-write) copy it.

    Crop into an encoded block leaves it encoded and readable; the next write into it *reopens* it (decodes its kept
    tokens into a new stage) and it is encoded again when it refills. That is the one case where tokens are quantized
    twice (error up to twice the codec's bound). The store sees a crop only through that write, which starts inside
    the encoded block: a write that starts at offset 0 of an encoded block is a fault (it would re-encode the block
    without a crop). `states.num_encodes` counts each block's encodes since it was last freed or (re)opened, so
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
        self.key_codec, self.value_codec = codecs_for(quant)  # keys per channel, values per token; fixed
        for codec in self.codecs:  # fail here, not at the first forward pass
            codec.check_block_size(block_size)
        self.staging = StagingStore(block_size, debug)  # full-precision stages of open blocks
        self.sink_tokens = quant.sink_tokens  # tokens per sink stage; fixed
        self.sinks = StagingStore(max(1, self.sink_tokens), debug)  # full-precision sink tokens of first blocks
        self.states = QuantizedBlockStates(block_size, self.sink_tokens, self.staging, self.sinks)  # block states
        self.num_blocks = 0  # blocks allocated in every layer's tensors; changed by `grow` / `shrink` only
        self.segment_blocks: list[int] = []  # blocks of each storage segment, in id order; sums to num_blocks
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.layouts: dict[int, tuple[BlockLayout, BlockLayout]] = {}  # layer_idx -> (key, value) block layouts
        self.codes: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_codes, value_codes]
        self.scales: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_scales, value_scales]
        # accelerators: per-layer finiteness flags of this step's quantized halves, checked at the next step's start
        # (reading a flag on the host would wait for the device at every layer)
        self._finite_flags: list[tuple[int, int, torch.Tensor]] = []
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

    def _append_segment(self, layer_idx: int, n: int, grown: list[SegmentedTensor] | None = None) -> None:
        """A segment of `n` blocks at the end of one layer's codes and scales: zero, or poisoned in debug mode.
        Each tensor given a segment is added to `grown` (for an undo)."""
        for layout, codes, scales in zip(self.layouts[layer_idx], self.codes[layer_idx], self.scales[layer_idx]):
            fill = (float("nan") if layout.code_dtype.is_floating_point else _CODE_SENTINEL) if self.debug else 0
            codes.append_segment(n, fill)
            if grown is not None:
                grown.append(codes)
            scales.append_segment(n, float("nan") if self.debug else 0.0)
            if grown is not None:
                grown.append(scales)

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
        grown: list[SegmentedTensor] = []  # all or nothing: a failed allocation drops the segments added so far
        try:
            for idx in self.specs:
                self._append_segment(idx, n, grown)
        except BaseException:
            for t in grown:
                t.pop_segment()
            raise
        self.segment_blocks.append(n)
        self.states.grow(num_blocks)
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
        self.states.shrink(self.num_blocks)
        return self.num_blocks

    # -- block lifecycle -------------------------------------------------------------------------------------------
    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0: return their stages, forget their codes, poison them in debug mode."""
        self.states.release(blocks)
        if self.debug and blocks:
            idx = torch.tensor(blocks, dtype=torch.long)
            for layer in self.specs:
                for t in self.codes[layer] + self.scales[layer]:
                    t.index_fill_(1, idx.to(t.device), float("nan") if t.dtype.is_floating_point else _CODE_SENTINEL)

    def zero_blocks(self, blocks: list[int], layer_idx: int | None = None) -> None:
        """Make whole `blocks` hold zeros in every layer (or in layer `layer_idx` only): the pool's pad block. Zero
        codes and zero scales decode to zeros with every codec; the blocks count as encoded (once), hold no stage
        and no sink stage, so a read decodes them even as a last block (after a crop into padding)."""
        idx = torch.tensor(blocks, dtype=torch.long)
        for layer in self.specs if layer_idx is None else [layer_idx]:
            for t in self.codes[layer] + self.scales[layer]:
                t.index_fill_(1, idx.to(t.device), 0)
        if layer_idx is None:
            self.states.mark_encoded(blocks)

    def check_zero_blocks(self, blocks: list[int]) -> list[str]:
        """Problems (empty when fine): `blocks` (the pad block) not all-zero codes and scales in some layer, not
        encoded, or holding a stage or sink stage."""
        idx = torch.tensor(blocks, dtype=torch.long)
        bad = [layer for layer in self.specs
               if any(bool(t.index_select(1, idx.to(t.device)).ne(0).any())
                      for t in self.codes[layer] + self.scales[layer])]
        problems = [f"blocks {blocks} were written in layers {bad[:10]}"] if bad else []
        odd = [b for b in blocks if not self.states.encoded[b] or b in self.states.stage_of
               or b in self.states.sink_of]
        if odd:
            problems.append(f"blocks {odd} were opened (staged, or given a sink stage)")
        return problems

    def poison_slots(self, slots: list[int]) -> None:
        """Debug mode: NaN-fill single staged slots (the tail of a cropped open block). Encoded blocks are poisoned
        past the kept tokens when they are reopened."""
        if not self.debug:
            return
        B = self.block_size
        for slot in slots:
            stage = self.states.stage_of.get(slot // B)
            if stage is not None:
                for store in (self.staging.keys, self.staging.values):
                    for t in store.values():
                        t[:, stage * B + slot % B] = float("nan")

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks `src[i]` -> `dst[i]` (fresh blocks) in every layer: codes, scales, state and stage."""
        if not src:
            return
        stages, sinks = self.states.copy(src, dst)
        for idx in self.specs:
            for t in self.codes[idx] + self.scales[idx]:
                s_t, d_t = (torch.tensor(x, dtype=torch.long, device=t.device) for x in (src, dst))
                t.index_copy_(1, d_t, t.index_select(1, s_t))
            for area, pairs in ((self.staging, stages), (self.sinks, sinks)):
                for store in (area.keys, area.values):
                    for s, d in pairs:
                        area.block(store, idx, d).copy_(area.block(store, idx, s))

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks, each as (invariant number, text): see `QuantizedBlockStates.check`."""
        return self.states.check(live)

    def _reopen(self, opens: list[tuple[int, int, int]]) -> None:
        """Decode encoded blocks into their new stages, in every layer: `(block, stage, first new offset)`."""
        for idx in self.specs:
            for half, store in enumerate((self.staging.keys, self.staging.values)):
                for b, stage, first in opens:
                    out = self.staging.block(store, idx, stage).unsqueeze(1)  # [num_kv_heads, 1, block_size, dim]
                    self._decode_blocks(idx, half, torch.tensor([b]), out)
                    if self.debug:
                        out[:, :, first:] = float("nan")

    # -- the store interface (shared with PageStore) ------------------------------------------------------------
    def prepare_write(self, slots: torch.Tensor, device: torch.device, *, new_step: bool = True, start: int = 0,
                      num_new: int | None = None, positions: torch.Tensor | None = None) -> WritePlan:
        """The `WritePlan` of a step's tokens for every layer on `device`: which tokens go to stages and which
        blocks they complete (encoded by `write`, once). Updates the block states once per step (call again with
        ``new_step=False`` for another device or after the step's rows changed). The arguments are those of
        `QuantizedBlockStates.plan` (`slots`: the `[rows * num_new_tokens]` slot mapping, row-major, on the CPU);
        encoded blocks a crop cut into are decoded into their new stages here.

        Raises:
            ValueError: (accelerators, at a new step) the previous step wrote NaN or inf K/V into a quantized half;
                the blocks it encoded hold NaN scales, so release the cache.
        """
        if new_step and self._finite_flags:
            flags, self._finite_flags = self._finite_flags, []
            finite = torch.stack([f.to(flags[0][2].device) for _, _, f in flags]).tolist()  # one wait per step
            bad = [(layer, half) for (layer, half, _), ok in zip(flags, finite) if not ok]
            if bad:
                layer, half = bad[0]
                raise ValueError(f"Cannot quantize {('key', 'value')[half]}_states of layer {layer}: the previous "
                                 "step wrote NaN or inf into a quantized pool (its encoded blocks hold NaN). Quantized "
                                 "KV storage needs finite keys/values (check the model's dtype for overflow, or use "
                                 "quant=None); release this cache.")
        plan, opens = self.states.plan(slots, device, new_step=new_step, start=start, num_new=num_new,
                                       positions=positions, num_layers=len(self.specs))
        if opens:
            self._reopen(opens)
        return plan

    def write(self, layer_idx: int, plan: WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens as `plan` says: encode the blocks they complete, stage the rest.

        Args:
            plan (`WritePlan`): from `prepare_write` for this step and device.
            key_states, value_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, head_dim]`).

        Raises:
            ValueError: NaN or inf in a quantized half, on the CPU (nothing of this layer was written). On an
                accelerator the check is deferred to the next step's `prepare_write`, so that no layer waits for
                the device.
        """
        B = self.block_size
        flats = []
        for half, new in enumerate((key_states, value_states)):
            flat = new.transpose(0, 1).reshape(new.shape[1], -1, new.shape[-1])  # [num_kv_heads, rows * q, dim]
            if self.codecs[half].bits is not None:
                # NOTE: a sum is NaN/inf iff an element is (barring overflow, then the exact check decides): one op
                total = flat.sum()
                if not flat.is_cpu:
                    self._finite_flags.append((layer_idx, half, torch.isfinite(total)))
                elif not math.isfinite(float(total)):
                    check_finite(flat, f"{('key', 'value')[half]}_states of layer {layer_idx}")
            flats.append(flat)
        # (`shape[0]`, not `len()`: a tensor's `__len__` is a Python call; this runs per layer and step)
        c, staged, sunk = plan.done_blocks.shape[0], plan.stage_dst.shape[0], plan.sink_dst.shape[0]
        for half, (flat, store) in enumerate(zip(flats, (self.staging.keys, self.staging.values))):
            heads, dim = flat.shape[0], flat.shape[-1]
            if c:
                if plan.done_src is None:  # the new tokens are exactly the completed blocks, in order (a prefill)
                    buf = flat.view(heads, c, B, dim)
                else:
                    buf = flat.new_empty((heads, c, B, dim))  # [num_kv_heads, c, block_size, dim]
                    if len(plan.prefix_rank):  # earlier tokens from the blocks' stages
                        stages = self.staging.blocks(store, layer_idx).index_select(1, plan.prefix_stage)
                        buf.index_copy_(1, plan.prefix_rank, stages)
                    if len(plan.recode_rank):  # earlier tokens of a block reopened by a crop, from its codes
                        tmp = flat.new_empty((heads, len(plan.recode_rank), B, dim))
                        buf.index_copy_(1, plan.recode_rank, self._decode_blocks(layer_idx, half, plan.recode_blocks,
                                                                                 tmp))
                    buf.view(heads, c * B, dim).index_copy_(1, plan.done_dst, flat.index_select(1, plan.done_src))
                codes, scales = self.codecs[half].encode(buf)  # [num_kv_heads, c, code_size], [.., scale_size]
                self.codes[layer_idx][half].index_copy_(1, plan.done_blocks, codes)
                self.scales[layer_idx][half].index_copy_(1, plan.done_blocks, scales)
            if staged:
                src, dst = flat if plan.stage_src is None else flat.index_select(1, plan.stage_src), store[layer_idx]
                dst.index_copy_(1, plan.stage_dst, src if src.dtype == dst.dtype else src.to(dst.dtype))
            if sunk:  # the sink tokens, also in full precision
                sink = (self.sinks.keys, self.sinks.values)[half][layer_idx]
                sink.index_copy_(1, plan.sink_dst, flat.index_select(1, plan.sink_src).to(sink.dtype))
        if c:
            self.states.note_encoded(plan.done_ids, layer_idx)

    # -- read ------------------------------------------------------------------------------------------------------
    def _decode_blocks(self, layer_idx: int, half: int, blocks: torch.Tensor, out: torch.Tensor,
                       base: int | None = None) -> torch.Tensor:
        """Decode `blocks` (ids `[n]` or `[batch, n]`; or the `n` consecutive blocks from id `base`, read as views)
        into `out` `[num_kv_heads, (batch,) n, block_size, dim]`."""
        codes, scales = self.codes[layer_idx][half], self.scales[layer_idx][half]
        if base is not None:
            n = blocks.shape[-1]
            c, s = codes.narrow(1, base, n), scales.narrow(1, base, n)  # [num_kv_heads, n, size]
        else:
            idx = blocks.reshape(-1).to(codes.device)
            c = codes.index_select(1, idx).unflatten(1, blocks.shape)  # [num_kv_heads, (batch,) n, code_size]
            s = scales.index_select(1, idx).unflatten(1, blocks.shape)
        return self.codecs[half].decode(c, s, out)

    def read(self, layer_idx: int, request: ReadRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``request.lo .. request.end - 1`` of every row, de-quantized (see `ReadRequest`)."""
        return self._read(layer_idx, request.table, request.lo, request.end, request.first_block, request.new)

    def read_codes(self, layer_idx: int, request: ReadRequest) -> CodeRead | None:
        """Tokens ``request.lo .. request.end - 1`` of every row as codes and scales, for an attention that
        de-quantizes inside its products (`CodeRead`), or None when no encoded block lies in the range (`read`
        serves it then). The encoded blocks are those before the block of the step's first new token (``new[0]``,
        or `end` without `new`); the tail and the sink tokens (when block position 0 is read and every row's first
        block holds them) come in full precision, as `read` gives them."""
        B, spec = self.block_size, self.specs[layer_idx]
        start = request.end if request.new is None else request.new[0]
        first, enc = request.first_position, start // B  # block positions first .. enc - 1 are encoded
        n = enc - first
        if n <= 0:
            return None
        batch = request.table.shape[0]
        if request.first_block is not None and batch == 1:  # one run of consecutive ids: views
            base = request.first_block + first
            parts = [t.narrow(1, base, n).unsqueeze(1) for t in self.codes[layer_idx] + self.scales[layer_idx]]
        else:
            ids = request.blocks(spec.device)[:, :n]  # [batch, n]
            parts = [t.index_select(1, ids.reshape(-1)).unflatten(1, ids.shape)  # [num_kv_heads, batch, n, size]
                     for t in self.codes[layer_idx] + self.scales[layer_idx]]
        full = self._tail(layer_idx, request, start, enc * B)  # [num_kv_heads, batch, end - enc * B, dim] each
        n_sink = min(self.sink_tokens, start) if first == 0 else 0
        sink_end = 0
        if n_sink > request.lo:
            blocks = request.table[:, 0].tolist()
            stages = [self.states.sink_of.get(b) for b in blocks]
            if any(s is not None for s in stages):  # (else every row reads its first tokens from their codes)
                sink_end = n_sink
                sink = [x[:, :, request.lo:] for x in self._row_sinks(layer_idx, blocks, stages, n_sink)]
                full = [torch.cat((f, x), 2) for f, x in zip(full, sink)]
        return CodeRead(first * B, request.lo, request.end, B, (spec.key_dim, spec.value_dim), self.codecs,
                        (parts[0], parts[1]), (parts[2], parts[3]), (full[0], full[1]), sink_end)

    def code_table(self, layer_idx: int, request: ReadRequest) -> CodeTable | None:
        """Tokens ``request.lo .. request.end - 1`` of every row where they lie, for a kernel that follows block ids
        (`CodeTable`): the layer's pool of codes and scales with each row's encoded block ids, the staged partial
        block, the step's tokens and the sink stage, nothing gathered. The same tokens as `read_codes`; None where
        that form does not hold (`lo` not at a block start, no encoded block, a partial block that is not staged:
        a crop's), and `read_codes` serves. A pool grown into several storage segments is
        handed over as its `SegmentedTensor`s (the kernel finds each id's segment). Equals
        ``layer_table(layer_idx, code_layout(request), request.new)``."""
        layout = self.code_layout(request)
        return None if layout is None else self.layer_table(layer_idx, layout, request.new)

    def code_layout(self, request: ReadRequest) -> CodeLayout | None:
        """The half of `code_table` that is the same for every layer of the store (`CodeLayout`): block ids, the
        staged partial blocks' slots, the sink slots; None where `code_table` is None."""
        B = self.block_size
        lo, end, new = request.lo, request.end, request.new
        start = end if new is None else new[0]
        first, enc = request.first_position, start // B
        if lo % B or enc <= first:
            return None
        table = request.table
        ids = table[:, first:enc]
        if not ids.is_contiguous():
            ids = ids.contiguous()
        rest, stage = start - enc * B, None
        if rest:
            col = table[:, enc].tolist()
            stages = [self.states.stage_of.get(b) for b in col]
            if None in stages or any(self.states.encoded[b] for b in col):
                return None
            stage = torch.tensor(stages, dtype=torch.long) * self.staging.block_size
        sink_end, sink_slot, sink_rows = 0, None, None
        n_sink = min(self.sink_tokens, start) if first == 0 else 0
        if n_sink > 0:
            blocks = table[:, 0].tolist()
            slots = [self.states.sink_of.get(b) for b in blocks]
            if None not in slots:  # every row's sink stage, where it lies
                sink_end = n_sink
                sink_slot = torch.tensor(slots, dtype=torch.long) * self.sinks.block_size
            elif any(s is not None for s in slots):  # some rows without one: each row's own, gathered per layer
                sink_end = n_sink
                sink_slot = torch.arange(len(blocks), dtype=torch.long) * n_sink
                sink_rows = (blocks, slots)
        return CodeLayout(lo, end, start, ids, rest, stage, sink_end, sink_slot, sink_rows)

    def layer_table(self, layer_idx: int, layout: CodeLayout,
                    new: tuple[int, torch.Tensor, torch.Tensor] | None) -> CodeTable:
        """Layer `layer_idx`'s `CodeTable` of a read whose `CodeLayout` is `layout` (from `code_layout` in this step;
        the block states must not have changed since), `new` the step's `(start, key_states, value_states)` as in
        `ReadRequest.new`."""
        sinks = None
        if layout.sink_rows is not None:
            blocks, slots = layout.sink_rows
            n, batch = layout.sink_end, len(blocks)
            sinks = tuple(x.reshape(x.shape[0], batch * n, x.shape[-1])  # [num_kv_heads, slots, dim]
                          for x in self._row_sinks(layer_idx, blocks, slots, n))
        elif layout.sink_end:
            sinks = (self.sinks.keys[layer_idx], self.sinks.values[layer_idx])
        spec = self.specs[layer_idx]
        return CodeTable(layout.lo, layout.end, self.block_size, (spec.key_dim, spec.value_dim), self.codecs,
                         layout.ids, tuple(self.codes[layer_idx]), tuple(self.scales[layer_idx]), layout.rest,
                         layout.stage,
                         (self.staging.keys[layer_idx], self.staging.values[layer_idx]) if layout.rest else None,
                         None if new is None or layout.end == layout.start else (new[1], new[2]),
                         layout.sink_end, layout.sink_slot, sinks)

    def _row_sinks(self, layer_idx: int, blocks: list[int], stages: list[int | None], n: int) -> list[torch.Tensor]:
        """The first `n` tokens of each row in full precision, `[num_kv_heads, batch, n, dim]` keys and values, as the
        materialized read (`_read`) takes them: from the row's sink stage, or for a row without one (its first block
        is the shared pad block of `set_padding`, or retention freed its first block) decoded from the codes of its
        first block (`blocks`: each row's), which is what reading those codes gives."""
        if None not in stages:
            return [self._sink_rows(s, layer_idx, stages)[:, :, :n] for s in (self.sinks.keys, self.sinks.values)]
        spec, B = self.specs[layer_idx], self.block_size
        ids = torch.tensor(blocks, device=spec.device)[:, None]  # [batch, 1]
        out = []
        for half, dim in enumerate((spec.key_dim, spec.value_dim)):
            buf = torch.empty((spec.num_kv_heads, len(blocks), 1, B, dim), dtype=spec.dtype, device=spec.device)
            buf = self._decode_blocks(layer_idx, half, ids, buf).squeeze(2)  # [num_kv_heads, batch, B, dim]
            self._read_sinks(layer_idx, half, stages, n, buf)  # the rows with a stage: from it
            out.append(buf[:, :, :n])
        return out

    def _sink_rows(self, store: dict, layer_idx: int, stages: list[int]) -> torch.Tensor:
        """Each row's sink stage, `[num_kv_heads, batch, sink_tokens, dim]` (a view for one row)."""
        if len(stages) == 1:
            return self.sinks.block(store, layer_idx, stages[0]).unsqueeze(1)
        every = self.sinks.blocks(store, layer_idx)  # [num_kv_heads, num_stages, sink_tokens, dim]
        return every.index_select(1, torch.tensor(stages, device=every.device))

    def _tail(self, layer_idx: int, request: ReadRequest, start: int, lo: int) -> list[torch.Tensor]:
        """Tokens ``lo .. end - 1`` (``lo = start // B * B``: the partial block and the step's tokens) of every row
        in full precision, `[num_kv_heads, batch, end - lo, dim]` keys and values. Staged partial blocks are read
        from their stages (a view for one row), anything else (an encoded partial block: a crop) through `_read`."""
        B, end, new, spec = self.block_size, request.end, request.new, self.specs[layer_idx]
        if end == lo:
            batch = request.table.shape[0]
            return [torch.empty((spec.num_kv_heads, batch, 0, d), dtype=spec.dtype, device=spec.device)
                    for d in (spec.key_dim, spec.value_dim)]
        rest = start - lo  # tokens of the partial block before this step
        blocks = request.table[:, lo // B].tolist() if rest else []
        stages = [self.states.stage_of.get(b) for b in blocks if not self.states.encoded[b]]
        if len(stages) < len(blocks) or (new is None and end > start):
            k, v = self._read(layer_idx, request.table, lo, end, request.first_block, new)
            return [k.transpose(0, 1), v.transpose(0, 1)]
        if rest and len(stages) > 1:
            # NOTE: one index_select of the rows' first `rest` staged tokens (measured 4x faster at batch 64 than
            # indexing whole stages with a tensor and cutting them); the same staging slots for keys and values
            first = torch.tensor(stages, device=spec.device) * self.staging.block_size
            slots = (first[:, None] + torch.arange(rest, device=spec.device)).reshape(-1)
        out = []
        for half, store in enumerate((self.staging.keys, self.staging.values)):
            pieces = []
            if rest and len(stages) == 1:
                pieces.append(self.staging.block(store, layer_idx, stages[0])[:, :rest].unsqueeze(1))
            elif rest:
                every = store[layer_idx]  # [num_kv_heads, num_stages * B, dim]
                pieces.append(every.index_select(1, slots).unflatten(1, (len(stages), rest)))
            if new is not None and end > start:
                pieces.append(new[1 + half].transpose(0, 1).to(spec.dtype))  # [num_kv_heads, batch, q, dim]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2))
        return out

    def _read(self, layer_idx: int, table: torch.Tensor, lo: int, end: int, base: int | None = None,
              new: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo .. end - 1` of every row, de-quantized::

            blocks:  [ encoded | encoded | partial: stage, or codes ]  tokens < start: from the store
            tokens:    lo ..                         start .. end - 1  tokens >= start: this step's, from `new`
                                                                       (full precision, as QuantizedCache does)

        Args:
            table (`torch.LongTensor` of shape `[batch, >= ceil(end / block_size)]`, CPU): each row's block ids.
            lo, end (`int`): the token range to read.
            base (`int`, *optional*): the first block id when `batch == 1` and the row's blocks are consecutive
                (codes are then read as views, not gathered).
            new (`tuple`, *optional*): `(start, key_states, value_states)`, this step's tokens `start .. end - 1` of
                every row, `[batch, num_kv_heads, end - start, head_dim]`.

        Returns:
            keys, values of shape `[batch, num_kv_heads, end - lo, head_dim]`.
        """
        B, spec = self.block_size, self.specs[layer_idx]
        start = end if new is None else new[0]
        batch, first = table.shape[0], lo // B
        full = max(0, start // B - first)  # blocks entirely before `start`: full, hence encoded
        rest = start % B if start // B >= first else 0  # tokens of the partial block before `start`
        partial = table[:, start // B].tolist() if rest else None  # each row's partial block
        n_sink = min(self.sink_tokens, start) if first == 0 else 0  # tokens read from the sink, in full precision
        sinks = [self.states.sink_of.get(b) for b in table[:, 0].tolist()] if n_sink else None  # rows' sink stages
        # a row without one is read decoded: retention freed its first block, or it is the pad block (padding)
        if sinks is not None and all(stage is None for stage in sinks):
            n_sink, sinks = 0, None
        out = []
        for half, dim in enumerate((spec.key_dim, spec.value_dim)):
            buf = torch.empty((spec.num_kv_heads, batch, end - first * B, dim), dtype=spec.dtype, device=spec.device)
            if full and base is not None and batch == 1:  # the common decode case: views in, one buffer out
                dst = buf[:, 0, : full * B].view(spec.num_kv_heads, full, B, dim)  # [num_kv_heads, full, B, dim]
                self._decode_blocks(layer_idx, half, table[0, first: first + full], dst, base + first)
            elif full:
                dst = buf[:, :, : full * B].unflatten(2, (full, B))  # [num_kv_heads, batch, full, B, dim]
                self._decode_blocks(layer_idx, half, table[:, first: first + full], dst)
            if rest:
                self._read_partial(layer_idx, half, partial, rest, buf[:, :, full * B:])
            if n_sink:
                self._read_sinks(layer_idx, half, sinks, n_sink, buf)
            if new is not None and end > start:
                buf[:, :, start - first * B:] = new[1 + half].transpose(0, 1)  # [num_kv_heads, batch, q, dim]
            out.append(buf[:, :, lo - first * B:].transpose(0, 1))  # [batch, num_kv_heads, end - lo, dim]
        return out[0], out[1]

    def _read_sinks(self, layer_idx: int, half: int, stages: list[int | None], n: int, out: torch.Tensor) -> None:
        """The first `n` tokens of each row from its sink stage (`stages`, one per row; None: the row has none and
        keeps what `out` holds) into `out` `[num_kv_heads, batch, >= n, dim]`."""
        store = (self.sinks.keys, self.sinks.values)[half]
        if len(stages) == 1:
            out[:, 0, :n].copy_(self.sinks.block(store, layer_idx, stages[0])[:, :n])
            return
        if None in stages:
            rows = torch.tensor([r for r, s in enumerate(stages) if s is not None], device=out.device)
            idx = torch.tensor([s for s in stages if s is not None], device=out.device)
            out[:, rows, :n] = self.sinks.blocks(store, layer_idx)[:, idx, :n]  # [num_kv_heads, len(rows), n, dim]
            return
        idx = torch.tensor(stages, device=out.device)
        out[:, :, :n] = self.sinks.blocks(store, layer_idx)[:, idx, :n]  # [num_kv_heads, batch, n, dim]

    def _read_partial(self, layer_idx: int, half: int, blocks: list[int], n: int, out: torch.Tensor) -> None:
        """The first `n` tokens of one partial block per row into `out` `[num_kv_heads, batch, >= n, dim]`: from
        its stage when open, by decoding when encoded (cropped into, or completed in this step)."""
        B, store = self.block_size, (self.staging.keys, self.staging.values)[half]
        if len(blocks) == 1 and not self.states.encoded[blocks[0]]:
            stage = self.staging.block(store, layer_idx, self.states.stage_of[blocks[0]])  # [num_kv_heads, B, dim]
            out[:, 0, :n].copy_(stage[:, :n])
            return
        enc = [r for r, b in enumerate(blocks) if self.states.encoded[b]]
        staged = [r for r, b in enumerate(blocks) if not self.states.encoded[b]]
        if staged:
            stages = torch.tensor([self.states.stage_of[blocks[r]] for r in staged], device=out.device)
            src = self.staging.blocks(store, layer_idx)[:, stages, :n]  # [num_kv_heads, len(staged), n, dim]
            out[:, torch.tensor(staged, device=out.device), :n] = src
        if enc:
            tmp = out.new_empty((out.shape[0], len(enc), B, out.shape[-1]))  # [num_kv_heads, len(enc), B, dim]
            self._decode_blocks(layer_idx, half, torch.tensor([blocks[r] for r in enc]), tmp)
            out[:, torch.tensor(enc, device=out.device), :n] = tmp[:, :, :n]

    # -- whole blocks out and in (prefix-cache files, the host tier) --------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of whole blocks in every layer, as stored, in the order of `blocks`: encoded blocks as their codes
        and scales (never re-quantized), open blocks as their full-precision stage, and the full-precision sink tokens
        of the blocks that hold a sequence's sink.

        Returns:
            `dict[str, torch.Tensor]`, on the layer's device: ``"{layer}.key_codes"`` / ``"{layer}.value_codes"``
            `[num_kv_heads, len(blocks), code_size]`, ``"{layer}.key_scales"`` / ``"{layer}.value_scales"``
            `[num_kv_heads, len(blocks), scale_size]` (meaningless for open blocks); ``"stage_rows"`` int64 `[m]`
            (positions in `blocks` of the `m` open blocks) with ``"{layer}.stage_keys"`` / ``"{layer}.stage_values"``
            `[num_kv_heads, m, block_size, dim]`; ``"sink_rows"`` int64 `[s]` (the blocks with a sink) with
            ``"{layer}.sink_keys"`` / ``"{layer}.sink_values"`` `[num_kv_heads, s, sink_tokens, dim]` (model dtype).
        """
        open_rows = [i for i, b in enumerate(blocks) if not self.states.encoded[b]]
        assert all(blocks[i] in self.states.stage_of for i in open_rows), "an open block without a stage"
        sink_rows = [i for i, b in enumerate(blocks) if b in self.states.sink_of]
        out = {"stage_rows": torch.tensor(open_rows, dtype=torch.long),
               "sink_rows": torch.tensor(sink_rows, dtype=torch.long)}
        parts = (("stage", self.staging, [self.states.stage_of[blocks[i]] for i in open_rows], self.block_size),
                 ("sink", self.sinks, [self.states.sink_of[blocks[i]] for i in sink_rows], self.sink_tokens))
        for idx, spec in self.specs.items():
            idx_t = torch.tensor(blocks, dtype=torch.long, device=spec.device)
            for half, name in enumerate(("key", "value")):
                out[f"{idx}.{name}_codes"] = self.codes[idx][half].index_select(1, idx_t)  # [heads, n, code_size]
                out[f"{idx}.{name}_scales"] = self.scales[idx][half].index_select(1, idx_t)  # [heads, n, scale_size]
                for part, area, stages, length in parts:
                    every = area.blocks((area.keys, area.values)[half], idx)  # [heads, num_stages, stage_len, dim]
                    stage_t = torch.tensor(stages, dtype=torch.long, device=spec.device)
                    out[f"{idx}.{part}_{name}s"] = every.index_select(1, stage_t)[:, :, :length].contiguous()
        return out

    def import_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Make fresh blocks (just allocated: no stage, not encoded) hold what `export_blocks` returned, as it was:
        encoded blocks with their codes and scales (no re-quantization), open ones staged, sinks kept.

        Raises:
            ValueError: a tensor missing or not of the shape and dtype this store's codecs use (another
                quantization), or rows out of range (nothing is written then).
        """
        rows = {}
        for part in ("stage", "sink"):
            t = tensors.get(f"{part}_rows")
            if t is None or t.dim() != 1 or t.dtype != torch.long:
                raise ValueError(f"import_blocks: no int64 '{part}_rows' tensor (a block export of another storage "
                                 "format?).")
            rows[part] = t.tolist()
            if any(not 0 <= r < len(blocks) for r in rows[part]) or len(set(rows[part])) != len(rows[part]):
                raise ValueError(f"import_blocks: {part} rows {rows[part][:10]} do not name distinct blocks of the "
                                 f"{len(blocks)}.")
        want = {}
        for idx, spec in self.specs.items():
            for half, (name, layout) in enumerate(zip(("key", "value"), self.layouts[idx])):
                dim = (spec.key_dim, spec.value_dim)[half]
                want[f"{idx}.{name}_codes"] = ((spec.num_kv_heads, len(blocks), layout.code_size), layout.code_dtype)
                want[f"{idx}.{name}_scales"] = ((spec.num_kv_heads, len(blocks), layout.scale_size),
                                                layout.scale_dtype)
                want[f"{idx}.stage_{name}s"] = ((spec.num_kv_heads, len(rows["stage"]), self.block_size, dim),
                                                spec.dtype)
                want[f"{idx}.sink_{name}s"] = ((spec.num_kv_heads, len(rows["sink"]), self.sink_tokens, dim),
                                               spec.dtype)
        check_block_tensors(want, tensors)
        fresh = [b for b in blocks if self.states.encoded[b] or b in self.states.stage_of or b in self.states.sink_of]
        assert not fresh, f"import_blocks into blocks {fresh[:10]} that are not fresh"
        for i in rows["stage"]:
            self.states.stage_of[blocks[i]] = self.staging.allocate()
        for i in rows["sink"]:
            self.states.sink_of[blocks[i]] = self.sinks.allocate()
        parts = (("stage", self.staging, [self.states.stage_of[blocks[i]] for i in rows["stage"]], self.block_size),
                 ("sink", self.sinks, [self.states.sink_of[blocks[i]] for i in rows["sink"]], self.sink_tokens))
        for idx, spec in self.specs.items():
            idx_t = torch.tensor(blocks, dtype=torch.long, device=spec.device)
            for half, name in enumerate(("key", "value")):
                self.codes[idx][half].index_copy_(1, idx_t, tensors[f"{idx}.{name}_codes"].to(spec.device))
                self.scales[idx][half].index_copy_(1, idx_t, tensors[f"{idx}.{name}_scales"].to(spec.device))
                for part, area, stages, length in parts:
                    every = area.blocks((area.keys, area.values)[half], idx)  # [heads, num_stages, stage_len, dim]
                    stage_t = torch.tensor(stages, dtype=torch.long, device=spec.device)
                    every[:, :, :length].index_copy_(1, stage_t, tensors[f"{idx}.{part}_{name}s"].to(spec.device))
        staged = {blocks[i] for i in rows["stage"]}
        for b in blocks:
            self.states.encoded[b] = self.states.num_encodes[b] = 0 if b in staged else 1


__all__ = ["QuantizedPageStore", "WritePlan"]
