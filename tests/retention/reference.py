"""References for the retention tests: the model run without a cache under a 4D mask that hides exactly the evicted
positions (block-level policies), and a `DynamicCache` compacted by hand with explicit positions (token-level)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_pagedkv import cache_kwargs


def run_steps(model, x: torch.Tensor, steps: list[int], cache, before=None) -> torch.Tensor:
    """Feed `x` `[batch, sum(steps)]` to the model in forward steps of `steps` tokens through `cache`; the logits of
    every token `[batch, sum(steps), vocab]`. `before(cache, start, q)` runs before each step (and checks)."""
    logits, pos = [], 0
    with torch.no_grad():
        for q in steps:
            if before is not None:
                before(cache, pos, q)
            out = model(x[:, pos: pos + q], **cache_kwargs(cache))
            logits.append(out.logits)
            pos += q
    return torch.cat(logits, 1)


def masked_reference(model, x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Logits of `x` computed in one pass without a cache, token `i` seeing exactly the tokens `j` with
    ``visible[i, j]`` (a `[seq, seq]` bool mask), at their true positions."""
    mask = visible[None, None]  # [1, 1, seq, seq], True: attend
    with torch.no_grad():
        return model(x, attention_mask=mask.expand(x.shape[0], 1, -1, -1)).logits


