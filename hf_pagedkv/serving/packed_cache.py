"""`PackedCache`: the `transformers.Cache` one engine step hands the model, for a packed batch of many requests.

The step's tokens are packed into one row (batch 1, no padding): request after request, each a decode token or a
chunk of prompt, with its own positions::

    input_ids:    [ a7 | b3 b4 b5 b6 | c0 c1 c2 | d12 ]     segment = one request's tokens of this step
    position_ids: [  7 |  3  4  5  6 |  0  1  2 |  12 ]

Each attention layer calls `update` once with the K/V of every token of the step; the packed cache cuts them per
segment, writes each into its request's own `PagedCache` (which allocates its blocks and returns that request's
whole history, `[1, num_kv_heads, held, head_dim]`), and hands the pieces to the packed attention
(`packed_attention.py`) by tagging the returned keys. So each request attends to exactly its own blocks, and no
padding is computed or stored. The step's first layer goes through each request's `PagedCache.update` (which plans
the request's step: blocks, evictions); from the next layer on, the requests with one full-precision row and no
retention policy are written in **one** store write per layer (`PackedWrites`, the slot mapping concatenated once
per step) and read as views of their blocks, with no per-request Python beyond the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hf_pagedkv._compat import Cache
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.storage.heap import trim_after_step

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
        # layer group -> its `PackedWrites` (None: every segment through its cache's `update`), built at the
        # group's first layer after the step's first layer planned every request's step
        self._writes: dict[int, PackedWrites | None] = {}
        self._planned = False  # the step's first layer ran (each request's cache planned its step)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write each segment's new K/V into its request's cache and return the packed keys and values, the keys
        tagged with every segment's history (`PackedParts`).

        Args:
            key_states, value_states (`torch.Tensor` of shape `[1, num_kv_heads, num_step_tokens, head_dim]`).
            layer_idx (`int`): the model layer.

        Returns:
            `(key_states, value_states)`, the inputs themselves (the attention reads the tagged parts).
        """
        writes = self._writes_for(key_states, value_states, layer_idx)
        if writes is not None:
            parts = writes.update(key_states, value_states, layer_idx)
        else:
            parts = [self._update_one(seg, key_states, value_states, layer_idx) for seg in self.segments]
        self._planned = True
        setattr(key_states, _ATTR, PackedParts(tuple(parts), self.read_in_place))
        return key_states, value_states

    def _update_one(self, seg: PackedSegment, key_states: torch.Tensor, value_states: torch.Tensor,
                    layer_idx: int) -> PackedPart:
        """One segment through its cache's `update`: writes its `[1, num_kv_heads, q, dim]`, reads its history."""
        lo, hi = seg.lo, seg.hi
        # the request's history `[1, num_kv_heads, held, dim]`, after writing its `[1, num_kv_heads, q, dim]`
        keys, values = seg.cache.update(key_states[:, :, lo:hi], value_states[:, :, lo:hi], layer_idx)
        mask = None if hi - lo == 1 else self._mask(  # (one query sees every key its cache returned)
            seg.start, hi - lo, keys.shape[-2], seg.cache.layers[layer_idx].sliding_window, keys.device)
        return PackedPart(lo, hi, keys, values, mask)

    def _writes_for(self, key_states: torch.Tensor, value_states: torch.Tensor,
                    layer_idx: int) -> PackedWrites | None:
        """The `PackedWrites` of `layer_idx`'s group, built at its first layer after the step's first (which plans
        every request's step through `update`); None: every segment goes through `update` (in-place reads,
        autograd, or no request qualifies)."""
        if not self._planned or self.read_in_place or key_states.requires_grad or not self.segments:
            return None
        layers = self.segments[0].cache.layers
        if layer_idx >= len(layers):
            return None
        group = getattr(layers[layer_idx], "group", None)
        if group is None:
            return None
        if group not in self._writes:
            self._writes[group] = PackedWrites.build(self, key_states, value_states, layer_idx)
        return self._writes[group]

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


