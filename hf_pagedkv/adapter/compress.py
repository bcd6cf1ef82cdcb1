"""`compress_context`: KVzip's reconstruction pass through a prefilled `PagedCache`, then the compression."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from hf_pagedkv._compat import cache_kwargs
from hf_pagedkv.retention.kv_zip import REPEAT_PROMPT, KVzip


def repeat_prompt_ids(tokenizer) -> list[int]:
    """The token ids of KVzip's repeat instruction: two line breaks, `REPEAT_PROMPT`, a line break, as plain text (no
    special tokens). NOTE: plain text, not a chat turn: on SmolLM2-135M-Instruct (1k-token passkey contexts, ratio
    0.5, depths 10/50/90) the plain prompt retrieved 2 of 3 keys, the chat-formatted user turn 1 of 3 (its template
    adds a system prompt) and kvpress's format (the instruction, then the assistant-turn header) 0 of 3."""
    return tokenizer("\n\n" + REPEAT_PROMPT + "\n", add_special_tokens=False)["input_ids"]


@torch.no_grad()
def compress_context(model, cache, context_ids, tokenizer=None, prompt_ids: Sequence[int] | None = None,
                     attention_mask: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Compress the context a `PagedCache` with a `KVzip` policy holds: Kim et al., "KVzip: Query-Agnostic KV Cache
    Compression with Context Reconstruction" (arXiv 2505.23416).

    Runs the reconstruction pass through the cache (the repeat prompt, then `context_ids` again, in forward steps
    of `KVzip.chunk_tokens` tokens) while the ``"hf_pagedkv"`` attention scores each context token per (layer, KV
    head) by the highest attention weight it receives (`ContextScores`); then crops the reconstruction tokens and
    keeps each head's best-scored tokens (`KVzip.keep_for`), compacted into fresh blocks: the blocks beyond the
    budget go back to the pool. Afterwards `get_seq_length()` is the context's length again, so
    ``model.generate(torch.cat([context_ids, question_ids], 1), past_key_values=cache)`` feeds only the question,
    at its true positions, and it attends exactly to what was kept. Cost: one forward pass over the prompt and the
    context (without the vocabulary projection), plus a score matmul per layer about the attention's size.

    Args:
        model: a causal LM loaded with ``attn_implementation="hf_pagedkv"`` (or switched to it with
            ``model.set_attn_implementation("hf_pagedkv")``).
        cache (`PagedCache`): built with ``retention=KVzip(...)``, holding exactly the prefilled context (no
            question yet, nothing evicted).
        context_ids (`torch.LongTensor` of shape `[batch, n]` or `[n]`, or a list of ints): the context the cache
            holds (the same for every row when 1-D). NOTE: the cache keeps no token ids, so only the length and the
            batch are checked: other ids of the same shape are scored as if the cache held them, and the wrong
            tokens are kept. Pass the very ids you prefilled.
        tokenizer (*optional*): builds the repeat prompt (`repeat_prompt_ids`) when `prompt_ids` is not given.
            Pass one (or `prompt_ids`): without a prompt the context is repeated right after itself, which scored
            worse (1 of 3 keys against 2 of 3, same setting as `repeat_prompt_ids`).
        prompt_ids (`Sequence[int]` or 1-D integer tensor, *optional*): the repeat prompt's token ids.
        attention_mask (`torch.Tensor` of shape `[batch, n]`, *optional*): for a left-padded batch, the context's
            mask (1 for real tokens, 0 for left padding), as given to the prefill. The reconstruction pass then
            gets the mask and the positions `generate` would give (padding masked; each row's positions count its
            real tokens), padding scores 0, and each row keeps its best real tokens (the sinks are its first real
            tokens): a row scores and keeps as it would in a batch of its own (`ImportancePolicy.select`), given
            the same number of tokens to keep. NOTE: that number is one for the batch, and a `compression_ratio`
            is of the padded length, so a shorter row keeps a larger share of its tokens. Padding
            is kept only where a row has fewer real tokens than the budget, in the slots its mask masks, so
            pass the same mask (extended by 1s) to `generate`. Prefill with the positions `generate` gives
            (``position_ids = attention_mask.cumsum(-1) - 1``, or through `generate` itself).

    Returns:
        `dict[int, torch.Tensor]`: the scores per layer index, `[batch, num_kv_heads, n]` float32 each (0 at
        padding): the pass's own, also with ``KVzipScoring(value_weighted=True)``, whose ranking multiplies them by the
        tokens' relative value norms first (`KVzip.weigh`).

    Raises:
        ValueError: `model` is not a transformers model or its attention is not ``"hf_pagedkv"``; `prompt_ids` not a
            flat sequence of ints; `tokenizer` not a tokenizer; the cache has no `KVzip` policy, is empty,
            already evicted tokens, or does not hold exactly `context_ids` (length or batch differ); a token id
            outside the vocabulary; `attention_mask` not of the context's shape `[batch, n]` or not left padding
            (0s then 1s in each row, at least one 1). Nothing is evicted then, and the cache holds the context as
            before.

    Example (a left-padded batch):

    ```python
    >>> enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    >>> cache = PagedCache(config=model.config, retention=KVzip(compression_ratio=0.5))
    >>> pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    >>> model(enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos, **cache_kwargs(cache))
    >>> compress_context(model, cache, enc.input_ids, tokenizer=tok, attention_mask=enc.attention_mask)
    ```
    """
    from hf_pagedkv.adapter.paged_cache import PagedCache  # the cache module imports the retention package

    if not callable(getattr(model, "get_input_embeddings", None)) or not hasattr(model, "config") \
            or not hasattr(model, "device"):
        raise ValueError(f"compress_context runs a transformers causal LM (`AutoModelForCausalLM.from_pretrained(..., "
                         f'attn_implementation="hf_pagedkv")`), got {type(model).__name__}.')
    if not isinstance(cache, PagedCache):
        raise ValueError(f"compress_context compresses a hf_pagedkv.PagedCache, got {type(cache).__name__}.")
    policy = cache.retention_policy
    if not isinstance(policy, KVzip):
        raise ValueError(f"compress_context needs a cache built with retention=hf_pagedkv.retention.KVzip(...), got "
                         f"retention={policy!r}.")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("hf_pagedkv", "hf_pagedkv_compiled"):  # (the compiled one differs in quantized decode reads only)
        raise ValueError(f'compress_context scores the context inside the "hf_pagedkv" attention, but the model uses '
                         f'{impl!r}: load it with attn_implementation="hf_pagedkv" (or call '
                         'model.set_attn_implementation("hf_pagedkv")).')
    if not isinstance(context_ids, (torch.Tensor, list, tuple)) or (
            isinstance(context_ids, torch.Tensor) and (context_ids.is_floating_point() or context_ids.is_complex())):
        raise ValueError(f"`context_ids` must be token ids: an integer tensor `[batch, n]` or `[n]`, or a list of "
                         f"ints; got {type(context_ids).__name__}"
                         f"{f' of dtype {context_ids.dtype}' if isinstance(context_ids, torch.Tensor) else ''}.")
    try:
        ctx = torch.as_tensor(context_ids, device=model.device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"`context_ids` must be token ids (a list of ints or an integer tensor): {exc}") from None
    if ctx.numel() and (ctx.is_floating_point() or ctx.is_complex() or ctx.dtype == torch.bool):
        raise ValueError(f"`context_ids` must be token ids (ints), got values of dtype {ctx.dtype}.")
    ctx = ctx.long()
    if ctx.dim() == 1:
        ctx = ctx[None].expand(max(cache.num_rows, 1), -1)
    if ctx.dim() != 2 or ctx.shape[1] == 0:
        raise ValueError(f"`context_ids` must be `[batch, n]` or `[n]` token ids with n >= 1, got shape "
                         f"{tuple(ctx.shape)}.")
    stats = cache.retention_stats()
    if stats.tokens_seen and (stats.tokens_seen != ctx.shape[1] or cache.num_rows != ctx.shape[0]):
        rows = f"{cache.num_rows} row{'s' if cache.num_rows != 1 else ''}"
        raise ValueError(f"compress_context: the cache holds {rows} of {stats.tokens_seen} tokens, "
                         f"but `context_ids` is {tuple(ctx.shape)}: prefill exactly the context, then compress.")
    prompt = _prompt_ids(tokenizer, prompt_ids, model.device)[None].expand(ctx.shape[0], -1)  # [batch, m]
    vocab = model.get_input_embeddings().num_embeddings
    for name, ids in (("context_ids", ctx), ("prompt_ids", prompt)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"`{name}` holds token ids outside the model's vocabulary [0, {vocab}): "
                             f"{int(ids.min())} .. {int(ids.max())}. Nothing was run or evicted.")
    mask = _context_mask(attention_mask, tuple(ctx.shape), model.device)  # [batch, n] bool, or None: no padding
    recon = torch.cat([prompt, ctx], dim=1)  # [batch, prompt + n]
    full = positions = None
    if mask is not None:  # the mask and positions of the context and the pass, as `generate` builds them
        full = torch.cat([mask, torch.ones_like(prompt, dtype=torch.bool), mask], dim=1)  # [batch, n + prompt + n]
        positions = (full.long().cumsum(-1) - 1).masked_fill_(~full, 1)
    cache.retention.begin_context_scoring(full)  # raises for an empty cache or one that already evicted
    done, n = 0, ctx.shape[1]
    try:
        for lo in range(0, recon.shape[1], policy.chunk_tokens):
            chunk = recon[:, lo: lo + policy.chunk_tokens]
            extra = {} if mask is None else {"attention_mask": full[:, : n + lo + chunk.shape[1]].long(),
                                             "position_ids": positions[:, n + lo: n + lo + chunk.shape[1]]}
            model(chunk, **cache_kwargs(cache), use_cache=True, logits_to_keep=1, **extra)
            done += chunk.shape[1]
    except BaseException:
        cache.retention.end_context_scoring(cache.retention_stats().tokens_held - ctx.shape[1], compress=False)
        raise
    return cache.retention.end_context_scoring(done)


def _prompt_ids(tokenizer, prompt_ids, device) -> torch.Tensor:
    """The repeat prompt as a `[m]` long tensor on `device`: `prompt_ids`, else `repeat_prompt_ids(tokenizer)`, else
    empty.

    Raises:
        ValueError: `prompt_ids` not a flat sequence (or 1-D integer tensor) of ints (bools and floats refused: they
            would be silently truncated); `tokenizer` not a tokenizer.
    """
    source = "prompt_ids"
    if prompt_ids is None and tokenizer is not None:
        source = "tokenizer"
        try:
            prompt_ids = repeat_prompt_ids(tokenizer)
        except Exception as exc:  # (what a non-tokenizer raises is anyone's guess)
            raise ValueError(f"`tokenizer` must be a Hugging Face tokenizer (`AutoTokenizer.from_pretrained(...)`), "
                             f"got {type(tokenizer).__name__} ({type(exc).__name__}: {exc}). Nothing was run or "
                             "evicted.") from None
    if prompt_ids is None:
        return torch.empty(0, dtype=torch.long, device=device)
    if isinstance(prompt_ids, Sequence) and not isinstance(prompt_ids, (str, bytes)):  # a list, tuple, range
        ids = list(prompt_ids)
        ok = all(not isinstance(i, bool) and isinstance(i, numbers.Integral) for i in ids)  # (numpy ints; not 1.5)
    else:  # a tensor or an array
        try:
            t = torch.as_tensor(prompt_ids) if not isinstance(prompt_ids, (str, bytes)) else None
        except (TypeError, ValueError, RuntimeError):
            t = None
        ok = t is not None and t.dim() == 1 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        ids = t.tolist() if ok else None
    if ok and any(not -2**63 <= int(i) < 2**63 for i in ids):  # (the vocabulary check below names the range)
        ok = False
    if not ok:
        what = ("`prompt_ids` must be" if source == "prompt_ids" else
                "`tokenizer` must be a Hugging Face tokenizer whose input_ids (repeat_prompt_ids) are")
        raise ValueError(f"{what} a flat sequence of ints (token ids, e.g. `repeat_prompt_ids(tokenizer)`) or a 1-D "
                         f"integer tensor, got {_describe(prompt_ids)}. Nothing was run or evicted.")
    return torch.tensor([int(i) for i in ids], dtype=torch.long, device=device)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _context_mask(attention_mask, shape: tuple[int, int], device) -> torch.Tensor | None:
    """`attention_mask` as a `[batch, n]` bool tensor on `device`, or None when it masks nothing.

    Raises:
        ValueError: not of `shape`, or not left padding (`LeftPadding.from_mask`).
    """
    if attention_mask is None:
        return None
    from hf_pagedkv.adapter.left_padding import LeftPadding  # (the adapter package imports this one)

    try:
        padding = LeftPadding.from_mask(attention_mask)
    except (ValueError, TypeError, RuntimeError) as exc:  # (RuntimeError: e.g. a mask on the meta device)
        raise ValueError(f"compress_context: {str(exc).removeprefix('set_padding: ')} Nothing was run or "
                         "evicted.") from None
    mask = torch.as_tensor(attention_mask)
    if tuple(mask.shape) != shape:
        raise ValueError(f"compress_context: attention_mask has shape {tuple(mask.shape)}, but the context is {shape} "
                         "(rows, tokens): pass the mask of the very context the cache holds. Nothing was run or "
                         "evicted.")
    return mask.to(device).bool() if any(padding.tokens) else None
