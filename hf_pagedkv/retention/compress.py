"""`compress_context`: KVzip's reconstruction pass through a prefilled `PagedCache`, then the compression."""

from __future__ import annotations

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
                     ) -> dict[int, torch.Tensor]:
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
            holds (the same for every row when 1-D).
        tokenizer (*optional*): builds the repeat prompt (`repeat_prompt_ids`) when `prompt_ids` is not given.
            Pass one (or `prompt_ids`): without a prompt the context is repeated right after itself, which scored
            worse (1 of 3 keys against 2 of 3, same setting as `repeat_prompt_ids`).
        prompt_ids (`Sequence[int]`, *optional*): the repeat prompt's token ids.

    Returns:
        `dict[int, torch.Tensor]`: the scores per layer index, `[batch, num_kv_heads, n]` float32 each.

    Raises:
        ValueError: the model's attention is not ``"hf_pagedkv"``; the cache has no `KVzip` policy, is empty,
            already evicted tokens, or does not hold exactly `context_ids` (length or batch differ); a token id
            outside the vocabulary. Nothing is evicted then, and the cache holds the context as before.
    """
    from hf_pagedkv.adapter.paged_cache import PagedCache  # the cache module imports the retention package

    if not isinstance(cache, PagedCache):
        raise ValueError(f"compress_context compresses a hf_pagedkv.PagedCache, got {type(cache).__name__}.")
    policy = cache.retention_policy
    if not isinstance(policy, KVzip):
        raise ValueError(f"compress_context needs a cache built with retention=hf_pagedkv.KVzip(...), got "
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
        raise ValueError(f"compress_context: the cache holds {cache.num_rows} rows of {stats.tokens_seen} tokens, "
                         f"but `context_ids` is {tuple(ctx.shape)}: prefill exactly the context, then compress.")
    if prompt_ids is None:
        prompt_ids = repeat_prompt_ids(tokenizer) if tokenizer is not None else []
    prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=model.device)[None].expand(ctx.shape[0], -1)
    vocab = model.get_input_embeddings().num_embeddings
    for name, ids in (("context_ids", ctx), ("prompt_ids", prompt)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"`{name}` holds token ids outside the model's vocabulary [0, {vocab}): "
                             f"{int(ids.min())} .. {int(ids.max())}. Nothing was run or evicted.")
    recon = torch.cat([prompt, ctx], dim=1)  # [batch, prompt + n]
    cache.begin_context_scoring()  # raises for an empty cache or one that already evicted
    done = 0
    try:
        for lo in range(0, recon.shape[1], policy.chunk_tokens):
            chunk = recon[:, lo: lo + policy.chunk_tokens]
            model(chunk, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
            done += chunk.shape[1]
    except BaseException:
        cache.end_context_scoring(cache.retention_stats().tokens_held - ctx.shape[1], compress=False)
        raise
    return cache.end_context_scoring(done)
