"""The read path of `QuantizedPageStore`: de-quantize a row's encoded blocks, then add its staged and new tokens."""

from __future__ import annotations

import torch


class QuantizedReadMixin:
    """Mixed into `QuantizedPageStore` (see its docstring for the layout and block states)."""

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
        partial = table[:, start // B].tolist() if rest else None  # each row's partial block
        n_sink = min(self.sink_tokens, start) if first == 0 else 0  # tokens read from the sink, in full precision
        sinks = [self._sink_of.get(b) for b in table[:, 0].tolist()] if n_sink else None  # each row's sink stage
        if sinks is not None and None in sinks:  # retention freed the first block: its successor is read decoded
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

    def _read_sinks(self, layer_idx: int, half: int, stages: list[int], n: int, out: torch.Tensor) -> None:
        """The first `n` tokens of each row from its sink stage (`stages`, one per row) into `out`
        `[num_kv_heads, batch, >= n, dim]`."""
        store = (self.sinks.keys, self.sinks.values)[half]
        if len(stages) == 1:
            out[:, 0, :n].copy_(self.sinks.block(store, layer_idx, stages[0])[:, :n])
            return
        idx = torch.tensor(stages, device=out.device)
        out[:, :, :n] = self.sinks.blocks(store, layer_idx)[:, idx, :n]  # [num_kv_heads, batch, n, dim]

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
