"""Registers the ``"hf_pagedkv"`` attention implementation (and its mask function) with transformers."""

from __future__ import annotations

from hf_pagedkv._compat import register_attention
from hf_pagedkv.attention.attention_function import compiled_paged_attention_forward, paged_attention_forward

#: the name to pass as `attn_implementation=` (or to `model.set_attn_implementation`)
ATTENTION_NAME = "hf_pagedkv"
#: the same with quantized reads by `torch.compile`d code (opt-in; `CompiledCodeAttention`)
COMPILED_ATTENTION_NAME = "hf_pagedkv_compiled"


def register() -> None:
    """Add ``"hf_pagedkv"`` and ``"hf_pagedkv_compiled"`` to transformers' `AttentionInterface` (with `sdpa`'s mask
    function in the `AttentionMaskInterface`, so masks are built as for `sdpa`). Idempotent; changes no other
    entry."""
    register_attention(ATTENTION_NAME, paged_attention_forward)
    register_attention(COMPILED_ATTENTION_NAME, compiled_paged_attention_forward)
