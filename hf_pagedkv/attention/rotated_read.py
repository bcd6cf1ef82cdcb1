"""Reads of rotated codes in place: for rotated keys the query turned once instead of every key turned back; for
rotated values the output turned back once instead of every value (`RotatedCodec`)."""

from __future__ import annotations

import torch

from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable


def _rotation(store, half: str, layer_idx: int, dtype: torch.dtype) -> torch.Tensor | None:
    codec = getattr(store, f"{half}_codec", None)
    if codec is None or not codec.rotated:
        return None
    spec = store.specs[layer_idx]
    return codec.matrix(getattr(spec, f"{half}_dim"), dtype, spec.device)


def key_rotation(store, layer_idx: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The orthogonal matrix `R` `[key_dim, key_dim]` (in `dtype`, on the layer's device) that a quantized store's
    key codes were turned by (``codes ~ keys @ R``), or None when its keys are not rotated (or it is not quantized)."""
    return _rotation(store, "key", layer_idx, dtype)


def value_rotation(store, layer_idx: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The orthogonal matrix `R` `[value_dim, value_dim]` that a quantized store's value codes were turned by
    (``codes ~ values @ R``), or None when its values are not rotated (or it is not quantized). An attention over
    the codes as stored gives ``p @ (V R) = (p @ V) R``: turn its output back by ``R.T``."""
    return _rotation(store, "value", layer_idx, dtype)


def turn(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """Rows `x` `[..., d]` turned by `rotation` `[d, d]` (``x @ R``, in `x`'s dtype), or `x` itself for None."""
    return x if rotation is None else torch.matmul(x, rotation.to(x.dtype))


def _inner(codec, rotation: torch.Tensor | None):
    return codec if rotation is None else codec.inner


def rotate_code_read(read: CodeRead, rotation: torch.Tensor | None,
                     values: torch.Tensor | None = None) -> CodeRead:
    """`read` in the rotated basis of its codes: the full-precision keys (tail, step's tokens, sink) turned by
    `rotation` `[dk, dk]` and the full-precision values by `values` `[dv, dv]` (`[H, batch, m, d]`, a few blocks'
    worth; either None: that half is not rotated), each rotated codec replaced by its inner codec (its codes are
    read as stored). With the query turned too, ``(q @ R) . (k @ R) = q . k``: the scores are those of the model's
    basis up to fp rounding, and no key is turned back; the attention output is ``(p @ V) @ values``, to turn back
    by ``values.T`` once."""
    kc, vc = read.codecs
    full = (turn(read.full[0], rotation), turn(read.full[1], values))
    return read._replace(codecs=(_inner(kc, rotation), _inner(vc, values)), full=full)


def rotate_code_table(table: CodeTable, rotation: torch.Tensor | None,
                      values: torch.Tensor | None = None, turn_keys: bool = True) -> CodeTable:
    """`table` in the rotated basis of its codes (as `rotate_code_read`): the staged, the step's and the sink keys
    turned by `rotation` and values by `values` (either None: not rotated), each rotated codec replaced by its
    inner codec. NOTE: the staged and sink K/V are the layer's whole staging areas (`[H, slots, d]`: one block per
    open sequence), turned as a whole because a kernel indexes them by slot. `turn_keys=False` leaves the
    full-precision keys as they are (the key codec still its inner one), for a kernel that scores them with the
    query before its turn (`NativeCodeAttention.read_table` with `rotation`): none of those matrix products then."""
    kc, vc = table.codecs
    keys = rotation if turn_keys else None

    def turn_pair(pair):
        return None if pair is None else (turn(pair[0], keys), turn(pair[1], values))

    return table._replace(codecs=(_inner(kc, rotation), _inner(vc, values)), staged=turn_pair(table.staged),
                          new=turn_pair(table.new), sinks=turn_pair(table.sinks))


__all__ = ["key_rotation", "rotate_code_read", "rotate_code_table", "turn", "value_rotation"]
