"""`paged_attention`: decode attention over a `PagedView`: codes de-quantized inside the products, strided views of
full-precision block runs, one softmax per read (or an online softmax over chunks, flash-decoding)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf_pagedkv.attention.compiled_read import CompiledCodeAttention
from hf_pagedkv.attention.native_read import unread_codecs
from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.attention.read_counts import READ_COUNTS, format_name
from hf_pagedkv.attention.rotated_read import turn
from hf_pagedkv.storage.code_read import CodeRead

#: tokens per page tile: what one layer holds decoded in full precision at a time (keys and values, every row).
#: NOTE: each tile costs a fixed ~0.1-0.2 ms of decode calls (SmolLM2 shapes, one CPU thread): at 2048 tokens, k4v4
#: read in 512-token tiles took 1.6 ms per layer against 1.0 ms in one tile, so tiles are large.
DEFAULT_TILE_TOKENS = 2048

#: scores more than this below their row's maximum get probability exactly 0 (``exp(-44.4) = 2**-64``): together
#: they would change the output by less than ``seq_len * 2**-64`` of it (1e-16 at 2048 tokens), far below fp32
#: rounding, and they keep the CPU off denormal arithmetic. NOTE: a peaked softmax (most heads attend to the first
#: token) leaves many probabilities below 1e-38; exp and the products of such denormals run 8-10x slower on CPU
#: (measured, SmolLM2 shapes, 2048 tokens: softmax 134 against 13 us, probabilities @ values 785 against 91 us).
NEGLIGIBLE = -64 * math.log(2)


def paged_attention(query: torch.Tensor, view: PagedView, scaling: float, mask: torch.Tensor | None = None,
                    tile_tokens: int = DEFAULT_TILE_TOKENS, compiled=None, native=None) -> torch.Tensor:
    """Attention of `query` over the tokens `view` names, read where they lie.

    - Quantized stores (`code_attention`): the encoded blocks' codes and scales, de-quantized inside the products
      tile by tile, plus the full-precision tail and sink; one softmax over the read.
    - Full-precision rows in scattered blocks (`fp_attention`): runs of consecutive blocks as strided views of the
      pool, the rest gathered, one softmax over all parts.
    - One row in consecutive full-precision blocks, or a quantized read without encoded blocks: torch's fused
      `scaled_dot_product_attention` on the view (or the store's read).
    - Otherwise (quantized stores without `read_codes` data): chunks with partial softmax statistics combined
      exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2023,
      Flash-Decoding).

    The query heads are grouped by their key/value head (GQA), so no key or value is repeated. Only the reduction
    order differs from `sdpa` over the materialized K/V (fp32: about 1e-7 relative), and probabilities below
    ``2**-64`` of a row's largest are dropped (`NEGLIGIBLE`). Rotated keys (``QuantConfig(rotate_keys=True)``) are
    scored with the query turned once (``(q @ R) . (k @ R) = q . k``) against their codes and the turned
    full-precision tokens (`rotate_code_table`), by every path that reads codes; rotated values
    (``QuantConfig(rotate_values=True)``) are summed as stored and the output turned back once,
    ``(p @ (V R)) @ R.T = p @ V``. The de-quantized chunks come back in the model's basis and take the query and
    give the output as they are. Each read is counted by the path that served it, and a
    format the kernels do not read is a counted, logged fallback to the torch read (`READ_COUNTS`).

    Args:
        query (`torch.Tensor` of shape `[batch, num_heads, q, key_dim]`): `num_heads` a multiple of the view's
            key/value heads (query head `h` reads key/value head ``h // (num_heads // num_kv_heads)``).
        view (`PagedView`): the layer's tokens ``lo .. end - 1``.
        scaling (`float`): the factor of ``q @ k^T``.
        mask (`torch.Tensor` of shape `[batch, 1, q, end - lo]`, *optional*): `True` (bool) where a query attends,
            or an additive float mask; `None`: every query attends to every token.
        tile_tokens (`int`): tokens per page tile (peak extra memory: one tile of keys and values).
        compiled (`CompiledCodeAttention`, *optional*): reads quantized codes with its compiled function where it
            applies (``"hf_pagedkv_compiled"``); `None` (the default): eager only.
        native (*optional*): `(qh, view, bias) -> out | None`, tried first: a read that follows the block table
            itself (``"hf_pagedkv"``'s `cpu_table_read`, ``"hf_pagedkv_compiled"``'s `native_table_read`: codes and
            scales of a quantized store, blocks of a full-precision fp32 one). It gets the query in the model's
            basis: for rotated keys it turns it for their codes (`view.key_rotation()`).

    Returns:
        `torch.Tensor` of shape `[batch, q, num_heads, value_dim]` (what transformers' attention functions return).
    """
    batch, num_heads, q, dim = query.shape
    H = view.spec.num_kv_heads
    G = num_heads // H
    # [batch, H, G, q, D] -> [H, batch, G * q, D]: a query row per (query head of the group, query token)
    qh = (query * scaling).view(batch, H, G, q, dim).transpose(0, 1).reshape(H, batch, G * q, dim)
    bias = _mask_bias(mask, batch, G, q, query.dtype)  # [1, batch, G*q | 1, end - lo] or None
    quantized = view.store.is_quantized
    fmt = format_name(view.store.codecs) if quantized else "fp"
    values = view.value_rotation() if quantized else None  # [dv, dv]: the value codes are of values @ R

    def turned_back(out: torch.Tensor) -> torch.Tensor:  # [H, batch, G*q, Dv] read from the codes as stored
        out = out if values is None else torch.matmul(out, values.to(out.dtype).T)  # (p @ V R) @ R.T = p @ V
        return _unpack(out, batch, H, G, q, num_heads)

    if native is not None:
        out = native(qh, view, bias)  # [H, batch, G*q, Dv] or None (rotated keys: it turns the query itself)
        if out is not None:
            READ_COUNTS.serve("kernel-table" if quantized else "fp", fmt)
            return turned_back(out)
    rotation = view.key_rotation() if quantized else None  # [dk, dk]: the key codes are of keys @ R
    qr = turn(qh, rotation)  # [H, batch, G*q, D]: the codes' basis
    read = view.code_read()  # quantized: codes and scales of the encoded blocks, or None
    if read is not None:
        out = None if compiled is None else compiled(qr, read, bias)
        if out is None:
            kernels = compiled is not None or (native is not None and qh.is_cpu)
            reason = _unread_format(read, qh.is_cpu) if kernels else None
            if reason is not None:
                READ_COUNTS.fall_back(fmt, reason)
            out = code_attention(qr, read, bias, tile_tokens)
            READ_COUNTS.serve("torch-codes", fmt)
        else:
            READ_COUNTS.serve("kernel-codes", fmt)
        return turned_back(out)
    READ_COUNTS.serve("torch-chunks" if quantized else "fp", fmt)
    if not quantized and view.base is None:  # rows in blocks: strided views of runs, rest gathered
        return _unpack(fp_attention(qh, view.fp_parts(tile_tokens), bias), batch, H, G, q, num_heads)
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
        p = F.threshold_(s.sub_(m), NEGLIGIBLE, float("-inf")).exp_()  # in place: the scores are not needed again
        stats.append((m, p.sum(-1, keepdim=True), torch.matmul(p, v)))  # [.., 1], [.., 1], [.., value_dim]
        del s, p, k, v  # this tile goes before the next one is read: one tile at a time
    if len(stats) == 1:
        _, l, acc = stats[0]
        out = acc.div_(_divisor(l))
    else:
        ms = torch.stack([m for m, _, _ in stats])  # [chunks, H, batch, G*q, 1]
        w = torch.exp(ms - ms.amax(0))  # rescale every chunk to the common maximum
        l = (w * torch.stack([l for _, l, _ in stats])).sum(0)
        out = (w * torch.stack([a for _, _, a in stats])).sum(0).div_(_divisor(l))
    return _unpack(out, batch, H, G, q, num_heads)


def _unread_format(read: CodeRead, cpu: bool) -> str | None:
    """Why the kernel of the read's device does not read its codecs (the C one on the CPU: `unread_codecs`; Triton
    on a GPU: int8/int4 only), or None when it does."""
    if cpu:
        return unread_codecs(read.codecs, read.dims)
    if CompiledCodeAttention.supports_codecs(read.codecs, read.dims):
        return None
    return "the GPU kernel reads int8/int4 keys per channel and int8/int4 values per token in one group per head"


def fp_attention(qh: torch.Tensor, parts: list, bias: torch.Tensor | None) -> torch.Tensor:
    """Attention over full-precision parts (`PagedView.fp_parts`): one softmax over the scores of every part.

    A single part goes to torch's fused `scaled_dot_product_attention` (which reads a strided view as it lies).
    Several parts are multiplied head by head with `bmm`, which also reads a view whose rows are blocks apart
    without copying (a 4-d `matmul` would copy it first: measured 5.3 against 0.97 ms, batch 8, 2048 tokens).

    Args:
        qh (`torch.Tensor` of shape `[H, batch, rows, key_dim]`): the scaled query.
        parts (`list`): `(keys, values, columns)`, keys `[H, batch, n, key_dim]`, columns `[n]` (mask columns).
        bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.

    Returns:
        `torch.Tensor` of shape `[H, batch, rows, value_dim]`.
    """
    if len(parts) == 1:
        k, v, cols = parts[0]
        b = None if bias is None else bias.index_select(-1, cols)
        return F.scaled_dot_product_attention(qh, k, v, attn_mask=b, scale=1.0)  # [H, batch, rows, value_dim]
    H = qh.shape[0]
    scores = torch.cat([torch.stack([torch.bmm(qh[h], k[h].transpose(1, 2)) for h in range(H)])
                        for k, _, _ in parts], -1)  # [H, batch, rows, columns], parts one after another
    if bias is not None:
        scores += bias.index_select(-1, torch.cat([cols for _, _, cols in parts]))
    p, l = _exp_scores(scores)
    out, c0 = None, 0
    for _, v, cols in parts:
        pv = torch.stack([torch.bmm(p[h, :, :, c0: c0 + len(cols)], v[h]) for h in range(H)])  # [H, batch, rows, dv]
        out = pv if out is None else out.add_(pv)
        c0 += len(cols)
    return out.div_(l)


def code_attention(qh: torch.Tensor, read: CodeRead, bias: torch.Tensor | None, tile_tokens: int) -> torch.Tensor:
    """Attention over a quantized read, de-quantizing one tile of codes at a time inside the two products.

    Keys (quantized per channel: a scale and zero per block and channel, KIVI's grouping) are decoded one tile at a
    time into a reused buffer and multiplied with the query in one product per tile. NOTE: folding the key scales
    into the query instead (``q . (s * c + z) = (q * s) . c + q . z``) needs one small product per block, because
    the scales change from block to block; on CPU those `bmm`s of `[rows, head_dim] x [head_dim, block_size]` cost
    more than the decode pass they save (measured 320 against 266 us for 2048 SmolLM2 tokens, one thread).
    Values (quantized per token: a scale and zero per token and channel group) are not decoded: the output is
    ``sum_t p_t (s_t c_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t``, so the probabilities are scaled and the
    codes only converted to the compute dtype. The scores of the whole read, `[H, batch, rows, end - pos0]`
    (`rows / head_dim` of the keys' size), get one softmax, so no online rescaling is needed. Sink tokens and the
    tail (staged partial block, the step's tokens) enter in full precision. Codecs without an affine form
    (bitsandbytes' NF4, the reference codec) decode the value tiles too. The value products are reassociated, so
    the result equals "de-quantize, then softmax" up to fp rounding (fp32: about 1e-7 relative).

    Args:
        qh (`torch.Tensor` of shape `[H, batch, rows, key_dim]`): the scaled query, rows per key/value head.
        read (`CodeRead`): the tokens ``lo .. end - 1`` (columns from ``pos0``).
        bias (`torch.Tensor` of shape `[1, batch, rows | 1, end - lo]`, *optional*): additive mask.
        tile_tokens (`int`): tokens per tile of codes held in the compute dtype at once (at least one block).

    Returns:
        `torch.Tensor` of shape `[H, batch, rows, value_dim]`.
    """
    H, batch, R, _ = qh.shape
    B, n, (dk, dv) = read.block_size, read.num_encoded, read.dims
    width, skip = read.end - read.pos0, read.lo - read.pos0  # columns, and those before `lo` (a window's start)
    ns = max(0, read.sink_end - read.lo)  # sink tokens, in full precision after the tail
    step = min(n, max(1, tile_tokens // B))  # blocks per tile
    flat = qh.new_empty(H * batch * step * B * max(dk, dv))  # the tile buffer, shared by keys and values
    kcodec, vcodec = read.codecs
    fold = vcodec.is_affine and (vcodec.bits is None or vcodec.axis == "token")  # values: scale p, not the codes
    scores = qh.new_empty((H, batch, R, width + ns))  # [H, batch, rows, columns | sink tokens]
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        T = (j1 - j0) * B
        buf = flat[: H * batch * T * dk].view(H, batch, j1 - j0, B, dk)
        k = kcodec.decode(*_blocks(read, 0, j0, j1), buf)  # [H, batch, nt, B, dk]
        scores[..., j0 * B: j1 * B] = torch.matmul(qh, k.view(H, batch, T, dk).transpose(-1, -2))  # [.., rows, T]
    scores[..., n * B:] = torch.matmul(qh, read.full[0].transpose(-1, -2))  # the tail, then the sink tokens
    cut = max(skip, read.sink_end)  # before the window: never attended; sink tokens: read in full precision
    if cut:
        scores[..., :cut] = float("-inf")
    if bias is not None:
        scores[..., skip:width] += bias
        if read.sink_end:
            scores[..., width:] += bias[..., : read.sink_end - read.lo]
    p, l = _exp_scores(scores)  # [H, batch, rows, columns] unnormalized, and their sums [H, batch, rows, 1]
    out = torch.matmul(p[..., n * B:], read.full[1])  # [H, batch, rows, dv]
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        T = (j1 - j0) * B
        buf = flat[: H * batch * T * dv].view(H, batch, j1 - j0, B, dv)
        codes, sc = _blocks(read, 1, j0, j1)
        pt = p[..., j0 * B: j1 * B]  # [H, batch, rows, T]
        if not fold:
            out += torch.matmul(pt, vcodec.decode(codes, sc, buf).view(H, batch, T, dv))
            continue
        v = vcodec.unpack(codes, buf).reshape(H, batch, T, dv)  # integer values in token order: [H, batch, T, dv]
        scale, zero = vcodec.affine(sc, qh.dtype)  # [H, batch, nt, B * groups] each (or None: identity)
        if scale is None:
            out += torch.matmul(pt, v)
            continue
        groups = scale.shape[-1] // B
        scale = scale.reshape(H, batch, 1, T, groups)  # [H, batch, 1, T, groups]
        if groups == 1:
            out += torch.matmul(pt * scale[..., 0], v)  # sum_t (p_t s_t) c_t
        else:
            g = dv // groups
            for j in range(groups):  # a few channel groups (head_dim / value_group_size), not blocks
                out[..., j * g: (j + 1) * g] += torch.matmul(pt * scale[..., j], v[..., j * g: (j + 1) * g])
        if zero is not None:
            z = torch.matmul(pt, zero.reshape(H, batch, T, groups))  # sum_t p_t z_t: [H, batch, rows, groups]
            out += z.repeat_interleave(dv // groups, dim=-1) if groups > 1 else z
    return out.div_(l)


def _blocks(read: CodeRead, half: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of encoded blocks ``j0 .. j1 - 1`` (no slicing for the whole read: one op less)."""
    codes, scales = read.codes[half], read.scales[half]
    if j0 == 0 and j1 == codes.shape[2]:
        return codes, scales
    return codes[:, :, j0:j1], scales[:, :, j0:j1]


def _exp_scores(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(scores - max)`` in place, the terms below ``exp(NEGLIGIBLE)`` set to 0, and the sum of each row, to
    divide by. A row masked everywhere (a padding query position) gets probabilities 0 and the sum `tiny`, so its
    output is 0, as torch's `sdpa` gives (a real row's sum is at least 1)."""
    m = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)  # [..., 1]; finite
    p = F.threshold_(scores.sub_(m), NEGLIGIBLE, float("-inf")).exp_()
    return p, _divisor(p.sum(-1, keepdim=True))


def _divisor(l: torch.Tensor) -> torch.Tensor:
    """Softmax sums made safe to divide by: a row masked everywhere sums to 0 over outputs of 0 (0 / tiny = 0)."""
    return l.clamp_(min=torch.finfo(l.dtype).tiny)


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
