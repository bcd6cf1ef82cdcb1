"""Prefix caching for `PagedCache`: token rows, hit lengths over layer groups, publishing (the key that the index
hashes under is `pool/fingerprint.py`'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hf_pagedkv.blocks.prefix_index import hash_blocks
from hf_pagedkv.errors import EMPTY_PROMPT
from hf_pagedkv.pool.fingerprint import model_fingerprint, prefix_key

if TYPE_CHECKING:  # type-only: the functions take tables, never build them
    from hf_pagedkv.adapter.row_tables import RowTables


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


def one_prompt(input_ids, caller: str) -> list[int]:
    """The ids of the one prompt `input_ids` holds (`token_rows`).

    Raises:
        ValueError: not token ids, empty, or more than one row.
    """
    rows = token_rows(input_ids)
    if not rows or rows == [[]]:
        raise ValueError(f"{caller}: {EMPTY_PROMPT}.")
    if len(rows) != 1:
        raise ValueError(f"{caller.split('.')[-1]} takes one non-empty prompt, got {len(rows)} rows; attach rows one "
                         "by one (hf_pagedkv.generate does).")
    return rows[0]


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
            hit = min(hit, len(pool.groups[rt.group].match_prefix(hashes[:hit])))
    for rt in groups:
        while rt.window is not None and hit:
            lo = rt.droppable(hit * B)
            if len(pool.groups[rt.group].match_prefix(hashes[lo:hit])) == hit - lo:
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
    pads = {rt.group: pool.groups[rt.group].pad_block for rt in groups}
    for r, ids in enumerate(rows):
        if any(pads[rt.group] is not None and pads[rt.group] in rt.rows[r].blocks for rt in groups):
            continue
        n = min(len(ids), written)
        hashes = hash_blocks(ids[:n], pool.block_size, key)
        for rt in groups:
            row = rt.rows[r]
            mine = hashes[row.num_dropped: max_blocks]  # held positions below max_blocks (None: all)
            with pool.lock:
                published += pool.groups[rt.group].publish(mine, row.blocks[: len(mine)])
    return published


__all__ = ["hash_blocks", "hit_length", "model_fingerprint", "one_prompt", "prefix_key", "publish_rows", "token_rows"]
