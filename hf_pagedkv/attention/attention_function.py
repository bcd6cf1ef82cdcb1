"""`paged_attention_forward`: the attention function registered in transformers as ``"hf_pagedkv"``."""

from __future__ import annotations

import logging

import torch

from hf_pagedkv._compat import sdpa_attention_function
from hf_pagedkv.attention.compiled_read import CompiledCodeAttention
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import DEFAULT_TILE_TOKENS, paged_attention
from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.attention.triton_read import TritonCodeAttention
from hf_pagedkv.attention.query_window import recorder_of

logger = logging.getLogger(__name__)

#: the longest query (new tokens per row) read in place; longer steps (prefill) go to `sdpa`, which is faster there
MAX_QUERY_TOKENS = 16

# keyword arguments the models pass along that do not change the attention read in place (the window is in the
# view and in the mask already)
_NEUTRAL_KWARGS = {"position_ids", "use_cache", "cache_position", "sliding_window", "output_attentions",
                   "position_embeddings", "return_dict", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k"}


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, compiled: CompiledCodeAttention | None = None,
                            native=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (the signature of `sdpa_attention_forward`), reading a
    `PagedCache`'s pool in place at decode steps.

    When `key` comes from a `PagedCache` (it carries a `PagedView`) and the step is a decode step (at most
    `MAX_QUERY_TOKENS` new tokens, no dropout, no extra score terms), attention is computed from the block tables:
    full-precision pages tile by tile, quantized pages de-quantized tile by tile (`paged_attention`). This also
    tells the cache that the step's attention reads in place, so the cache hands the step's later layers
    placeholders instead of gathered or de-quantized copies (the first layer of a step reads a normal copy, with
    `sdpa`, unless the cache knows the model's config and an earlier step confirmed: see `InPlaceReads`); a
    placeholder that this function cannot read in place is materialized here. Everything else (other caches,
    prefill, unsupported arguments) goes to transformers' `sdpa` with the same arguments, and gives the same
    result. When the cache's retention policy is query-aware (`SnapKV`) and
    asked for this step's queries, `query` is handed to it first (`QueryWindow.record`), whichever path attends.

    Args:
        module (`torch.nn.Module`): the attention layer (transformers passes `self`).
        query (`torch.Tensor` of shape `[batch, num_heads, q, head_dim]`).
        key, value (`torch.Tensor` of shape `[batch, num_kv_heads, kv_len, head_dim]`): what the cache returned.
        attention_mask (`torch.Tensor` of shape `[batch, 1, q, kv_len]`, *optional*): from the ``"hf_pagedkv"`` mask
            function (the `sdpa` mask: bool, `True` = attend), or `None`.
        dropout, scaling, is_causal: as `sdpa_attention_forward`.
        compiled (`CompiledCodeAttention`, *optional*): the compiled quantized read (``"hf_pagedkv_compiled"``);
            `None`: eager.
        native (*optional*): the quantized read that follows block tables, tried first (`native_table_read`,
            ``"hf_pagedkv_compiled"``); `None`: none.

    Returns:
        `(attn_output, None)`, `attn_output` of shape `[batch, q, num_heads, head_dim]`.
    """
    record = recorder_of(key)  # a query-aware retention policy (SnapKV) asked for this layer's queries
    if record is not None:
        record(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
    view = PagedView.of(key)
    if view is not None and attention_mask is not None and attention_mask.dim() == 4 \
            and attention_mask.shape[-1] > key.shape[-2]:
        # NOTE: a layer of a retention tier holding fewer tokens (PyramidKV, KVzip's global budgets) holds the last of the positions the
        # model's first full-attention layer holds, whose sizes transformers built the one mask from
        # (`PagedLayer.get_mask_sizes`): its keys are the mask's last columns
        attention_mask = attention_mask[..., -key.shape[-2]:]
    if view is None:
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                         **kwargs)
    placeholder = view.claim(key)  # (the cache checks that its placeholders reach this function)
    reason = _unsupported(query, key, attention_mask, dropout, kwargs)
    if reason is not None or not placeholder:
        if reason is None:
            view.confirm()  # the step's later layers read in place
        elif placeholder:
            logger.debug("hf_pagedkv attention: layer %s falls back to sdpa (%s)", getattr(module, "layer_idx", "?"),
                         reason)
        if placeholder:
            key, value = view.materialize()
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                         **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if compiled is None:  # "hf_pagedkv": the C reads on the CPU where they build, else torch
        return paged_attention(query, view, scale, attention_mask, tile_tokens=DEFAULT_TILE_TOKENS,
                               native=cpu_table_read), None
    return paged_attention(query, view, scale, attention_mask, tile_tokens=DEFAULT_TILE_TOKENS,
                           compiled=compiled, native=native), None


#: the compiled quantized reads of ``"hf_pagedkv_compiled"``: one each per process (the C library, the Triton kernel
#: and the graphs serve every layer)
NATIVE_READ = NativeCodeAttention()
TRITON_READ = TritonCodeAttention()
COMPILED_READ = CompiledCodeAttention()


def compiled_quantized_read(qh: torch.Tensor, read, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The quantized read of ``"hf_pagedkv_compiled"``: the C function where it applies and builds
    (`NativeCodeAttention`), else the `torch.compile`d one (`CompiledCodeAttention`), else None (the eager read)."""
    out = NATIVE_READ(qh, read, bias)
    return out if out is not None else COMPILED_READ(qh, read, bias)


def native_table_read(qh: torch.Tensor, view: PagedView, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The first read of ``"hf_pagedkv_compiled"``: a kernel following the view's block table, nothing gathered and
    no tail copied: on the CPU the C function (`NativeCodeAttention.read_view`), on a GPU the Triton one
    (`TritonCodeAttention.read_view`); or None (then `compiled_quantized_read` over the view's `CodeRead`)."""
    return (NATIVE_READ if qh.device.type == "cpu" else TRITON_READ).read_view(qh, view, bias)


def cpu_table_read(qh: torch.Tensor, view: PagedView, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The first read of ``"hf_pagedkv"``: on the CPU, the C function following the view's block table
    (`NativeCodeAttention.read_view`: quantized codes, fp32 pools); None elsewhere (on a GPU ``"hf_pagedkv"`` reads
    with torch; the Triton kernel is ``"hf_pagedkv_compiled"``'s), where it does not apply, or when it cannot be
    built here or ``HF_PAGEDKV_NATIVE_READ=0`` turns it off."""
    return NATIVE_READ.read_view(qh, view, bias) if qh.is_cpu else None


def compiled_paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                     scaling: float | None = None, is_causal: bool | None = None,
                                     **kwargs) -> tuple[torch.Tensor, None]:
    """`paged_attention_forward` with quantized (int8/int4) reads computed by compiled code
    (`compiled_quantized_read`: a C function built once per machine, else `torch.compile`d code): registered as
    ``"hf_pagedkv_compiled"``, opt-in. Same arguments, shapes and result (up to fp32 rounding: the sums run in
    another order); reads neither takes, and any build or compile error, use the eager read. The first decode step
    on a machine builds the C library (about 1 s); a read only `torch.compile` takes pays its compile time (seconds
    per graph, see docs/paged_attention.md)."""
    return paged_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   is_causal=is_causal, compiled=compiled_quantized_read, native=native_table_read,
                                   **kwargs)


def _fallback(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What attends when the read in place does not: transformers' `sdpa`, or for a model with attention-logit
    soft-capping (Gemma 2: `softcap`, which `sdpa` refuses) the eager formula with it: scores ``q k^T * scaling``,
    capped as ``softcap * tanh(scores / softcap)``, masked, softmax in float32, times the values. Shapes as
    `paged_attention_forward`."""
    softcap = kwargs.get("softcap")
    if softcap is None:
        return sdpa_attention_function()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         is_causal=is_causal, **kwargs)
    G = query.shape[1] // key.shape[1]  # GQA: query heads per KV head
    k, v = key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1)  # [batch, num_heads, kv_len, dim]
    scores = query @ k.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap  # [batch, num_heads, q, kv_len]
    q, n = scores.shape[-2:]
    if attention_mask is None and q > 1:  # causal over the last q keys (is_causal with no mask)
        attention_mask = torch.ones(q, n, dtype=torch.bool, device=scores.device).tril(n - q)
    if attention_mask is not None:
        mask = attention_mask[..., -n:]
        lowest = torch.finfo(scores.dtype).min  # (not -inf: a fully masked padding row stays finite, as eager's)
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask
    weights = scores.float().softmax(-1).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ v).transpose(1, 2).contiguous(), None


def _unsupported(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                 kwargs: dict) -> str | None:
    """Why this call cannot be read in place (None when it can)."""
    batch, num_heads, q, _ = query.shape
    if q > MAX_QUERY_TOKENS:
        return f"{q} query tokens (prefill)"
    if mask is None and q > 1:
        return "no mask for several query tokens"
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] != batch
                             or tuple(mask.shape[2:]) != (q, key.shape[2])):
        return f"mask of shape {tuple(mask.shape)}"
    if dropout:
        return "dropout"
    if num_heads % key.shape[1]:
        return "query heads not a multiple of the key/value heads"
    if torch.is_grad_enabled() and query.requires_grad:
        return "gradients"
    extra = [k for k, v in kwargs.items() if k not in _NEUTRAL_KWARGS and v is not None and v is not False]
    if extra or kwargs.get("output_attentions"):
        return f"arguments {extra or ['output_attentions']}"
    return None
