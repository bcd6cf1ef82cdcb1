"""`PagedView`: where one layer's K/V of one forward step lie in the pool, for an attention that reads them in place."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from hf_pagedkv.attention.rotated_read import key_rotation, rotate_code_read, rotate_code_table, value_rotation
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.read_request import ReadRequest

def _one_segment(t, lo: int, hi: int) -> bool:
    """Whether entries ``lo .. hi - 1`` of the `SegmentedTensor` `t` lie in one of its segments."""
    s = max(i for i, start in enumerate(t.starts) if start <= lo)
    return hi <= t.starts[s] + t.segments[s].shape[1]


_ATTR = "hf_pagedkv_view"  # the attribute of a tensor returned by `PagedCache.update` that names its view
_SCALARS: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the one-element storage placeholders expand


class PagedView:
    """What one layer's attention reads in one forward step, described by block tables instead of a copy.

    `PagedCache.update` builds one per layer and step (cheap: no tensor work) and either tags the keys it returns
    with it (`tag`: a normal, materialized read) or, once this step's attention said it reads in place (`confirm`),
    returns `placeholders()` instead: zero-stride tensors of the right shape that hold no history. The attention
    (`hf_pagedkv.attention`) then reads the tokens ``lo .. end - 1`` of every row as *chunks*, in token order::

        pages:  [ block first | block first+1 | ... ]   whole blocks through the block table, tile by tile:
                  p0 = first * block_size               fp pages gathered, quantized ones decoded per tile
        (quantized: tiles are de-quantized by the store, sink tokens in full precision; the last tile also
         holds the staged partial block and this step's tokens, in full precision)

    Every chunk is `(pos0, keys, values)`: keys `[num_kv_heads, batch, n, key_dim]`, values
    `[num_kv_heads, batch, n, value_dim]` (head-major, as the pool stores them), token positions
    ``pos0 .. pos0 + n - 1``, all within ``lo .. end - 1``; the chunks cover that range once, in order.

    Args:
        store (`PageStore` or `QuantizedPageStore`): the layer group's store.
        layer_idx (`int`): the model layer.
        table (`torch.LongTensor` of shape `[batch, >= ceil(end / block_size)]`, CPU): each row's block ids by
            block position.
        lo, end (`int`): the token range attention reads (a sliding window starts at `lo > 0`).
        base (`int`, *optional*): slot of token 0 when there is one row whose blocks are consecutive.
        new (`tuple`, *optional*): `(start, key_states, value_states)` of this step (quantized stores return the
            step's own tokens in full precision).
        materialize (`Callable`): returns the keys and values the cache would return without this view
            (`[batch, num_kv_heads, end - lo, head_dim]`), for a reader that falls back to another attention.
        confirm (`Callable`): tells the cache that this step's attention reads in place.
        shared (`dict`, *optional*): a memo shared by the views of one forward step (its block tables and block
            states do not change while it lives), where `code_table` keeps each store's `CodeLayout`; None: none.
    """

    def __init__(self, store, layer_idx: int, table: torch.Tensor, lo: int, end: int, base: int | None,
                 new: tuple | None, materialize: Callable, confirm: Callable, shared: dict | None = None) -> None:
        self.store = store  # the group's store; read only
        self.layer_idx = layer_idx  # the model layer
        self.table = table  # [batch, blocks] block ids, CPU
        self.lo, self.end = lo, end  # tokens read: lo .. end - 1
        self.base = base  # slot of token 0 of the only row when its blocks are consecutive, else None
        self.new = new  # (start, key_states, value_states) of this step, or None
        self.materialize = materialize  # () -> (keys, values) as the cache returns them
        self.confirm = confirm  # () -> None: this step's attention reads in place
        self.spec = store.specs[layer_idx]  # shape, dtype, device of the layer's K/V
        self.block_size = store.block_size
        self._placeholder: torch.Tensor | None = None  # the keys `placeholders` handed out, if any
        self.claimed = False  # an attention that reads in place got the placeholder (`claim`); set by `claim` only
        self._shared = shared  # the step's memo: (store id, lo, end) -> CodeLayout | None

    # -- the hook between cache and attention ------------------------------------------------------------------
    @staticmethod
    def of(key: torch.Tensor) -> PagedView | None:
        """The view a tensor returned by `PagedCache.update` carries, or None."""
        return getattr(key, _ATTR, None)

    def tag(self, keys: torch.Tensor) -> None:
        """Attach this view to the keys the cache returns (a materialized read)."""
        setattr(keys, _ATTR, self)

    def placeholders(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the right shapes, `[batch, num_kv_heads, end - lo, head_dim]`, holding no history (one
        zero element expanded); the keys carry this view."""
        spec, n = self.spec, self.end - self.lo
        key = (spec.dtype, spec.device)
        one = _SCALARS.get(key)
        if one is None:
            one = _SCALARS[key] = torch.zeros((), dtype=spec.dtype, device=spec.device)
        batch = self.table.shape[0]
        k = one.expand(batch, spec.num_kv_heads, n, spec.key_dim)
        v = one.expand(batch, spec.num_kv_heads, n, spec.value_dim)
        setattr(k, _ATTR, self)
        self._placeholder = k
        return k, v

    def is_placeholder(self, key: torch.Tensor) -> bool:
        """Whether `key` is this view's placeholder (holds no history) rather than materialized keys."""
        return key is self._placeholder

    def claim(self, key: torch.Tensor) -> bool:
        """`is_placeholder`, called by an attention that reads in place (or materializes): it also records that the
        placeholder reached such a reader (`claimed`), which the cache checks before the next layer."""
        placeholder = key is self._placeholder
        self.claimed = self.claimed or placeholder
        return placeholder

    # -- codes ------------------------------------------------------------------------------------------------
    def code_read(self) -> CodeRead | None:
        """A quantized store's tokens ``lo .. end - 1`` as codes and scales (`QuantizedPageStore.read_codes`), for
        an attention that de-quantizes inside its products; None for a full-precision store, or when no encoded
        block lies in the range (read `chunks` then). Rotated keys (`key_rotation`) and values (`value_rotation`)
        come in the basis of their codes (`rotate_code_read`): score them with the query turned by `key_rotation`,
        turn the output back by `value_rotation`'s transpose."""
        if not self.store.is_quantized:
            return None
        read = self.store.read_codes(self.layer_idx, ReadRequest(self.table, self.lo, self.end, self.block_size,
                                                                 self._first_block(), self.new))
        rotation, values = self.key_rotation(), self.value_rotation()
        if read is None or (rotation is None and values is None):
            return read
        return rotate_code_read(read, rotation, values)

    def key_rotation(self) -> torch.Tensor | None:
        """The matrix `R` `[key_dim, key_dim]` the store's key codes were turned by, or None (`key_rotation`)."""
        return key_rotation(self.store, self.layer_idx, self.spec.dtype)

    def value_rotation(self) -> torch.Tensor | None:
        """The matrix `R` `[value_dim, value_dim]` the store's value codes were turned by, or None
        (`value_rotation`)."""
        return value_rotation(self.store, self.layer_idx, self.spec.dtype)

    def code_table(self, turn_keys: bool = True) -> CodeTable | None:
        """A quantized store's tokens ``lo .. end - 1`` where they lie, found through the block table
        (`QuantizedPageStore.code_table`), for a kernel that follows block ids; None for a full-precision store or
        where that form does not hold (read `code_read` then). Rotated keys and values come in the basis of their
        codes (`rotate_code_table`), as in `code_read`; with `turn_keys=False` the full-precision keys stay in the
        model's basis (a kernel that scores them with the query before its turn)."""
        if not self.store.is_quantized:
            return None
        key = (id(self.store), self.lo, self.end)  # the layers of a layer group read the same blocks in a step
        shared = {} if self._shared is None else self._shared
        if key not in shared:
            shared[key] = self.store.code_layout(ReadRequest(self.table, self.lo, self.end, self.block_size,
                                                             self._first_block(), self.new))
        layout = shared[key]
        if layout is None:
            return None
        table = self.store.layer_table(self.layer_idx, layout, self.new)
        rotation, values = self.key_rotation(), self.value_rotation()
        if rotation is None and values is None:
            return table
        return rotate_code_table(table, rotation, values, turn_keys=turn_keys)

    # -- chunks ----------------------------------------------------------------------------------------------
    def num_chunks(self, tile_tokens: int) -> int:
        """How many chunks `chunks(tile_tokens)` yields (without reading any)."""
        B, first = self.block_size, self.lo // self.block_size
        step = max(1, tile_tokens // B)
        if not self.store.is_quantized:
            return 1 if self.base is not None else -(-(-(-self.end // B) - first) // step)
        enc = (self.new[0] if self.new is not None else self.end) // B
        return 1 if enc <= first else -(-(enc - first) // step)

    def chunks(self, tile_tokens: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The tokens ``lo .. end - 1`` as `(pos0, keys, values)` chunks (see the class docstring);
        page chunks hold at most `tile_tokens` tokens (at least one block) and are decoded only when reached. Each
        chunk is cut to ``lo .. end - 1``: slots outside it (before a window, past the last token of a partial
        block) may hold anything, NaN included (debug poisoning, never-written storage), and a masked NaN would
        still reach the output through ``0 * NaN``."""
        for pos0, k, v in self._whole_chunks(tile_tokens):
            a, b = max(0, self.lo - pos0), min(k.shape[2], self.end - pos0)
            if a or b < k.shape[2]:
                k, v, pos0 = k[:, :, a:b], v[:, :, a:b], pos0 + a
            yield pos0, k, v

    def _whole_chunks(self, tile_tokens: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        B, store = self.block_size, self.store
        first = self.lo // B
        if not store.is_quantized:
            if self.base is not None:  # one row in consecutive slots: the whole range is a view of the pool
                n = self.end - self.lo
                k = store.keys[self.layer_idx].narrow(1, self.base + self.lo, n)  # [H, n, key_dim]
                v = store.values[self.layer_idx].narrow(1, self.base + self.lo, n)  # [H, n, value_dim]
                yield self.lo, k.unsqueeze(1), v.unsqueeze(1)
                return
            last = -(-self.end // B)
            yield from self._fp_tiles(first, last, tile_tokens)
            return
        # Quantized: tiles of whole (encoded) blocks, de-quantized one tile at a time by the store's own read
        # (which also puts the sink tokens back in full precision); the last tile also takes the staged partial
        # block and this step's tokens.
        start = self.new[0] if self.new is not None else self.end
        enc = start // B  # blocks before position `enc` are full, hence encoded
        first_block = self._first_block()
        if enc <= first:
            k, v = store.read(self.layer_idx, ReadRequest(self.table, self.lo, self.end, B, first_block, self.new))
            yield self.lo, k.transpose(0, 1), v.transpose(0, 1)  # [H, batch, n, dim]
            return
        for j0, j1 in self._tile_ranges(first, enc, tile_tokens):
            last = j1 == enc
            hi = self.end if last else j1 * B
            k, v = store.read(self.layer_idx, ReadRequest(self.table, j0 * B, hi, B, first_block,
                                                          self.new if last else None))
            yield j0 * B, k.transpose(0, 1), v.transpose(0, 1)  # [H, batch, n, dim]

    def fp_parts(self, tile_tokens: int, min_view_blocks: int = 4) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]]:
        """A full-precision store's tokens ``lo .. end - 1`` of every row as parts `(keys, values, columns)`: keys
        `[num_kv_heads, batch, n, key_dim]`, values likewise, and `columns` `[n]` int64 (on the device): each
        token's position minus `lo`. The parts cover the range once, not in token order.

        A run of at least `min_view_blocks` block positions in which every row's ids are consecutive and the rows
        start a fixed number of blocks apart (rows prefilled together: ``row r = base + r * stride``; beams that
        share a prefix: stride 0) is one strided **view** of the pool, copying nothing; the remaining positions
        (blocks of decode steps, interleaved across rows) are gathered, `tile_tokens` per part::

            row 0:  [ 0  1  2 ... 127 | 1024 | 1032 ]      run 0 .. 127: rows 128 blocks apart -> one view
            row 1:  [128 129 ... 255 | 1025 | 1033 ]      positions 128, 129: gathered
        """
        B, idx, first = self.block_size, self.layer_idx, self.lo // self.block_size
        last = -(-self.end // B)
        tbl = self.table[:, first:last]  # [batch, nb] block ids, CPU
        batch, nb = tbl.shape
        along = (tbl[:, 1:] - tbl[:, :-1] == 1).all(0)  # [nb - 1]: position c and c + 1 consecutive in every row
        cuts = [0, *(~along).nonzero().squeeze(1).add(1).tolist(), nb]  # run boundaries
        stride = tbl[1:] - tbl[:-1] if batch > 1 else None  # [batch - 1, nb] block distance between rows
        keys, values = self.store.keys[idx], self.store.values[idx]  # SegmentedTensor [H, slots, dim]
        parts, rest = [], []
        for c0, c1 in zip(cuts[:-1], cuts[1:]):
            step = 0 if stride is None else int(stride[0, c0])
            uniform = stride is None or bool((stride[:, c0] == step).all())
            lo_slot = int(tbl[0, c0]) * B
            hi_slot = int(tbl[-1, c0] + c1 - c0) * B  # one past the last slot the run covers
            if c1 - c0 < min_view_blocks or not uniform or step < 0 or not _one_segment(keys, lo_slot, hi_slot):
                rest.extend(range(c0, c1))
                continue
            p0, p1 = max(self.lo, (first + c0) * B), min(self.end, (first + c1) * B)  # tokens of the run
            kv = []
            for t in (keys, values):
                span = t.narrow(1, lo_slot, hi_slot - lo_slot)  # [H, span, dim]: a view (one segment)
                kv.append(span.as_strided((t.shape[0], batch, p1 - p0, t.shape[2]),
                                          (span.stride(0), step * B * span.stride(1), span.stride(1), 1),
                                          span.storage_offset() + (p0 - (first + c0) * B) * span.stride(1)))
            parts.append((kv[0], kv[1], torch.arange(p0 - self.lo, p1 - self.lo, device=self.spec.device)))
        step = max(1, tile_tokens // B)
        for i in range(0, len(rest), step):  # the other positions, in token order, gathered tile by tile
            cols = rest[i: i + step]
            ids = tbl[:, cols].reshape(-1).to(self.spec.device)  # [batch * len(cols)]
            k, v = (t.index_select_chunks(ids, B).view(t.shape[0], batch, len(cols) * B, t.shape[2])
                    for t in (keys, values))  # [H, batch, len(cols) * B, dim]
            pos = (torch.tensor(cols).add_(first).mul_(B).unsqueeze(1) + torch.arange(B)).reshape(-1)  # [n]
            keep = ((pos >= self.lo) & (pos < self.end)).nonzero().squeeze(1)
            if len(keep) < len(pos):  # a window's first block, the partial last block: cut to lo .. end - 1
                a, b = int(keep[0]), int(keep[-1]) + 1  # (the cut tokens are at the two ends of the part)
                k, v, pos = k[:, :, a:b], v[:, :, a:b], pos[a:b]
            parts.append((k, v, pos.sub_(self.lo).to(self.spec.device)))
        return parts

    def _first_block(self) -> int | None:
        return None if self.base is None else self.base // self.block_size

    def _tile_ranges(self, first: int, last: int, tile_tokens: int) -> Iterator[tuple[int, int]]:
        step = max(1, tile_tokens // self.block_size)
        for j in range(first, last, step):
            yield j, min(last, j + step)

    def _fp_tiles(self, first: int, last: int, tile_tokens: int):
        """Full-precision pages, gathered tile by tile through the block table."""
        B, spec, idx = self.block_size, self.spec, self.layer_idx
        H, batch = spec.num_kv_heads, self.table.shape[0]
        pages = (self.store.keys[idx], self.store.values[idx])  # SegmentedTensor [H, slots, dim] each
        blocks = self.table[:, first:last].to(spec.device)  # [batch, last - first]
        for j0, j1 in self._tile_ranges(first, last, tile_tokens):
            ids = blocks[:, j0 - first: j1 - first].reshape(-1)  # [batch * nb]
            k, v = (p.index_select_chunks(ids, B).view(H, batch, (j1 - j0) * B, p.shape[-1]) for p in pages)
            yield j0 * B, k, v
