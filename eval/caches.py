"""The caches a drift run compares: the `DynamicCache` baseline, `PagedCache` presets and `QuantizedCache` references.

Besides building them, this module answers the two questions every config is measured on, whatever its kind:
how many bytes it holds (`bytes_held`) and what it gives back for the keys/values it was given (`read_back`,
compared with what `record_writes` saw going in).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
from collections.abc import Callable

import torch
from transformers import DynamicCache

import hf_pagedkv
from hf_pagedkv import PagedCache
from hf_pagedkv.tools.verify import dynamic_cache_bytes, tensor_bytes

from .config import PAGED_CONFIGS, REFERENCE_CONFIGS, EvalConfig

logger = logging.getLogger(__name__)

BASELINE = "baseline"
_BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


def describe(name: str, cfg: EvalConfig) -> str:
    """What a config name stands for, for the report."""
    if name == BASELINE:
        return "transformers `DynamicCache` (unquantized, the reference)"
    size = "" if cfg.block_size is None else f", block_size={cfg.block_size}"
    if name == "fp":
        return f"`PagedCache(config=config{size})`, unquantized"
    if name in PAGED_CONFIGS:
        bits = re.fullmatch(r"k(\d+)v(\d+)", name)
        ablation = (" -- keys get fewer bits than values: an ablation (keys are the fragile half; the ladder "
                    "quantizes values first)") if bits and int(bits[1]) < int(bits[2]) else ""
        return f"`PagedCache(config=config, quant={name!r}{size})`{ablation}"
    backend, nbits = _reference(name)
    return (f"transformers `QuantizedCache(backend={backend!r}, nbits={nbits}, q_group_size={cfg.qc_group_size}, "
            f"residual_length={cfg.qc_residual_length})`")


def _reference(name: str) -> tuple[str, int]:
    backend, bits = name.split("-int")
    return backend, int(bits)


def unavailable_reason(name: str, cfg: EvalConfig, model_config) -> str | None:
    """`None` if `name` can be built here, else a one-line reason ("not available: ...") for its report row. This
    package's own configs (`PAGED_CONFIGS`) always build; only a `QuantizedCache` backend may be missing here."""
    if name == BASELINE or name in PAGED_CONFIGS:
        return None
    backend, _ = _reference(name)
    module, package = _BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        return f"not available: QuantizedCache backend {backend!r} needs `pip install {package}`"
    try:
        cache = build(name, cfg, model_config)
    except Exception as exc:  # an incompatible backend version, ...
        return f"not available: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    release(cache)
    return None


def build(name: str, cfg: EvalConfig, model_config):
    """A fresh, empty cache for config `name` (or `BASELINE`).

    Raises:
        ValueError: an unknown config name.
    """
    if name == BASELINE:
        return DynamicCache(config=model_config)
    if name == "fp":
        return PagedCache(block_size=cfg.block_size, config=model_config)
    if name in PAGED_CONFIGS:  # block_size None: PagedCache's default
        return PagedCache(block_size=cfg.block_size, config=model_config, quant=_paged_quant(name))
    if name in REFERENCE_CONFIGS:
        from transformers import QuantizedCache

        backend, nbits = _reference(name)
        return QuantizedCache(backend=backend, config=model_config, nbits=nbits, q_group_size=cfg.qc_group_size,
                              residual_length=cfg.qc_residual_length)
    allowed = ", ".join((BASELINE,) + PAGED_CONFIGS + REFERENCE_CONFIGS)
    raise ValueError(f"unknown cache config {name!r}; allowed: {allowed}")


def _paged_quant(name: str):
    """The `QuantConfig` of preset `name`.

    NOTE: a run names a keys-first preset (`k4v8`) on purpose, as an ablation, and the report says so once
    (`describe`); hf_pagedkv's warning against that setting (meant for real misuse) is silenced here.
    """
    log = logging.getLogger("hf_pagedkv.config")
    disabled, log.disabled = log.disabled, True
    try:
        return hf_pagedkv.QuantConfig.preset(name)
    finally:
        log.disabled = disabled


def release(cache) -> None:
    """Give a `PagedCache`'s blocks back to its pool (other caches are left to the garbage collector)."""
    if isinstance(cache, PagedCache):
        cache.release()


def snapshot(cache):
    """An independent cache in the same state, to branch a second continuation off one prefill.

    `PagedCache`: `fork()` (shares the blocks, copy-on-write). `DynamicCache`: a deep copy. `QuantizedCache`
    (whose quanto tensors cannot be deep-copied): new layer objects sharing the current tensors. Either way the
    `record_writes` wrapper is dropped, so the branch's writes are not recorded.
    """
    if isinstance(cache, PagedCache):
        return cache.fork()
    if any(hasattr(layer, "_quantized_keys") for layer in cache.layers):
        branch = copy.copy(cache)
        # NOTE: sharing is safe because QuantizedLayer.update only rebinds its attributes (torch.cat, a new
        # quantization, `cumulative_length +=` on an int); it never writes into a tensor in place.
        branch.layers = [copy.copy(layer) for layer in cache.layers]
    else:
        branch = copy.deepcopy(cache)
    branch.__dict__.pop("update", None)
    return branch


def bytes_held(cache) -> int:
    """Bytes of K/V storage the cache holds now, all layers.

    `PagedCache`: `pool.stats().bytes_in_use` (whole blocks: codes + scales, and full-precision partial blocks).
    `DynamicCache`: the keys/values tensors. `QuantizedCache`: the quantized tensors (packed codes, scales,
    zero points) plus the full-precision residual window.
    """
    if isinstance(cache, PagedCache):
        return cache.pool.stats().bytes_in_use
    total = dynamic_cache_bytes(cache)
    for layer in cache.layers:
        for attr in ("_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, attr, None))
    return total


def read_back(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values layer `layer_idx` would hand attention for its whole history, de-quantized:
    `[batch, num_kv_heads, seq_len, head_dim]` each."""
    layer = cache.layers[layer_idx]
    if hasattr(layer, "_quantized_keys"):  # QuantizedCache: de-quantized history, then the full-precision residual
        keys, values = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
        if layer.keys is not None and layer.keys.dim() == 4:
            keys, values = torch.cat([keys, layer.keys], dim=-2), torch.cat([values, layer.values], dim=-2)
        return keys, values
    return layer.keys, layer.values


def record_writes(cache) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Wrap `cache.update` so that every layer's incoming (unquantized) keys/values are kept.

    Returns:
        `dict[int, list]`: layer index -> list of `(keys, values)` chunks, each `[batch, num_kv_heads, new, head_dim]`,
        filled as the model runs. Concatenated along the sequence, they are what a lossless cache would hold.
    """
    written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    update: Callable = cache.update

    def recording_update(key_states, value_states, layer_idx, *args, **kwargs):
        written.setdefault(layer_idx, []).append((key_states.detach().clone(), value_states.detach().clone()))
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recording_update  # NOTE: an instance attribute, so only this cache object is wrapped
    return written
