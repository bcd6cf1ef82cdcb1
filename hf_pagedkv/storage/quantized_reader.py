"""`QuantizedReader`: the read paths of a quantized store: de-quantized tokens, codes and scales, code tables."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.code_layout import CodeLayout
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_block_states import QuantizedBlockStates
from hf_pagedkv.storage.read_request import ReadRequest
from hf_pagedkv.storage.segment_split import SegmentSplit
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor
from hf_pagedkv.storage.staging_store import StagingStore


class QuantizedReader:
    """Reads the tokens of a `QuantizedPageStore` without changing it, in the three forms attention takes them:

    - `read`: de-quantized keys and values, `[batch, num_kv_heads, seq_len, head_dim]` (what `DynamicCache` returns);
    - `read_codes`: the encoded blocks as gathered codes and scales (`CodeRead`), the rest in full precision;
    - `code_layout` / `layer_table`: the codes and scales where they lie, with each row's block ids (`CodeTable`).

    Encoded blocks are decoded by the layer's codecs (`decode_blocks`); open (partial) blocks are read from their
    stages, and a sequence's first `sink_tokens` tokens from its sink stage, both in full precision. Holds no state
    of its own: every argument is the owning store's and is read only here (the dicts are filled by the store's
    `add_layer`, the block states changed by its writes).

    Args:
        block_size (`int`): tokens per block.
        sink_tokens (`int`): leading tokens of each sequence kept in full precision (0: none).
        codecs (`tuple`): the key and the value codec.
        specs (`dict[int, LayerSpec]`): each layer's shape, dtype and device.
        codes, scales (`dict[int, list[SegmentedTensor]]`): each layer's `[key, value]` codes
            `[num_kv_heads, num_blocks, code_size]` and scales `[num_kv_heads, num_blocks, scale_size]`.
        states (`QuantizedBlockStates`): which blocks are encoded, their stages and sink stages.
        staging, sinks (`StagingStore`): the stages of open blocks and the sink stages.
    """

    def __init__(self, block_size: int, sink_tokens: int, codecs: tuple, specs: dict[int, LayerSpec],
                 codes: dict[int, list[SegmentedTensor]], scales: dict[int, list[SegmentedTensor]],
                 states: QuantizedBlockStates, staging: StagingStore, sinks: StagingStore) -> None:
        self.block_size, self.sink_tokens, self.codecs = block_size, sink_tokens, codecs  # fixed
        self.specs, self.codes, self.scales = specs, codes, scales  # the store's; read only
        self.states, self.staging, self.sinks = states, staging, sinks  # the store's; read only
        # the block ids and segment starts of the last gather, and their `SegmentSplit`: every half and layer of a
        # step gathers the same ids from tensors with the same segments, so the split is made once, not per tensor
        self._split_key: tuple | None = None
        self._split: SegmentSplit | None = None

    def decode_blocks(self, layer_idx: int, half: int, blocks: torch.Tensor, out: torch.Tensor,
                       base: int | None = None) -> torch.Tensor:
        """Decode `blocks` (ids `[n]` or `[batch, n]`; or the `n` consecutive blocks from id `base`, read as views)
        into `out` `[num_kv_heads, (batch,) n, block_size, dim]`."""
        codes, scales = self.codes[layer_idx][half], self.scales[layer_idx][half]
        if base is not None:
            n = blocks.shape[-1]
            c, s = codes.narrow(1, base, n), scales.narrow(1, base, n)  # [num_kv_heads, n, size]
        else:
            idx = blocks.reshape(-1).to(codes.device)
            split = self._block_split(codes, idx)  # (codes and scales have the same segments of blocks)
            c = codes.index_select(1, idx, split=split).unflatten(1, blocks.shape)  # [num_kv_heads, (batch,) n, size]
            s = scales.index_select(1, idx, split=split).unflatten(1, blocks.shape)
        return self.codecs[half].decode(c, s, out)

    def _block_split(self, codes: SegmentedTensor, idx: torch.Tensor) -> SegmentSplit | None:
        """`codes.split(idx)` for block ids `idx` `[n]`, reused while the ids and the segments are the same; None
        for one segment (nothing to split)."""
        if len(codes.segments) == 1:
            return None
        key = (idx.device, tuple(idx.tolist()), tuple(codes.starts))
        if key != self._split_key:  # (a copy of the ids: the split may hold them, and a table may change in place)
            self._split_key, self._split = key, codes.split(idx.clone())
        return self._split

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
            buf = self.decode_blocks(layer_idx, half, ids, buf).squeeze(2)  # [num_kv_heads, batch, B, dim]
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
                self.decode_blocks(layer_idx, half, table[0, first: first + full], dst, base + first)
            elif full:
                dst = buf[:, :, : full * B].unflatten(2, (full, B))  # [num_kv_heads, batch, full, B, dim]
                self.decode_blocks(layer_idx, half, table[:, first: first + full], dst)
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
            self.decode_blocks(layer_idx, half, torch.tensor([blocks[r] for r in enc]), tmp)
            out[:, torch.tensor(enc, device=out.device), :n] = tmp[:, :, :n]
