"""The packed attention: per-request attention over a `PackedCache` step, registered in transformers as
``"hf_pagedkv_packed"`` (and as ``"hf_pagedkv_packed_in_place"`` for steps that read in place), and
`packed_attention`, which selects it on a model for the duration of one engine step."""

from __future__ import annotations

import contextlib

import torch

from hf_pagedkv._compat import register_attention, sdpa_attention_function
from hf_pagedkv.adapter.in_place_reads import IN_PLACE_NAMES, PACKED_IN_PLACE_NAME
from hf_pagedkv.attention import paged_attention_forward
from hf_pagedkv.serving.packed_cache import packed_parts

#: the attention implementation name the engine switches a model to during its steps
PACKED_ATTENTION_NAME = "hf_pagedkv_packed"

# keyword arguments that describe the packed row as a whole, not one segment of it
_ROW_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal")


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, attending each request of a packed step to its own history.

    For each segment of the step (`PackedParts` on `key`, from `PackedCache.update`): the segment's queries attend
    to the K/V its request's `PagedCache` returned, with the segment's causal (and sliding-window) mask, through
    transformers' `sdpa` (as `generate` attends), or `hf_pagedkv.attention.paged_attention_forward` for a model with
    soft-capping (the eager formula) or a step that reads in place (`PackedParts.read_in_place`: a quantized pool,
    or a model configured with ``"hf_pagedkv"``; decode segments then read their blocks in place). The segments'
    outputs are concatenated in packed order.

    Args:
        module (`torch.nn.Module`): the attention layer.
        query (`torch.Tensor` of shape `[1, num_heads, num_step_tokens, head_dim]`).
        key, value (`torch.Tensor` of shape `[1, num_kv_heads, num_step_tokens, head_dim]`): what `PackedCache.update`
            returned (the keys carry the parts).
        attention_mask: None (no mask function is registered under this name: each segment builds its own).

    Returns:
        `(attn_output, None)`, `attn_output` of shape `[1, num_step_tokens, num_heads, head_dim]`.

    Raises:
        RuntimeError: `key` does not come from a `PackedCache` (the model ran outside an engine step while switched
            to this attention, e.g. from another thread).
    """
    packed = packed_parts(key)
    if packed is None:
        raise RuntimeError(f"The {PACKED_ATTENTION_NAME!r} attention only runs inside a hf_pagedkv serving Engine "
                           "step (it attends the requests of a packed batch); the model was called with another "
                           "cache while an Engine step had switched its attention. Do not run the model elsewhere "
                           "while an Engine steps it.")
    kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KWARGS}
    if packed.read_in_place or kwargs.get("softcap") is not None:
        attend = paged_attention_forward  # reads in place at decode, or the eager formula with soft-capping
    else:  # (what `paged_attention_forward` calls for plain tensors, looked up once per layer, not per request)
        attend = sdpa_attention_function()
    # plain tensors (the tags dropped) unless the step reads in place: sdpa, never a read in place (exact against
    # generate)
    plain = attend is paged_attention_forward and not packed.read_in_place
    outs = []
    for part in packed.parts:
        keys, values = part.keys, part.values
        if plain:
            keys, values = keys.detach(), values.detach()
        q = query[:, :, part.lo: part.hi]  # [1, num_heads, q, head_dim]
        out, _ = attend(module, q, keys, values, part.mask, dropout=dropout, scaling=scaling,
                        **kwargs)  # [1, q, num_heads, head_dim]
        outs.append(out)
    return torch.cat(outs, dim=1), None  # [1, num_step_tokens, num_heads, head_dim]


@contextlib.contextmanager
def packed_attention(model, quantized_pool: bool = False):
    """Select the packed attention on `model` for the block, then restore its own.

    Args:
        quantized_pool (`bool`): the step's requests are in a quantized pool (their decode segments read in place
            whatever the model's own attention).

    Yields:
        `bool`: whether the step reads in place: the pool is quantized, or the model's own attention reads
        `PagedCache` blocks in place (``"hf_pagedkv"``). The segments then go to ``"hf_pagedkv"``'s attention with
        the caches' keys as they are, and the model is switched to ``"hf_pagedkv_packed_in_place"``, a name the
        requests' caches know reads in place (`IN_PLACE_NAMES`: a cache confirmed by an earlier step hands every
        layer, its first included, the placeholders the read in place takes, nothing de-quantized).
    """
    own = model.config._attn_implementation
    read_in_place = quantized_pool or own in IN_PLACE_NAMES
    model.set_attn_implementation(PACKED_IN_PLACE_NAME if read_in_place else PACKED_ATTENTION_NAME)
    try:
        yield read_in_place
    finally:
        model.set_attn_implementation(own)


def register() -> None:
    """Add ``"hf_pagedkv_packed"`` and ``"hf_pagedkv_packed_in_place"`` to transformers' `AttentionInterface`,
    without a mask function: the model then builds no mask for the packed row (each segment builds its own).
    Idempotent."""
    for name in (PACKED_ATTENTION_NAME, PACKED_IN_PLACE_NAME):
        register_attention(name, packed_attention_forward, mask=False)


__all__ = ["PACKED_ATTENTION_NAME", "packed_attention", "packed_attention_forward", "register"]
