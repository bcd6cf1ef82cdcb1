"""`compress_context`: KVzip's reconstruction pass through a prefilled `PagedCache`, then the compression."""

from __future__ import annotations

from typing import Sequence

import torch

from hf_pagedkv._compat import cache_kwargs
from hf_pagedkv.retention.kv_zip import REPEAT_PROMPT, KVzip


def repeat_prompt_ids(tokenizer) -> list[int]:
    """The token ids of KVzip's repeat instruction (`REPEAT_PROMPT`) as a user turn followed by the start of the
    assistant's turn when `tokenizer` has a chat template, else the instruction as plain text on its own line."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": REPEAT_PROMPT}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
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
        prompt_ids (`Sequence[int]`, *optional*): the repeat prompt's token ids; with neither argument, the context
            is repeated right after itself.

    Returns:
        `dict[int, torch.Tensor]`: the scores per layer index, `[batch, num_kv_heads, n]` float32 each.

    Raises:
        ValueError: the model's attention is not ``"hf_pagedkv"``; the cache has no `KVzip` policy, is empty,
            already evicted tokens, or does not hold exactly `context_ids` (length or batch differ). Nothing is
            evicted then, and the cache holds the context as before.
    """
    from hf_pagedkv.adapter.paged_cache import PagedCache  # the cache module imports the retention package

    if not isinstance(cache, PagedCache):
        raise ValueError(f"compress_context compresses a hf_pagedkv.PagedCache, got {type(cache).__name__}.")
    policy = cache.retention_policy
    if not isinstance(policy, KVzip):
        raise ValueError(f"compress_context needs a cache built with retention=hf_pagedkv.KVzip(...), got "
                         f"retention={policy!r}.")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "hf_pagedkv":
        raise ValueError(f'compress_context scores the context inside the "hf_pagedkv" attention, but the model uses '
                         f'{impl!r}: load it with attn_implementation="hf_pagedkv" (or call '
                         'model.set_attn_implementation("hf_pagedkv")).')
    ctx = torch.as_tensor(context_ids, dtype=torch.long, device=model.device)
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
