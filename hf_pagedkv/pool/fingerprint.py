"""The identity a prefix is hashed under: a digest of the model's weights and config, plus the pool's storage format.

Two blocks share a prefix-index entry only when their tokens and this key match, so a published block is never
reused by another model or another quantization.
"""

from __future__ import annotations

import hashlib
import threading
import weakref

import torch

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


__all__ = ["model_fingerprint", "prefix_key"]
