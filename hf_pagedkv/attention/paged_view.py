"""`PagedView`: where one layer's K/V of one forward step lie in the pool, for an attention that reads them in place."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.read_request import ReadRequest

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
    """

    def __init__(self, store, layer_idx: int, table: torch.Tensor, lo: int, end: int, base: int | None,
                 new: tuple | None, materialize: Callable, confirm: Callable) -> None:
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

    # -- codes ------------------------------------------------------------------------------------------------
    def code_read(self) -> CodeRead | None:
        """A quantized store's tokens ``lo .. end - 1`` as codes and scales (`QuantizedPageStore.read_codes`), for
        an attention that de-quantizes inside its products; None for a full-precision store, or when no encoded
        block lies in the range (read `chunks` then)."""
        if not self.store.is_quantized:
            return None
        return self.store.read_codes(self.layer_idx, ReadRequest(self.table, self.lo, self.end, self.block_size,
                                                                 self._first_block(), self.new))

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
