"""The only module that touches transformers internals; `tests/test_compat.py` is its contract test."""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs

__all__ = ["Cache", "CacheLayerMixin", "DummyLayer", "SUPPORTED_LAYER_TYPES", "layer_plan"]

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
