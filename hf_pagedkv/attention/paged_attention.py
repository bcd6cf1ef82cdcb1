"""`paged_attention`: decode attention over the chunks of a `PagedView`, with an online softmax (flash-decoding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_pagedkv.attention.paged_view import PagedView

#: tokens per page tile: what one layer holds decoded in full precision at a time (keys and values, every row).
#: NOTE: each tile costs a fixed ~0.1-0.2 ms of decode calls (SmolLM2 shapes, one CPU thread): at 2048 tokens, k4v4
#: read in 512-token tiles took 1.6 ms per layer against 1.0 ms in one tile, so tiles are large.
DEFAULT_TILE_TOKENS = 2048


def paged_attention(query: torch.Tensor, view: PagedView, scaling: float, mask: torch.Tensor | None = None,
                    tile_tokens: int = DEFAULT_TILE_TOKENS) -> torch.Tensor:
    """Attention of `query` over the tokens `view` names, read where they lie, chunk by chunk.

    Each chunk (a tile of pages, decoded when quantized, or a small full-precision segment) gives its partial
    softmax statistics: the running maximum `m`, the sum of ``exp(s - m)`` and the unnormalized output; the chunks
    are then combined exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al.
    2023, Flash-Decoding); a read that is a single chunk (one row in consecutive full-precision blocks, or at most
    one tile) goes to torch's fused `scaled_dot_product_attention` on that chunk. The query heads are grouped by their key/value head (GQA), so no key or value is
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
    H = view.spec.num_kv_heads
    G = num_heads // H
    # [batch, H, G, q, D] -> [H, batch, G * q, D]: a query row per (query head of the group, query token)
    qh = (query * scaling).view(batch, H, G, q, dim).transpose(0, 1).reshape(H, batch, G * q, dim)
    bias = _mask_bias(mask, batch, G, q, query.dtype)  # [1, batch, G*q | 1, end - lo] or None
    if view.num_chunks(tile_tokens) == 1:  # one view or one tile: a single softmax, by torch's fused kernel
        (pos0, k, v), = view.chunks(tile_tokens)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=bias, scale=1.0)  # [H, batch, G*q, Dv]
        return _unpack(out, batch, H, G, q, num_heads)
    stats = []
    for pos0, k, v in view.chunks(tile_tokens):
        s = torch.matmul(qh, k.transpose(-1, -2))  # [H, batch, G*q, n]
        if bias is not None:
            s += bias[..., pos0 - view.lo: pos0 - view.lo + k.shape[2]]
        m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(s.dtype).min)  # [H, batch, G*q, 1]; finite
        p = s.sub_(m).exp_()  # in place: the scores are not needed again
        stats.append((m, p.sum(-1, keepdim=True), torch.matmul(p, v)))  # [.., 1], [.., 1], [.., value_dim]
        del s, p, k, v  # this tile goes before the next one is read: one tile at a time
    if len(stats) == 1:
        _, l, acc = stats[0]
        out = acc.div_(l)
    else:
        ms = torch.stack([m for m, _, _ in stats])  # [chunks, H, batch, G*q, 1]
        w = torch.exp(ms - ms.amax(0))  # rescale every chunk to the common maximum
        l = (w * torch.stack([l for _, l, _ in stats])).sum(0)
        out = (w * torch.stack([a for _, _, a in stats])).sum(0).div_(l)
    return _unpack(out, batch, H, G, q, num_heads)


def _unpack(out: torch.Tensor, batch: int, H: int, G: int, q: int, num_heads: int) -> torch.Tensor:
    """`[H, batch, G*q, Dv]` -> `[batch, q, H * G, Dv]`."""
    dv = out.shape[-1]
    return out.view(H, batch, G, q, dv).permute(1, 3, 0, 2, 4).reshape(batch, q, num_heads, dv)


def _mask_bias(mask: torch.Tensor | None, batch: int, G: int, q: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as an additive bias laid out as the query rows, `[1, batch, G * q | 1, kv_len]` (0 where a query
    attends, `-inf` where not), or None."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        cols = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        cols = mask.to(dtype)
    cols = cols[:, 0]  # [batch, q, kv_len]
    if q > 1:  # one row per (query head of the group, query token), as the query is laid out
        cols = cols.unsqueeze(1).expand(batch, G, q, cols.shape[-1]).reshape(batch, G * q, cols.shape[-1])
    return cols.unsqueeze(0)
