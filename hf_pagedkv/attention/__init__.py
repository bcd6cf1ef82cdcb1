"""The ``"hf_pagedkv"`` attention implementation: decode attention that reads a `PagedCache`'s blocks in place.

Importing `hf_pagedkv` registers it (a new name in transformers' `AttentionInterface`; nothing else changes), so
``model.set_attn_implementation("hf_pagedkv")`` or ``from_pretrained(..., attn_implementation="hf_pagedkv")`` selects
it; the default `sdpa` is untouched.
"""

from hf_pagedkv.attention.attention_function import MAX_QUERY_TOKENS, paged_attention_forward
from hf_pagedkv.attention.paged_attention import DEFAULT_TILE_TOKENS, paged_attention
from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.attention.read_counts import READ_COUNTS, ReadCounts
from hf_pagedkv.attention.registration import ATTENTION_NAME, COMPILED_ATTENTION_NAME, register

register()

__all__ = ["ATTENTION_NAME", "COMPILED_ATTENTION_NAME", "DEFAULT_TILE_TOKENS", "MAX_QUERY_TOKENS", "PagedView",
           "READ_COUNTS", "ReadCounts", "paged_attention", "paged_attention_forward", "register"]
