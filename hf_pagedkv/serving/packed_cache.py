"""`PackedCache`: the `transformers.Cache` one engine step hands the model, for a packed batch of many requests.

The step's tokens are packed into one row (batch 1, no padding): request after request, each a decode token or a
chunk of prompt, with its own positions::

    input_ids:    [ a7 | b3 b4 b5 b6 | c0 c1 c2 | d12 ]     segment = one request's tokens of this step
    position_ids: [  7 |  3  4  5  6 |  0  1  2 |  12 ]

Each attention layer calls `update` once with the K/V of every token of the step; the packed cache cuts them per
segment, writes each into its request's own `PagedCache` (which allocates its blocks and returns that request's
whole history, `[1, num_kv_heads, held, head_dim]`), and hands the pieces to the packed attention
(`packed_attention.py`) by tagging the returned keys. So each request attends to exactly its own blocks, and no
padding is computed or stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hf_pagedkv._compat import Cache

_ATTR = "hf_pagedkv_packed"  # the attribute of the keys `PackedCache.update` returns that holds the step's parts


@dataclass(frozen=True)
class PackedSegment:
    """One request's tokens in a packed step."""

    cache: object  # the request's PagedCache
    lo: int  # first token of the segment in the packed row
    hi: int  # one past its last token
    start: int  # tokens the request's cache held before the step (the segment's first position)


class PackedPart(NamedTuple):
    """What one segment's attention reads in one layer (a tuple: one is built per request and layer)."""

    lo: int  # the segment's query tokens in the packed row: lo .. hi - 1
    hi: int
    keys: torch.Tensor  # `[1, num_kv_heads, held, key_dim]`: the request's keys as its cache returned them
    values: torch.Tensor  # `[1, num_kv_heads, held, value_dim]`
    mask: torch.Tensor | None  # `[1, 1, hi - lo, held]` bool (True: attend), or None: causal over the last keys


@dataclass(frozen=True)
class PackedParts:
    """The parts of one layer of a packed step, and how to attend each (attached to the keys `update` returns)."""

    parts: tuple[PackedPart, ...]
    read_in_place: bool  # hand the caches' keys as they are (the "hf_pagedkv" attention may read them in place)


class PackedCache(Cache):
    """The cache of one packed forward step (see the module docstring); built by the engine per step, then dropped.

    Args:
        segments (`list[PackedSegment]`): the step's requests, in packed order, covering the row without gaps.
        read_in_place (`bool`): let the ``"hf_pagedkv"`` attention read decode segments in place (the pool is
            quantized, or the model was configured with it); otherwise each segment attends with `sdpa`.
    """

    is_compileable = False

    def __init__(self, segments: list[PackedSegment], read_in_place: bool = False) -> None:
        super().__init__(layers=[])
        self.segments = segments  # fixed for the step
        self.read_in_place = read_in_place  # fixed
        self._masks: dict[tuple, torch.Tensor | None] = {}  # (q, held, window, device) -> mask, shared by layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write each segment's new K/V into its request's cache and return the packed keys and values, the keys
        tagged with every segment's history (`PackedParts`).

        Args:
            key_states, value_states (`torch.Tensor` of shape `[1, num_kv_heads, num_step_tokens, head_dim]`).
            layer_idx (`int`): the model layer.

        Returns:
            `(key_states, value_states)`, the inputs themselves (the attention reads the tagged parts).
        """
        parts = []
        for seg in self.segments:
            lo, hi = seg.lo, seg.hi
            # the request's history `[1, num_kv_heads, held, dim]`, after writing its `[1, num_kv_heads, q, dim]`
            keys, values = seg.cache.update(key_states[:, :, lo:hi], value_states[:, :, lo:hi], layer_idx)
            mask = None if hi - lo == 1 else self._mask(  # (one query sees every key its cache returned)
                seg.start, hi - lo, keys.shape[-2], seg.cache.layers[layer_idx].sliding_window, keys.device)
            parts.append(PackedPart(lo, hi, keys, values, mask))
        setattr(key_states, _ATTR, PackedParts(tuple(parts), self.read_in_place))
        return key_states, value_states

    def _mask(self, start: int, q: int, held: int, window: int | None, device) -> torch.Tensor | None:
        """Which of the `held` keys (the last one at position ``start + q - 1``) each of the `q` queries (positions
        ``start .. start + q - 1``) sees: causal, and within `window` (a sliding-window layer). None when that is
        every key for one query, or plain causal over as many keys as queries (`sdpa`'s `is_causal`, as `generate`
        runs a prefill).

        The held keys are taken at positions ``end - held .. end - 1``: the request's cache returns its last keys in
        order, and with a retention policy its held keys sit at exactly those virtual positions
        (`PagedLayer.get_mask_sizes`: ``kv_offset + kv_length == end``, the offset counting what the policy evicted).
        The policy evicts only before a step's first layer writes (`Evictor.before_step`), so every held key older
        than the step is seen by every query of it (what it keeps is what attention reads), the step's own keys
        causally, and a sliding-window layer's window counts true positions: the mask `generate` builds with the
        same cache (the engine's tokens equal its tokens when the chunks are the same)."""
        key = (q, held, window, start if window else 0, device)
        if key in self._masks:
            return self._masks[key]
        end = start + q
        mask = None
        if q > 1 and (held != q or (window is not None and q > window)):
            qpos = torch.arange(start, end, device=device)[:, None]  # [q, 1]
            kpos = torch.arange(end - held, end, device=device)[None, :]  # [1, held]
            allowed = kpos <= qpos
            if window is not None:
                allowed &= kpos > qpos - window
            mask = allowed[None, None]  # [1, 1, q, held]
        self._masks[key] = mask
        return mask

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed step has no one length (each request's is in its own cache; the engine passes positions)."""
        return 0


def packed_parts(key: torch.Tensor) -> PackedParts | None:
    """The parts `PackedCache.update` attached to `key`, or None for keys of any other cache."""
    return getattr(key, _ATTR, None)


__all__ = ["PackedCache", "PackedPart", "PackedParts", "PackedSegment", "packed_parts"]
