"""`QuantizedPageStore`: the K/V of a quantized pool, as codes + scales per block plus a full-precision staging area."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codecs import BlockLayout, check_finite, codec_name, make_codec
from .config import QuantConfig
from .page_store import LayerSpec
from .staging_store import StagingStore

_CODE_SENTINEL = 0xFF  # debug mode: freed code bytes (their scales become NaN, so a decode shows NaN)


@dataclass
class WritePlan:
    """Where one forward step's new tokens go, as index tensors on one device; built once per step by
    `QuantizedPageStore.plan_write` and used by every layer. Token positions index the step's new tokens row-major
    (`[rows * num_new_tokens]`), as the slot mapping does."""

    stage_src: torch.Tensor | None  # [n_s] new tokens written into stages (None: all of them, in order)
    stage_dst: torch.Tensor  # [n_s] their staging slots (stage * block_size + offset)
    done_blocks: torch.Tensor  # [c] blocks this write completes: encoded now, once
    done_src: torch.Tensor | None  # [n_d] new tokens of completed blocks (None: all tokens, exactly those blocks)
    done_dst: torch.Tensor  # [n_d] their positions in the `[c * block_size]` encode buffer
    prefix_rank: torch.Tensor  # [p] completed blocks (index into done_blocks) whose earlier tokens are staged
    prefix_stage: torch.Tensor  # [p] those stages
    recode_rank: torch.Tensor  # [r] completed blocks whose earlier tokens are encoded (reopened by a crop)
    recode_blocks: torch.Tensor  # [r] those blocks


class QuantizedPageStore:
    """Preallocated quantized K/V storage for every layer of a pool (the `PageStore` of a `QuantConfig` pool).

    Layout, per layer, head-major so that a row whose blocks have consecutive ids reads its codes as a view::

        codes[layer]  = [key_codes, value_codes]:    [num_kv_heads, num_blocks, code_size]   uint8 (identity: model dtype)
        scales[layer] = [key_scales, value_scales]:  [num_kv_heads, num_blocks, scale_size]  fp16

    where one block of one head is encoded by the layer's codec (`codecs/`, see `layouts`): keys per channel over the
    block's tokens, values per token in groups along head_dim (KIVI, arXiv 2402.02750). Blocks not encoded yet live in
    full precision in a `StagingStore`, sized by the number of sequences, not by the pool. Each block is in one state:

    - *fresh*: just allocated (or free), no stage, not encoded;
    - *open*: `_stage_of[b]` names its stage; the partial last block of a sequence, written token by token;
    - *encoded*: its codes hold it. A block is encoded once, by the `write` that fills its last slot, and then
      read by decoding; it is never de-quantized and re-quantized. A block encoded in the current step keeps its
      stage until the next step starts (`_pending`), because a mid-step `_unshare` may still need its first tokens.

    Crop into an encoded block leaves it encoded and readable; the next write into it *reopens* it (decodes its kept
    tokens into a new stage) and it is encoded again when it refills. That is the one case where tokens are quantized
    twice (error up to twice the codec's bound). Debug mode fills freed codes with 0xFF and their scales with NaN, and
    freed stages with NaN.
    """

    is_quantized = True

    def __init__(self, block_size: int, quant: QuantConfig, debug: bool = False) -> None:
        self.block_size = block_size  # tokens per block; fixed
        self.quant = quant  # the storage format; fixed
        self.key_codec = make_codec(codec_name(quant.backend, quant.key_bits), "channel")  # fixed
        self.value_codec = make_codec(codec_name(quant.backend, quant.value_bits), "token", quant.value_group_size)
        self.staging = StagingStore(block_size, debug)  # full-precision stages of open blocks
        self.num_blocks = 0  # blocks allocated in every layer's tensors; changed by `grow` only
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.layouts: dict[int, tuple[BlockLayout, BlockLayout]] = {}  # layer_idx -> (key, value) block layouts
        self.codes: dict[int, list[torch.Tensor]] = {}  # layer_idx -> [key_codes, value_codes]
        self.scales: dict[int, list[torch.Tensor]] = {}  # layer_idx -> [key_scales, value_scales]
        self._stage_of: dict[int, int] = {}  # block -> its stage (open blocks, and pending ones)
        self._encoded = bytearray()  # _encoded[b] == 1 iff block b's codes hold it
        self._pending: set[int] = set()  # blocks encoded in the current step that still hold a stage
        self._debug = debug

    @property
    def debug(self) -> bool:
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = self.staging.debug = bool(value)

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
        """Codes + scales of the blocks in use, plus the full-precision stages of open (partial) blocks."""
        num_open = sum(1 for b in self._stage_of if not self._encoded[b])
        return num_used_blocks * self.bytes_per_block + num_open * self.staging.bytes_per_stage()

    def bytes_reserved(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.staging.num_stages * self.staging.bytes_per_stage()

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

    def grow(self, num_blocks: int) -> None:
        """Resize every layer to `num_blocks` blocks, keeping the content of the existing ones."""
        assert num_blocks >= self.num_blocks
        for idx in self.specs:
            codes, scales = self._new(idx, num_blocks)
            for new, old in zip(codes + scales, self.codes[idx] + self.scales[idx]):
                new[:, : old.shape[1]] = old
            self.codes[idx], self.scales[idx] = codes, scales
        self._encoded.extend(bytes(num_blocks - self.num_blocks))
        self.num_blocks = num_blocks

    # -- block lifecycle -------------------------------------------------------------------------------------------
    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0: return their stages, forget their codes, poison them in debug mode."""
        for b in blocks:
            stage = self._stage_of.pop(b, None)
            if stage is not None:
                self.staging.free(stage)
            self._encoded[b] = 0
            self._pending.discard(b)
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
        stages = []
        for s, d in zip(src, dst):
            self._encoded[d] = self._encoded[s]
            if s in self._stage_of:
                self._stage_of[d] = self.staging.allocate()
                stages.append((self._stage_of[s], self._stage_of[d]))
            if s in self._pending:
                self._pending.add(d)
        for idx in self.specs:
            for t in self.codes[idx] + self.scales[idx]:
                s_t, d_t = (torch.tensor(x, dtype=torch.long, device=t.device) for x in (src, dst))
                t.index_copy_(1, d_t, t.index_select(1, s_t))
            for store in (self.staging.keys, self.staging.values):
                for s, d in stages:
                    self.staging.block(store, idx, d).copy_(self.staging.block(store, idx, s))

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

    # -- write -----------------------------------------------------------------------------------------------------
    def plan_write(self, slots: torch.Tensor, device: torch.device, new_step: bool = True) -> WritePlan:
        """Route a step's new tokens: to stages, or into the blocks they complete. Updates block states once per
        step (call again with ``new_step=False`` for another device or after the step's rows changed).

        Args:
            slots (`torch.LongTensor` of shape `[rows * num_new_tokens]`, CPU): the slot mapping, row-major.
            device (`torch.device`): where the plan's index tensors go.
            new_step (`bool`): the first plan of a forward step (releases the stages of last step's encoded blocks).
        """
        B = self.block_size
        if new_step:
            self._release_pending()
        blk, off = slots // B, slots % B  # [n] each
        ublk, inv = torch.unique(blk, return_inverse=True)  # touched blocks, and each token's index among them
        first_off = torch.full((len(ublk),), B, dtype=torch.long).scatter_reduce_(0, inv, off, "amin")
        complete = torch.zeros(len(ublk), dtype=torch.bool)
        complete[inv[off == B - 1]] = True  # a write to the last slot fills the block
        done, prefix, recode, opens = [], [], [], []
        for b, is_done, first in zip(ublk.tolist(), complete.tolist(), first_off.tolist()):
            stage = self._stage_of.get(b)
            if is_done:
                if first > 0 and stage is not None:
                    prefix.append((len(done), stage))
                elif first > 0:
                    assert self._encoded[b], f"block {b} is written from offset {first} but holds no earlier tokens"
                    recode.append((len(done), b))
                if stage is not None:
                    self._pending.add(b)
                self._encoded[b] = 1
                done.append(b)
                continue
            if stage is None:
                stage = self._stage_of[b] = self.staging.allocate()
                if self._encoded[b]:
                    opens.append((b, stage, first))
            elif self._encoded[b]:  # an encoded block still holding its stage, cropped and written again
                opens.append((b, stage, first))
                self._pending.discard(b)
            self._encoded[b] = 0
        if opens:
            self._reopen(opens)
        n = len(slots)
        tok_done = complete[inv]  # [n] tokens that land in a completed block
        rank = torch.full((len(ublk),), -1, dtype=torch.long)
        rank[complete] = torch.arange(len(done))
        done_src = tok_done.nonzero().squeeze(1)
        done_dst = rank[inv[done_src]] * B + off[done_src]
        direct = len(done_src) == n and torch.equal(done_dst, torch.arange(n))
        stage_src = (~tok_done).nonzero().squeeze(1)
        stage_ids = torch.tensor([self._stage_of.get(b, -1) for b in ublk.tolist()], dtype=torch.long)
        stage_dst = stage_ids[inv[stage_src]] * B + off[stage_src]

        def dev(x):
            return torch.tensor(x, dtype=torch.long, device=device) if isinstance(x, list) else x.to(device)

        return WritePlan(
            stage_src=None if len(stage_src) == n else dev(stage_src), stage_dst=dev(stage_dst),
            done_blocks=dev(done), done_src=None if direct else dev(done_src), done_dst=dev(done_dst),
            prefix_rank=dev([r for r, _ in prefix]), prefix_stage=dev([s for _, s in prefix]),
            recode_rank=dev([r for r, _ in recode]), recode_blocks=dev([b for _, b in recode]))

    def write(self, layer_idx: int, plan: WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens as `plan` says: encode the blocks they complete, stage the rest.

        Args:
            plan (`WritePlan`): from `plan_write` for this step and device.
            key_states, value_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, head_dim]`).

        Raises:
            ValueError: NaN or inf in a quantized half (nothing of this layer was written).
        """
        B = self.block_size
        flats = []
        for half, new in enumerate((key_states, value_states)):
            flat = new.transpose(0, 1).reshape(new.shape[1], -1, new.shape[-1])  # [num_kv_heads, rows * q, dim]
            # NOTE: a sum is NaN/inf iff an element is (barring overflow, then the exact check decides): one op
            if self.codecs[half].bits is not None and not math.isfinite(float(flat.sum())):
                check_finite(flat, f"{('key', 'value')[half]}_states of layer {layer_idx}")
            flats.append(flat)
        c = len(plan.done_blocks)
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
            if len(plan.stage_dst):
                src = flat if plan.stage_src is None else flat.index_select(1, plan.stage_src)
                store[layer_idx].index_copy_(1, plan.stage_dst, src.to(store[layer_idx].dtype))

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

    def read(self, layer_idx: int, table: torch.Tensor, lo: int, end: int, base: int | None = None,
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
                self._read_partial(layer_idx, half, table[:, start // B].tolist(), rest, buf[:, :, full * B:])
            if new is not None and end > start:
                buf[:, :, start - first * B:] = new[1 + half].transpose(0, 1)  # [num_kv_heads, batch, q, dim]
            out.append(buf[:, :, lo - first * B:].transpose(0, 1))  # [batch, num_kv_heads, end - lo, dim]
        return out[0], out[1]

    def _read_partial(self, layer_idx: int, half: int, blocks: list[int], n: int, out: torch.Tensor) -> None:
        """The first `n` tokens of one partial block per row into `out` `[num_kv_heads, batch, >= n, dim]`: from
        its stage when open, by decoding when encoded (cropped into, or completed in this step)."""
        B, store = self.block_size, (self.staging.keys, self.staging.values)[half]
        if len(blocks) == 1 and not self._encoded[blocks[0]]:
            stage = self.staging.block(store, layer_idx, self._stage_of[blocks[0]])  # [num_kv_heads, B, dim]
            out[:, 0, :n].copy_(stage[:, :n])
            return
        enc = [r for r, b in enumerate(blocks) if self._encoded[b]]
        staged = [r for r, b in enumerate(blocks) if not self._encoded[b]]
        if staged:
            stages = torch.tensor([self._stage_of[blocks[r]] for r in staged], device=out.device)
            src = self.staging.blocks(store, layer_idx)[:, stages, :n]  # [num_kv_heads, len(staged), n, dim]
            out[:, torch.tensor(staged, device=out.device), :n] = src
        if enc:
            tmp = out.new_empty((out.shape[0], len(enc), B, out.shape[-1]))  # [num_kv_heads, len(enc), B, dim]
            self._decode_blocks(layer_idx, half, torch.tensor([blocks[r] for r in enc]), tmp)
            out[:, torch.tensor(enc, device=out.device), :n] = tmp[:, :, :n]