def sink_window_visible(steps: list[int], block_size: int, sink_tokens: int, window: int) -> tuple[torch.Tensor, list]:
    """What `SinkWindow` keeps, re-derived from its rule on absolute positions: before each step the blocks after the
    sink blocks that lie wholly before the last ``window - 1`` held tokens are dropped (never the last block). Returns
    the `[seq, seq]` visibility mask and the held positions after each step."""
    B, head = block_size, -(-sink_tokens // block_size)
    n = sum(steps)
    visible = torch.zeros(n, n, dtype=torch.bool)
    held: list[int] = []
    history, pos = [], 0
    for q in steps:
        nblk = -(-len(held) // B)
        lo = min(max(0, len(held) - (window - 1)) // B, max(nblk - 1, 0))
        if lo > head:
            held = held[: head * B] + held[lo * B:]
        for i in range(pos, pos + q):
            visible[i, held] = True
            visible[i, pos: i + 1] = True
        held = held + list(range(pos, pos + q))
        history.append(list(held))
        pos += q
    return visible, history


def reference_select(keys: torch.Tensor, keep: int, kind: str, sink: int, recent: int) -> torch.Tensor:
    """The kept logical indices `[batch, heads, keep]` (ascending) of a key-norm or key-diff policy, written out
    plainly: protected tokens first, then the best scores."""
    k = keys.float()
    if kind == "key_norm":
        score = -k.norm(dim=-1)
    else:
        unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        mean = unit.mean(2, keepdim=True)
        score = -(unit * (mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-12))).sum(-1)
    held = k.shape[2]
    protected = torch.zeros(held, dtype=torch.bool)
    protected[:sink] = True
    protected[max(0, held - recent):] = True
    score = torch.where(protected, torch.full_like(score, float("inf")), score)
    order = torch.argsort(score, dim=-1, descending=True, stable=True)[..., :keep]
    return order.sort(dim=-1).values


def compacted_dynamic_reference(model, x: torch.Tensor, steps: list[int], budget: int, kind: str, sink: int,
                                recent: int, only_step: int | None = None) -> torch.Tensor:
    """Logits of `x` fed in `steps` through a `DynamicCache` whose layers are compacted by hand to `budget` tokens
    per head before each step that starts above it (only before step number `only_step`, if given); positions are
    passed explicitly (the true ones). A hybrid model's sliding-window layers are left as `DynamicCache` keeps them."""
    cache = DynamicCache(config=model.config)
    full = next(i for i, layer in enumerate(cache.layers) if not layer.is_sliding)
    logits, pos = [], 0
    with torch.no_grad():
        for i, q in enumerate(steps):
            held = cache.layers[full].get_seq_length() if cache.layers[full].is_initialized else 0
            if held > budget and only_step in (None, i):
                for layer in cache.layers:
                    if layer.is_sliding:  # a hybrid model's sliding-window layers keep their window (DynamicCache)
                        continue
                    idx = reference_select(layer.keys, budget, kind, sink, recent)
                    layer.keys = layer.keys.gather(2, idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
                    layer.values = layer.values.gather(2, idx[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
            positions = torch.arange(pos, pos + q)[None].expand(x.shape[0], -1)
            out = model(x[:, pos: pos + q], position_ids=positions, **cache_kwargs(cache))
            logits.append(out.logits)
            pos += q
    return torch.cat(logits, 1)


# -- SnapKV: the kept sets from a capture run, and a run whose every layer hides each head's evicted positions ------
_CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # layer -> (query, key, scaling), capture run
_HEAD_MASKS: dict[int, torch.Tensor] = {}  # layer -> [batch, num_kv_heads, seq, seq] bool, masked run


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from hf_pagedkv._compat import sdpa_attention_function

    _CAPTURED[module.layer_idx] = (query.detach().clone(), key.detach().clone(),
                                   scaling if scaling is not None else query.shape[-1] ** -0.5)
    return sdpa_attention_function()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)


def _head_masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Plain attention where query head `h` of layer `l` sees exactly ``_HEAD_MASKS[l][:, h // G]``; a layer without
    a mask (a hybrid model's sliding-window layer, which no policy compacts) attends as `sdpa` does."""
    if module.layer_idx not in _HEAD_MASKS:
        from hf_pagedkv._compat import sdpa_attention_function

        return sdpa_attention_function()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         **kwargs)
    G = query.shape[1] // key.shape[1]
    mask = _HEAD_MASKS[module.layer_idx].repeat_interleave(G, dim=1)  # [batch, num_heads, seq, seq]
    k, v = key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1)  # [batch, num_heads, seq, dim]
    s = query @ k.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [batch, num_heads, seq, dim]
    return out.transpose(1, 2).contiguous(), None


def _register_reference_attention() -> None:
    from hf_pagedkv._compat import register_attention

    register_attention("test_capture", _capture_attention)
    register_attention("test_head_masked", _head_masked_attention)


def reference_snapkv_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, window: int, kernel: int,
                            pooling: str) -> torch.Tensor:
    """SnapKV's votes `[batch, kv_heads, n]` written out plainly, head by head and window query by window query."""
    batch, num_heads, n, _ = query.shape
    H = key.shape[1]
    G = num_heads // H
    w = min(window, n)
    out = torch.zeros(batch, H, n)
    for h in range(num_heads):
        votes = torch.zeros(batch, n)
        for j in range(n - w, n):  # each window query attends causally to tokens 0..j
            q, k = query[:, h, j].float(), key[:, h // G, : j + 1].float()  # [b, d], [b, j + 1, d]
            s = torch.einsum("bd,bnd->bn", q, k) * scaling  # [b, j + 1]
            votes[:, : j + 1] += s.softmax(-1)
        pooled = torch.zeros_like(votes)
        for i in range(n):  # centred window, clipped at the ends (avg: over the tokens inside)
            lo, hi = max(0, i - kernel // 2), min(n, i + kernel // 2 + 1)
            pooled[:, i] = votes[:, lo:hi].amax(-1) if pooling == "max" else votes[:, lo:hi].mean(-1)
        out[:, h // G] += pooled
    return out


def snapkv_reference(model, x: torch.Tensor, prompt: int, keep: int | dict[int, int], window: int, sink: int,
                     kernel: int = 5, pooling: str = "avg") -> torch.Tensor:
    """Logits of `x` `[batch, n]` in one pass without a cache where, from token `prompt` on, every layer's KV head
    sees only the `keep` prompt tokens SnapKV keeps for it (scored from a capture run of the prompt) plus the causal
    part of the later tokens; the prompt's own tokens see the causal prompt. `keep` may differ per layer (a dict
    layer index -> tokens kept: PyramidKV)."""
    _register_reference_attention()
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("test_capture")
        with torch.no_grad():
            model(x[:, :prompt], use_cache=False)
        kept = {}
        sliding = [kind == "sliding_attention" for kind in getattr(model.config, "layer_types", None) or []]
        for layer, (q, k, scaling) in _CAPTURED.items():
            if sliding and sliding[layer]:  # a sliding-window layer keeps its window, uncompressed
                continue
            score = reference_snapkv_scores(q, k, scaling, window, kernel, pooling)  # [batch, H, prompt]
            protected = torch.zeros(prompt, dtype=torch.bool)
            protected[:sink] = True
            protected[max(0, prompt - window):] = True
            score = torch.where(protected, torch.full_like(score, float("inf")), score)
            n_keep = keep[layer] if isinstance(keep, dict) else keep
            kept[layer] = score.argsort(dim=-1, descending=True, stable=True)[..., :n_keep]  # [batch, H, keep]
    finally:
        model.set_attn_implementation(before)
        _CAPTURED.clear()
    return kept_heads_reference(model, x, prompt, kept)


def kept_heads_reference(model, x: torch.Tensor, prompt: int, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Logits of `x` `[batch, n]` in one pass without a cache where, from token `prompt` on, KV head `h` of layer
    `l` sees only the prompt tokens ``kept[l][:, h]`` (`[batch, num_kv_heads, keep]` indices) plus the causal part
    of the later tokens; the prompt's own tokens see the causal prompt. Positions are the true ones."""
    _register_reference_attention()
    before = model.config._attn_implementation
    n = x.shape[1]
    masks = {}
    for layer, idx in kept.items():
        batch, H, _ = idx.shape
        visible = torch.ones(batch, H, n, n, dtype=torch.bool).tril()  # causal
        seen = torch.zeros(batch, H, prompt, dtype=torch.bool).scatter_(-1, idx, True)
        visible[:, :, prompt:, :prompt] = seen[:, :, None, :]
        masks[layer] = visible
    try:
        _HEAD_MASKS.clear()
        _HEAD_MASKS.update(masks)
        model.set_attn_implementation("test_head_masked")
        with torch.no_grad():
            return model(x, use_cache=False).logits
    finally:
        model.set_attn_implementation(before)
        _HEAD_MASKS.clear()


def reference_kvzip_scores(model, context: torch.Tensor, prompt: list[int]) -> dict[int, torch.Tensor]:
    """KVzip's scores `{layer: [batch, kv_heads, n]}` written out plainly: the model under eager attention, without
    a cache, over the context, the repeat prompt and the context again (`output_attentions`); each context token's
    highest attention weight from any query after the context, over the query heads of its KV head."""
    batch, n = context.shape
    x = torch.cat([context, torch.tensor(prompt, dtype=torch.long)[None].expand(batch, -1), context], 1)
    before = model.config._attn_implementation
    H = model.config.num_key_value_heads
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            attentions = model(x, use_cache=False, output_attentions=True).attentions  # [batch, heads, T, T] each
    finally:
        model.set_attn_implementation(before)
    out = {}
    for layer, a in enumerate(attentions):
        w = a[:, :, n:, :n].amax(dim=2)  # [batch, num_heads, n]: the reconstruction queries' highest weight
        out[layer] = w.view(batch, H, -1, n).amax(dim=2)  # [batch, H, n]: over the KV head's query heads
    return out


def reference_kvzip_kept(scores: dict[int, torch.Tensor], keep: int, sink: int, recent: int) -> dict[int, torch.Tensor]:
    """The kept indices `{layer: [batch, kv_heads, keep]}` (ascending) of the best `scores`, sinks and recent first."""
    kept = {}
    for layer, s in scores.items():
        n = s.shape[-1]
        protected = torch.zeros(n, dtype=torch.bool)
        protected[:sink] = True
        protected[max(0, n - recent):] = True
        s = torch.where(protected, torch.full_like(s, float("inf")), s)
        kept[layer] = s.argsort(dim=-1, descending=True, stable=True)[..., :keep].sort(dim=-1).values
    return kept
