"""Registers the ``"hf_pagedkv"`` attention implementation (and its mask function) with transformers."""

from __future__ import annotations

from hf_pagedkv._compat import register_attention
from hf_pagedkv.attention.attention_function import paged_attention_forward

#: the name to pass as `attn_implementation=` (or to `model.set_attn_implementation`)
ATTENTION_NAME = "hf_pagedkv"


def register() -> None:
    """Add ``"hf_pagedkv"`` to transformers' `AttentionInterface` (with `sdpa`'s mask function in the
    `AttentionMaskInterface`, so masks are built as for `sdpa`). Idempotent; changes no other entry."""
    register_attention(ATTENTION_NAME, paged_attention_forward)
