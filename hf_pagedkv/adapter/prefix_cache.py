"""`PrefixMixin`: the prefix-caching half of `PagedCache` -- attach to cached blocks, publish full blocks."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from typing_extensions import Self

import torch

from hf_pagedkv.pool.block_table import BlockTable
from hf_pagedkv.errors import EMPTY_PROMPT
from hf_pagedkv.pool.prefix_index import hash_blocks

if TYPE_CHECKING:
    from hf_pagedkv.block_pool import BlockPool

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


def prefix_key(pool: BlockPool, model=None, config=None) -> bytes:
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


class PrefixMixin:
    """Mixed into `PagedCache`: requests that share a prompt prefix share its full blocks.

    A cache from `from_prefix` starts holding the longest cached full-block prefix of its prompt, so the model
    computes only the rest; `publish` names this cache's full blocks in the pool's prefix index for later
    requests. Only full blocks, fully written in every layer, are ever published, and a published block is copied
    before any write (copy-on-write), so a hit reads exactly the K/V a fresh computation would produce (up to
    floating-point reassociation between a long and a short prefill, which depends on the CPU's kernels: fp32
    logits agree within 1e-4)::

        prompt:  [ b3: t0..t3 | b9: t4..t7 | t8 t9 ]    cached full blocks (hit) | computed by the model
                   hit          hit           computed   (at least one token is always computed)
    """

    _prefix_key: bytes | None = None  # model + format identity for the prefix index; set once by from_prefix
    _publish_at_next_step: list[int] | None = None  # a prompt to publish before sliding groups free its blocks

    @classmethod
    def from_prefix(cls, pool: BlockPool, input_ids, model=None, **kwargs) -> Self:
        """A cache attached to the longest cached full-block prefix of `input_ids` in `pool`.

        At least one token is always left to compute (the model needs it to produce logits): a prompt of exactly
        ``k * block_size`` tokens hits at most ``k - 1`` blocks. Pass the whole prompt to `model.generate` (or
        `model(...)` the tokens from `cache.get_seq_length()` on): transformers skips the cached part.

        Args:
            pool (`BlockPool`): a pool created with `prefix_caching=True`.
            input_ids (`torch.LongTensor` of shape `[1, seq_len]` or `[seq_len]`, or a list of ints): the prompt,
                without padding.
            model (`PreTrainedModel`, *optional*): the model that will run; its weights' fingerprint keys the index
                (so two models never share blocks) and its config builds the layers. Without it, pass `config=`;
                the config alone then identifies the model, so do not share the pool with another model that has
                the same config.
            kwargs: passed to `PagedCache` (`config`, `debug`).

        Returns:
            `PagedCache` holding one row of ``hit_blocks * block_size`` tokens.

        Raises:
            ValueError: the pool has no prefix caching; neither `model` nor `config`; `input_ids` not one row, or
                empty.

        Example:

        ```python
        >>> pool = BlockPool(prefix_caching=True)
        >>> cache = PagedCache.from_prefix(pool, input_ids, model=model)
        >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
        >>> cache.publish(out)      # later requests sharing this prefix skip it
        >>> cache.release()
        ```
        """
        if getattr(pool, "prefix_index", None) is None:
            raise ValueError("from_prefix needs a pool created with BlockPool(prefix_caching=True).")
        if model is not None:
            kwargs.setdefault("config", model.config)
        if kwargs.get("config") is None:
            raise ValueError("from_prefix needs `model=` (or `config=`) to build the cache's layers up front.")
        rows = token_rows(input_ids)
        if not rows or rows == [[]]:
            raise ValueError(f"PagedCache.from_prefix: {EMPTY_PROMPT}.")
        if len(rows) != 1:
            raise ValueError(f"from_prefix takes one non-empty prompt, got {len(rows)} rows; attach rows one by "
                             "one (hf_pagedkv.generate does).")
        ids = rows[0]
        cache = cls(pool=pool, **kwargs)
        cache._prefix_key = prefix_key(pool, model, kwargs["config"])
        hashes = hash_blocks(ids[: len(ids) - 1], pool.block_size, cache._prefix_key)  # leave >= 1 token to compute
        with pool.lock:  # references and the table that names them appear together (invariant 2)
            if pool.host is not None:  # prefix blocks in the host tier are copied back before any read
                pool.host.promote(hashes, [rt.group for rt in cache._groups])
            hit = cache._hit_length(hashes)
            held = {}
            for k, rt in enumerate(cache._groups):  # the first group counts the lookup (one per request)
                lo = rt.droppable(hit * pool.block_size)
                held[rt.group] = (lo, pool.acquire_prefix(hashes[lo:hit], len(ids), group=rt.group, count=k == 0))
            cache._attach(hit, held)
        if any(rt.window is not None for rt in cache._groups):
            # NOTE: a sliding group frees the prompt's early blocks as soon as decoding starts, long before a
            # caller publishes; so the prompt is published when the step after the prompt begins (`_extend`).
            cache._publish_at_next_step = ids
        return cache

    def _hit_length(self, hashes: list) -> int:
        """Full blocks of `hashes` every layer group can serve: a full-attention group needs the whole prefix, a
        sliding-window group only the blocks of the window before the hit point (its earlier blocks were freed
        and may be gone, which shortens the hit)."""
        pool, B = self.pool, self.block_size
        hit = len(hashes)
        for rt in self._groups:
            if rt.window is None:
                hit = min(hit, len(pool.match_prefix(hashes[:hit], rt.group)))
        for rt in self._groups:
            while rt.window is not None and hit:
                lo = rt.droppable(hit * B)
                if len(pool.match_prefix(hashes[lo:hit], rt.group)) == hit - lo:
                    break
                hit -= 1
        return hit

    def _attach(self, hit: int, held: dict[int, tuple[int, list[int]]]) -> None:
        """Start this (empty) cache as one row of `hit` full blocks: per group, `(dropped positions, blocks)`
        (already referenced for this row)."""
        n = hit * self.block_size
        for group in held:  # a cache built without config starts its (full-attention) group here
            if group not in self._by_group:
                self._tables_for(self.pool.groups[group].window)
        for rt in self._groups:
            lo, blocks = held[rt.group]
            row = BlockTable(num_dropped=lo)
            row.append(blocks)
            row.num_tokens = n
            rt.reset(0)
            rt.rows.append(row)
            rt.table = torch.zeros((1, 0), dtype=torch.long)
            rt.set_row(0, lo)  # [1, hit]
        self._num_tokens = n
        for layer in self._paged_layers():
            layer.num_tokens = n
        self._after_change()

    def publish(self, input_ids, model=None) -> int:
        """Publish this cache's full blocks in the pool's prefix index, so later requests can attach to them.

        Row `r` must hold the K/V of ``input_ids[r][:n]`` (no padding), e.g. the prompt, or the sequences
        `generate` returned (the cache holds all but their last token). A single row of ids with a cache of
        several rows (beams, `num_return_sequences`) publishes row 0. Only blocks whose tokens every layer has
        written are published, so an exception in the middle of a forward pass publishes nothing half-written.

        Args:
            input_ids (`torch.LongTensor` of shape `[rows, seq_len]` or `[seq_len]`, or lists of ints).
            model (`PreTrainedModel`, *optional*): for a cache not made by `from_prefix`, the model that filled it.

        Returns:
            `int`: blocks newly published.

        Raises:
            ValueError: the pool has no prefix caching; the cache was not built with a config (its layer count is
                unknown); the number of rows does not match; a block already published for other tokens.
        """
        self.check_usable()
        pool = self.pool
        if pool.prefix_index is None:
            raise ValueError("publish needs a pool created with BlockPool(prefix_caching=True).")
        if self._num_layers is None:
            raise ValueError("publish needs a cache built with config= (or by from_prefix), so it knows every "
                             "layer has written a block before publishing it.")
        if self._prefix_key is None:
            if model is None:
                raise ValueError("publish on a cache not made by from_prefix needs `model=` (the model that filled "
                                 "it) to key the prefix index.")
            self._prefix_key = prefix_key(pool, model)
        pool.note_prefix_key(self._prefix_key)  # what save_prefix_cache records as the blocks' model key
        rows = token_rows(input_ids)
        if len(rows) == 1 and len(self._rows) > 1:
            rows = rows + [[]] * (len(self._rows) - 1)  # row 0 holds the shared prompt
        if len(rows) != len(self._rows):
            raise ValueError(f"publish got {len(rows)} rows of ids for a cache of {len(self._rows)} rows.")
        layers = self._paged_layers()
        written = min([layer.num_tokens for layer in layers] + [self._num_tokens]) if layers else 0
        published = 0
        for r, ids in enumerate(rows):
            n = min(len(ids), written)
            hashes = hash_blocks(ids[:n], self.block_size, self._prefix_key)
            for rt in self._groups:  # a sliding group publishes the full blocks it still holds
                row = rt.rows[r]
                mine = hashes[row.num_dropped:]
                published += pool.publish_blocks(mine, row.blocks[: len(mine)], group=rt.group)
        return published
