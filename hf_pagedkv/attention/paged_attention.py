"""`paged_attention`: decode attention over the chunks of a `PagedView`, with an online softmax (flash-decoding)."""

from __future__ import annotations

import torch

from hf_pagedkv.attention.paged_view import PagedView

#: tokens per page tile: what one layer holds decoded in full precision at a time (keys and values, every row)
DEFAULT_TILE_TOKENS = 1024


def paged_attention(query: torch.Tensor, view: PagedView, scaling: float, mask: torch.Tensor | None = None,
                    tile_tokens: int = DEFAULT_TILE_TOKENS) -> torch.Tensor:
    """Attention of `query` over the tokens `view` names, read where they lie, chunk by chunk.

    Each chunk (a tile of pages, decoded when quantized, or a small full-precision segment) gives its partial
    softmax statistics: the running maximum `m`, the sum of ``exp(s - m)`` and the unnormalized output; the chunks
    are then combined exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al.
    2023, Flash-Decoding). The query heads are grouped by their key/value head (GQA), so no key or value is
    repeated. Only the reduction order differs from `sdpa` over the materialized K/V (fp32: about 1e-7 relative).

    Args:
        query (`torch.Tensor` of shape `[batch, num_heads, q, key_dim]`): `num_heads` a multiple of the view's
            key/value heads (query head `h` reads key/value head ``h // (num_heads // num_kv_heads)``).
        view (`PagedView`): the layer's tokens ``lo .. end - 1``.
        scaling (`float`): the factor of ``q @ k^T``.
        mask (`torch.Tensor` of shape `[batch, 1, q, end - lo]`, *optional*): `True` (bool) where a query attends,
            or an additive float mask; `None`: every query attends to every token.
        tile_tokens (`int`): tokens per page tile (peak extra memory: one tile of keys and values).

    Returns:
        `torch.Tensor` of shape `[batch, q, num_heads, value_dim]` (what transformers' attention functions return).
    """
    batch, num_heads, q, dim = query.shape
    spec = view.spec
    H = spec.num_kv_heads
    G = num_heads // H
    # [batch, H, G, q, D] -> [H, batch, G * q, D]: a query row per (query head of the group, query token)
    qh = (query * scaling).view(batch, H, G, q, dim).transpose(0, 1).reshape(H, batch, G * q, dim)
    bias = _position_bias(view, mask, batch, G, q, query.dtype)  # [1, batch, G*q | 1, positions] or None
    p_lo = (view.lo // view.block_size) * view.block_size  # first position a chunk can start at
    stats = []
    for pos0, k, v, masked_below in view.chunks(tile_tokens):
        n = k.shape[2]
        s = torch.matmul(qh, k.transpose(-1, -2))  # [H, batch, G*q, n]
        b = _chunk_bias(bias, view, pos0, n, masked_below, p_lo)
        if b is not None:
            s = s + b
        m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(s.dtype).min)  # [H, batch, G*q, 1]; finite
        p = torch.exp(s - m)
        stats.append((m, p.sum(-1, keepdim=True), torch.matmul(p, v)))  # [.., 1], [.., 1], [.., value_dim]
    if len(stats) == 1:
        _, l, acc = stats[0]
        out = acc / l
    else:
        ms = torch.stack([m for m, _, _ in stats])  # [chunks, H, batch, G*q, 1]
        w = torch.exp(ms - ms.amax(0))  # rescale every chunk to the common maximum
        l = (w * torch.stack([l for _, l, _ in stats])).sum(0)
        out = (w * torch.stack([a for _, _, a in stats])).sum(0) / l
    dv = out.shape[-1]
    # [H, batch, G*q, Dv] -> [batch, q, H * G, Dv]
    return out.view(H, batch, G, q, dv).permute(1, 3, 0, 2, 4).reshape(batch, q, num_heads, dv)


def _position_bias(view: PagedView, mask: torch.Tensor | None, batch: int, G: int, q: int,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """Additive bias over positions ``p_lo .. max(end, last page)``: `-inf` before `lo` and from `end` on, the mask
    in between; `None` when nothing is masked there (then chunks outside ``lo .. end - 1`` get their own bias)."""
    if mask is None:
        return None
    B = view.block_size
    p_lo = (view.lo // B) * B
    p_hi = -(-view.end // B) * B
    if mask.dtype == torch.bool:
        cols = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        cols = mask.to(dtype)
    cols = cols[:, 0]  # [batch, q, end - lo]
    if q > 1:  # one row per (query head of the group, query token), as the query is laid out
        cols = cols.unsqueeze(1).expand(batch, G, q, cols.shape[-1]).reshape(batch, G * q, cols.shape[-1])
    full = cols.new_full((batch, cols.shape[1], p_hi - p_lo), float("-inf"))
    full[..., view.lo - p_lo: view.end - p_lo] = cols
    return full.unsqueeze(0)  # [1, batch, G*q | 1, positions]


def _chunk_bias(bias: torch.Tensor | None, view: PagedView, pos0: int, n: int, masked_below: int,
                p_lo: int) -> torch.Tensor | None:
    """The bias of one chunk (positions ``pos0 .. pos0 + n - 1``), or None when none of them is masked."""
    lo, hi = max(view.lo, masked_below), view.end
    if bias is None:
        if pos0 >= lo and pos0 + n <= hi:
            return None
        pos = torch.arange(pos0, pos0 + n, device=view.spec.device)
        return torch.zeros(n, dtype=view.spec.dtype, device=pos.device).masked_fill_((pos < lo) | (pos >= hi),
                                                                                      float("-inf"))
    b = bias[..., pos0 - p_lo: pos0 - p_lo + n]
    if masked_below > pos0:  # positions the sink serves in full precision
        b = b.clone()
        b[..., : masked_below - pos0] = float("-inf")
    return b
