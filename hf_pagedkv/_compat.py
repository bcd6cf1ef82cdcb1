"""The only module that touches transformers internals or differs between the supported transformers versions
(5.23, 5.24 and 5.25); `tests/test_compat.py` is its contract test, run on each version by `scripts/test.sh` in CI.

What differs between them, and where it is handled:

- 5.24: `generate` and every model's `forward` take the cache as `cache=` (`past_key_values=` still works, with a
  FutureWarning); 5.23 knows only `past_key_values`. -> `CACHE_KWARG`, `cache_kwargs`.
- 5.25: `generate` calls `cache.activate_past_recording(recurrent_states_to_keep=...)` (assisted and prompt-lookup
  decoding); 5.23 and 5.24 call it with no argument. -> `PAST_RECORDING_KWARGS`; `PagedCache.activate_past_recording`
  takes any keyword.
- 5.25: `Cache.get_seq_length()` asks layer 0 even when it holds no attention (a `DummyLayer`), where 5.23 and 5.24
  skipped to the first attention layer. -> `seq_length_layer_idx`, which `PagedCache.get_seq_length` uses.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs
from transformers.utils import logging as hf_logging

from hf_pagedkv.errors import counted

__all__ = ["CACHE_KWARG", "CACHE_KWARG_NAMES", "Cache", "CacheLayerMixin", "DummyLayer", "PAST_RECORDING_KWARGS",
           "SUPPORTED_LAYER_TYPES", "TRANSFORMERS_VERSION", "cache_kwargs", "layer_plan", "quiet_model_loading",
           "register_attention", "sdpa_attention_function", "seq_length_layer_idx"]

#: layer types PagedCache stores; "dummy" layers (KV shared with another layer, or no attention) store nothing.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "dummy")

#: `(major, minor)` of the installed transformers.
TRANSFORMERS_VERSION: tuple[int, int] = tuple(Version(transformers.__version__).release[:2])

#: The keyword that hands a cache to `model.generate` and to a model's `forward`: ``"cache"`` from transformers 5.24,
#: ``"past_key_values"`` before.
# NOTE: 5.24 renamed `past_key_values` to `cache` in `generate`, in every model's `forward` (and the layers below it)
# and in the output classes. The old name still works there but raises a FutureWarning (generate: "removed in 6.0.0",
# forward: "removed in 5.40.0"); 5.23 does not know `cache`. The version decides, read once at import: `generate`
# takes the cache through `**kwargs` in every supported version, so its signature names neither.
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"

#: Every keyword a cache can be passed to `generate` under, on some supported version.
CACHE_KWARG_NAMES = ("cache", "past_key_values")


def cache_kwargs(cache) -> dict:
    """`{CACHE_KWARG: cache}`: pass a cache to `model.generate(...)` or `model(...)` under the name the installed
    transformers expects, so the same code runs on 5.23, 5.24 and 5.25 without a deprecation warning.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache, cache_kwargs
    >>> cache = PagedCache()
    >>> out = model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=20)
    >>> # transformers 5.24 and 5.25: model.generate(input_ids, cache=cache, ...); 5.23: past_key_values=cache
    ```
    """
    return {CACHE_KWARG: cache}


#: The keyword arguments `generate` passes to `cache.activate_past_recording(...)` before it drafts tokens it may take
#: back with `crop` (assisted and prompt-lookup decoding; the assistant's own cache): ``recurrent_states_to_keep``
#: from transformers 5.25 (how many steps of linear-attention state to keep), none before.
# NOTE: 5.25 calls it with the keyword on every cache it drafts with, so a cache whose `activate_past_recording` takes
# no keyword arguments raises TypeError there; `Cache.activate_past_recording` takes `**kwargs` from 5.25 only.
PAST_RECORDING_KWARGS: tuple[str, ...] = ("recurrent_states_to_keep",) if TRANSFORMERS_VERSION >= (5, 25) else ()


def seq_length_layer_idx(layers, layer_idx: int = 0) -> int:
    """The layer whose token count answers `Cache.get_seq_length(layer_idx)`, as transformers 5.23 and 5.24 pick it:
    `layer_idx` itself when it holds attention, and for a `layer_idx` of 0 that holds none (a `DummyLayer`: no
    attention, or K/V shared with another layer) the first layer that does.

    NOTE: transformers 5.25 dropped that skip: its `Cache.get_seq_length()` asks layer 0 whatever it is, and a
    `DummyLayer` has no `get_seq_length` (AttributeError). A model whose first layer holds no attention would then
    fail at its first forward step on 5.25 (models ask `cache.get_seq_length()` for the positions of new tokens); the
    cache keeps the 5.23/5.24 answer on all three versions.

    Args:
        layers (`list`): the cache's layers (`PagedLayer` or `DummyLayer`), one per model layer.
        layer_idx (`int`, *optional*, defaults to 0): the layer asked about, `0 <= layer_idx < len(layers)`.

    Raises:
        ValueError: `layer_idx` is not 0 and names a layer without attention, or no layer holds attention.
    """
    if isinstance(layers[layer_idx], CacheLayerMixin):
        return layer_idx
    kind = type(layers[layer_idx]).__name__
    if layer_idx != 0:
        raise ValueError(f"get_seq_length(layer_idx={layer_idx}): layer {layer_idx} is a {kind}, which holds no "
                         "attention and counts no tokens; ask an attention layer, or layer 0.")
    for idx, layer in enumerate(layers):
        if isinstance(layer, CacheLayerMixin):
            return idx
    raise ValueError(f"get_seq_length: none of the {counted(len(layers), 'layer')} holds attention (all {kind}), so "
                     "none counts tokens.")


def layer_plan(config) -> list[tuple[str, int | None]]:
    """`(layer_type, sliding_window)` for each decoder layer of a model config, as `DynamicCache(config=...)` sees it.

    Raises:
        ValueError: a layer type PagedCache does not support (linear attention, hybrid, indexed, ...), by name.
    """
    if not hasattr(config, "get_text_config"):
        raise ValueError(f"`config` must be the model's transformers config (`model.config`, a PretrainedConfig), got "
                         f"{type(config).__name__} {config!r:.60}.")
    decoder_config = config.get_text_config(decoder=True)
    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(decoder_config)
    plan = []
    for idx, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs)):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"PagedCache does not support layer type {layer_type!r} (layer {idx} of "
                f"{type(decoder_config).__name__}); supported: {', '.join(SUPPORTED_LAYER_TYPES)}. "
                "Use transformers' DynamicCache for this model."
            )
        plan.append((layer_type, kwargs.get("sliding_window")))
    return plan


#: transformers' GGUF loader, whose de-quantization bar calls `tqdm.auto.tqdm` directly (module attribute `tqdm`)
_GGUF_LOADER = "transformers.modeling_gguf_pytorch_utils"


@contextlib.contextmanager
def quiet_model_loading():
    """Silence transformers' progress bars while a model loads, and restore them afterwards.

    Covers the bars `transformers.utils.logging.disable_progress_bar()` controls ("Loading weights") and the GGUF
    loader's de-quantization bar, which bypasses that switch. Warnings and errors are not touched.
    """
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        gguf = importlib.import_module(_GGUF_LOADER)
    except ImportError:  # no gguf support installed: no GGUF bar to silence
        gguf = None
    bar = getattr(gguf, "tqdm", None)
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


# -- attention implementations (hf_pagedkv.attention) ----------------------------------------------------------------
# NOTE: 5.23, 5.24 and 5.25 agree here: `AttentionInterface` / `AttentionMaskInterface` are `GeneralInterface`s whose
# `register` adds a name to a class-level mapping shared by every instance; a model calls
# `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)(module, query, key, value, attention_mask,
# dropout=..., scaling=..., **kwargs)` right after `cache.update(...)` (5.24 and 5.25 also pass `kwargs=` to it),
# with `module.layer_idx` set. Without a mask function under the same name, `create_causal_mask` returns None (no
# padding mask at all), so the name is registered in both.


def register_attention(name: str, function, mask: bool = True) -> None:
    """Register `function` as attention implementation `name`, with `sdpa`'s mask function for it (so the masks are
    built exactly as for ``"sdpa"``: bool, `True` = attend, or None for a plain causal step). With `mask=False`, no
    mask function: the model then passes `attention_mask=None` to `function` and builds no mask at all (the packed
    steps of `hf_pagedkv.serving`, whose attention masks each request itself)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    if mask:
        AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention_function():
    """transformers' current ``"sdpa"`` attention function (looked up per call, so a user's re-registration wins)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]
