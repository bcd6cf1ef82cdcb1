"""Reads of rotated keys in place: the query turned once instead of every key turned back (`RotatedCodec`)."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable


def key_rotation(store, layer_idx: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The orthogonal matrix `R` `[key_dim, key_dim]` (in `dtype`, on the layer's device) that a quantized store's
    key codes were turned by (``codes ~ keys @ R``), or None when its keys are not rotated (or it is not quantized)."""
    codec = getattr(store, "key_codec", None)
    if codec is None or not codec.rotated:
        return None
    spec = store.specs[layer_idx]
    return codec.matrix(spec.key_dim, dtype, spec.device)


def rotate_code_read(read: CodeRead, rotation: torch.Tensor) -> CodeRead:
    """`read` in the rotated basis of its key codes: the full-precision keys (tail, step's tokens, sink) turned by
    `rotation` `[dk, dk]` (`[H, batch, m, dk]`, a few blocks' worth), the key codec replaced by its inner codec (its
    codes are read as stored). With the query turned too, ``(q @ R) . (k @ R) = q . k``: the scores are those of
    the model's basis up to fp rounding, and no key is turned back."""
    kc, vc = read.codecs
    keys = torch.matmul(read.full[0], rotation.to(read.full[0].dtype))  # [H, batch, m, dk]
    return read._replace(codecs=(kc.inner, vc), full=(keys, read.full[1]))


def rotate_code_table(table: CodeTable, rotation: torch.Tensor) -> CodeTable:
    """`table` in the rotated basis of its key codes (as `rotate_code_read`): the staged keys, the step's keys and
    the sink keys turned by `rotation`, the key codec replaced by its inner codec. NOTE: the staged and sink keys
    are the layer's whole staging areas (`[H, slots, dk]`: one block per open sequence), turned as a whole because
    a kernel indexes them by slot."""
    kc, vc = table.codecs

    def turn(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, rotation.to(x.dtype))  # [..., dk] @ [dk, dk]

    staged = None if table.staged is None else (turn(table.staged[0]), table.staged[1])
    new = None if table.new is None else (turn(table.new[0]), table.new[1])
    sinks = None if table.sinks is None else (turn(table.sinks[0]), table.sinks[1])
    return table._replace(codecs=(kc.inner, vc), staged=staged, new=new, sinks=sinks)


__all__ = ["key_rotation", "rotate_code_read", "rotate_code_table"]
