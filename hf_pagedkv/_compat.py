"""The only module that touches transformers internals; `tests/test_compat.py` is its contract test."""

from __future__ import annotations

import contextlib
import functools
import importlib

from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs
from transformers.utils import logging as hf_logging

__all__ = ["Cache", "CacheLayerMixin", "DummyLayer", "SUPPORTED_LAYER_TYPES", "layer_plan", "quiet_model_loading"]

#: layer types PagedCache stores; "dummy" layers (KV shared with another layer, or no attention) store nothing.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "dummy")


def layer_plan(config) -> list[tuple[str, int | None]]:
    """`(layer_type, sliding_window)` for each decoder layer of a model config, as `DynamicCache(config=...)` sees it.

    Raises:
        ValueError: a layer type PagedCache does not support (linear attention, hybrid, indexed, ...), by name.
    """
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


#: transformers' GGUF loader, whose de-quantization progress bar calls `tqdm.auto.tqdm` directly (module attribute `tqdm`)
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