class PackedWrites:
    """One layer group's writes and reads in a packed step, for every request at once: the new K/V of the requests
    that qualify (`StepIO`: one full-precision row, no retention policy) go to their slots in **one** `store.write`
    per layer, with the slot mapping concatenated once for the step, and each one's history is read as a view of its
    consecutive blocks (gathered otherwise); the others go through their cache's `update` as usual. The same K/V
    land in the same slots and the same history is read as through `update` (the tokens are the same).

    Args:
        packed (`PackedCache`): the step (its segments and masks).
        ios (`list[StepIO | None]`): per segment, its `StepIO` in this group, or None (through `update`); one at least.
        layer_idx (`int`): a layer of the group.
        fresh (`list[int]`): the segments (with a `StepIO`) whose layers are set up by this step.
    """

    def __init__(self, packed: PackedCache, ios: list, layer_idx: int, fresh: list[int] = ()) -> None:
        self.packed = packed  # fixed
        self.ios = ios  # per segment; fixed
        self.fresh = fresh  # segments in their request's first step: each layer's spec is fixed before its write
        fast = [i for i, io in enumerate(ios) if io is not None]
        segs = packed.segments
        self.store = ios[fast[0]].store  # the pool's store of this group (one pool: the same for every request)
        self.lock = segs[fast[0]].cache.pool.lock  # a growing pool replaces its tensors: writes hold its lock
        self.slots = torch.cat([ios[i].slots for i in fast])  # [tokens written here] in packed order
        # the packed positions of those tokens, or None when they are every token of the row
        self.tokens = None if len(fast) == len(segs) else torch.cat(
            [torch.arange(segs[i].lo, segs[i].hi, device=self.slots.device) for i in fast])
        self.longest = max(segs[i].hi - segs[i].lo for i in fast)  # tokens of the longest row written here
        self.masks = {}  # segment -> its mask, the same for every layer of the group (as `PackedCache._mask`)
        for i in fast:
            seg, io = segs[i], ios[i]
            q = seg.hi - seg.lo
            if q > 1:
                window = seg.cache.layers[layer_idx].sliding_window
                self.masks[i] = packed._mask(seg.start, q, io.end - io.lo, window, self.slots.device)

    @classmethod
    def build(cls, packed: PackedCache, key_states: torch.Tensor, value_states: torch.Tensor,
              layer_idx: int) -> PackedWrites | None:
        """The group of `layer_idx` (its first layer in the step, K/V `[1, num_kv_heads, num_step_tokens, dim]`), or
        None when no segment qualifies."""
        ios, fresh = [], []
        for seg in packed.segments:
            layer = seg.cache.layers[layer_idx] if layer_idx < len(seg.cache.layers) else None
            if not isinstance(layer, PagedLayer):
                ios.append(None)
                continue
            if not layer.is_initialized:  # a request's first step: its layer's spec, as its first `update` fixes it
                layer.lazy_initialization(key_states[:, :, seg.lo: seg.hi], value_states[:, :, seg.lo: seg.hi])
                fresh.append(len(ios))
            ios.append(seg.cache.runner.step_io(layer))
        stores = {id(io.store) for io in ios if io is not None}
        return cls(packed, ios, layer_idx, [i for i in fresh if ios[i] is not None]) if len(stores) == 1 else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> list[PackedPart]:
        """`PackedCache.update` of one layer of the group: the parts, in packed order."""
        k, v = key_states, value_states  # [1, num_kv_heads, num_step_tokens, dim]
        for i in self.fresh:  # (a request's first step: as its first `update` would, before the write)
            seg, layer = self.packed.segments[i], self.packed.segments[i].cache.layers[layer_idx]
            if not layer.is_initialized:
                layer.lazy_initialization(k[:, :, seg.lo: seg.hi], v[:, :, seg.lo: seg.hi])
        if self.tokens is not None:
            k, v = k.index_select(2, self.tokens), v.index_select(2, self.tokens)  # [1, heads, written, dim]
        with self.lock:
            self.store.write(layer_idx, self.slots, k, v)
        trim_after_step(self.longest, key_states.device)  # as `PagedCache.update`: the previous layer's temporaries
        parts = []
        for i, (seg, io) in enumerate(zip(self.packed.segments, self.ios)):
            if io is None:
                parts.append(self.packed._update_one(seg, key_states, value_states, layer_idx))
                continue
            layer = seg.cache.layers[layer_idx]
            io.written(layer)
            keys, values = io.read(layer)  # [1, num_kv_heads, held, dim] each
            parts.append(PackedPart(seg.lo, seg.hi, keys, values, self.masks.get(i)))
        return parts


def packed_parts(key: torch.Tensor) -> PackedParts | None:
    """The parts `PackedCache.update` attached to `key`, or None for keys of any other cache."""
    return getattr(key, _ATTR, None)


__all__ = ["PackedCache", "PackedPart", "PackedParts", "PackedSegment", "PackedWrites", "packed_parts"]
