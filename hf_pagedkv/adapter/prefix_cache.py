"""Prefix caching for `PagedCache`: the model fingerprint that keys the index, hit lengths over layer groups, publishing."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hf_pagedkv.pool.prefix_index import hash_blocks

if TYPE_CHECKING:  # type-only: the functions take tables, never build them
    from hf_pagedkv.adapter.row_tables import RowTables

_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (tensor states, digest)
_fingerprints_lock = threading.Lock()


def model_fingerprint(model) -> bytes:
    """A digest of what a model computes K/V from: its class, config and the bytes of every parameter and buffer.

    Computed once per model object (about 0.4 s per 100M fp32 parameters) and recomputed when a parameter or buffer
    is modified in place (torch's version counter changes) or another tensor takes its place (a new `Parameter`, or
    ``p.data = t``: its storage address changes).

    Args:
        model (`PreTrainedModel` or `torch.nn.Module`).

    Returns:
        `bytes`: a 20-byte digest; equal for two copies of the same weights.

    NOTE: under tensor parallelism (`from_pretrained(..., tp_plan="auto")`) the parameters are `DTensor`s; each rank
    hashes its own shard (`to_local()`), which is what its K/V are computed from, so no rank gathers the others'
    weights. The ranks' digests differ, but each rank's prefix index sees the same publishes and lookups, so hits
    and misses (and the blocks they decide) are the same on every rank.

    NOTE: a write through ``p.data`` (``p.data.add_(x)``) bumps neither p's version counter nor its address, so it
    goes unseen; write under ``torch.no_grad()`` instead (as `load_state_dict` and optimizers do).
    """
    named = list(model.named_parameters()) + list(model.named_buffers())
    states = tuple(_state(t) for _, t in named)
    with _fingerprints_lock:
        known = _fingerprints.get(model)
    if known is not None and known[0] == states:
        return known[1]
    h = hashlib.sha1(usedforsecurity=False)  # an identity check, not a security boundary
    h.update(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    for name, t in named:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        t = _local(t)
        if t.device.type != "meta":
            h.update(f"local:{tuple(t.shape)}".encode())
            h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())  # raw bytes [numel * itemsize]
    digest = h.digest()
    with _fingerprints_lock:
        _fingerprints[model] = (states, digest)
    return digest


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: the local shard of a `DTensor` (tensor parallel), else `t` itself."""
    to_local = getattr(t, "to_local", None)  # DTensor; an attribute check keeps torch.distributed optional
    return to_local() if callable(to_local) else t


def _state(t: torch.Tensor) -> tuple[int, int]:
    """What tells whether `t` changed since it was hashed: its storage address (another tensor swapped in: a new
    `Parameter` starts at version 0 again, and ``p.data = t`` keeps p's counter) and its version counter (an
    in-place write)."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be modified in place)
        version = -1
    return _local(t).data_ptr(), version


def prefix_key(pool, model=None, config=None) -> bytes:
    """Everything besides the tokens that decides a block's K/V: the model (its fingerprint, or its config when
    only a config is given) and the pool's storage format (quantization)."""
    if model is not None:
        ident = model_fingerprint(model)
    else:
        ident = b"config:" + config.to_json_string(use_diff=False).encode()
    # NOTE: the storage format (QuantConfig, or None for full precision) changes the K/V a block holds.
    codec = repr(getattr(pool, "quant", None)).encode()
    return hashlib.blake2b(ident + b"|" + codec, digest_size=16).digest()


def token_rows(input_ids, name: str = "input_ids") -> list[list[int]]:
    """`input_ids` as a list of rows of ints: a `[batch, seq_len]` / `[seq_len]` tensor or nested lists.

    Raises:
        ValueError: not 1-D or 2-D, or not integers.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2) or input_ids.is_floating_point():
            raise ValueError(f"`{name}` must be integer token ids of shape [batch, seq_len] or [seq_len], got "
                             f"{input_ids.dtype} of shape {tuple(input_ids.shape)}.")
        ids = input_ids.tolist()
        return [ids] if input_ids.dim() == 1 else ids
    if isinstance(input_ids, Sequence) and input_ids and all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)]
    if isinstance(input_ids, Sequence) and all(isinstance(r, Sequence) and all(isinstance(t, int) for t in r)
                                               for r in input_ids):
        return [list(r) for r in input_ids]
    raise ValueError(f"`{name}` must be token ids ([batch, seq_len] or [seq_len]), got {type(input_ids).__name__}.")


def hit_length(pool, groups: list[RowTables], hashes: list) -> int:
    """Full blocks of `hashes` every layer group of a cache can serve from `pool`'s prefix index: a full-attention
    group needs the whole prefix, a sliding-window group only the blocks of the window before the hit point (its
    earlier blocks were freed and may be gone, which shortens the hit).

    A hit reads exactly the K/V a fresh computation would produce (up to floating-point reassociation between a
    long and a short prefill, which depends on the CPU's kernels: fp32 logits agree within 1e-4)::

        prompt:  [ b3: t0..t3 | b9: t4..t7 | t8 t9 ]    cached full blocks (hit) | computed by the model
                   hit          hit           computed   (at least one token is always computed)
    """
    B = pool.block_size
    hit = len(hashes)
    for rt in groups:
        if rt.window is None:
            hit = min(hit, len(pool.match_prefix(hashes[:hit], rt.group)))
    for rt in groups:
        while rt.window is not None and hit:
            lo = rt.droppable(hit * B)
            if len(pool.match_prefix(hashes[lo:hit], rt.group)) == hit - lo:
                break
            hit -= 1
    return hit


def publish_rows(pool, groups: list[RowTables], rows: list[list[int]], written: int, key: bytes,
                 max_blocks: int | None = None) -> int:
    """Publish the full blocks of each row (row `r` holds the K/V of ``rows[r][:written]``) in every layer group
    (a sliding group publishes the full blocks it still holds), of a row only the held positions below `max_blocks`
    (a retention policy's intact blocks: later ones hold other tokens). A row that names the pad block holds left
    padding (`PagedCache.set_padding`): its blocks are aligned to the padding, not to its tokens, so it publishes
    nothing. Returns the blocks newly published.

    Raises:
        ValueError: a block already published for other tokens.
    """
    published = 0
    pads = {rt.group: pool.pad_block(rt.group) for rt in groups}
    for r, ids in enumerate(rows):
        if any(pads[rt.group] is not None and pads[rt.group] in rt.rows[r].blocks for rt in groups):
            continue
        n = min(len(ids), written)
        hashes = hash_blocks(ids[:n], pool.block_size, key)
        for rt in groups:
            row = rt.rows[r]
            mine = hashes[row.num_dropped: max_blocks]  # held positions below max_blocks (None: all)
            published += pool.publish_blocks(mine, row.blocks[: len(mine)], group=rt.group)
    return published


__all__ = ["hash_blocks", "hit_length", "model_fingerprint", "prefix_key", "publish_rows", "token_rows"]
