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
    passed explicitly (the true ones)."""
    cache = DynamicCache(config=model.config)
    logits, pos = [], 0
    with torch.no_grad():
        for i, q in enumerate(steps):
            held = cache.get_seq_length()
            if held > budget and only_step in (None, i):
                for layer in cache.layers:
                    idx = reference_select(layer.keys, budget, kind, sink, recent)
                    layer.keys = layer.keys.gather(2, idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
                    layer.values = layer.values.gather(2, idx[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
            positions = torch.arange(pos, pos + q)[None].expand(x.shape[0], -1)
            out = model(x[:, pos: pos + q], position_ids=positions, **cache_kwargs(cache))
            logits.append(out.logits)
            pos += q
    return torch.cat(logits, 1)
