"""`KVzip`: keep the context tokens the model attends to when it repeats the context (Kim et al., arXiv 2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.policy import EvictionPlan, check_int
from hf_pagedkv.retention.score_pooling import check_pooling, pool_scores

#: the instruction of the reconstruction pass, before the context is given again (KVzip's repeat prompt)
REPEAT_PROMPT = "Repeat the previous context exactly."


@dataclass(frozen=True)
class KVzip(ImportancePolicy):
    """Query-agnostic context compression: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction" (arXiv 2505.23416). After the context is prefilled, `hf_pagedkv.compress_context` runs a
    *reconstruction* pass through the cache: a repeat prompt (`REPEAT_PROMPT`) and then the context tokens again,
    in steps of `chunk_tokens`. Each cached context token is scored, per (layer, KV head), by the highest softmax
    attention weight it receives from any reconstruction query (max over the queries and over the query heads of the
    KV head's GQA group; `ContextScores`): a token the model needs to reproduce the context is one a later question
    may need too, whatever the question. The reconstruction tokens are then cropped, and each (layer, KV head) keeps
    its best-scored context tokens (plus the protected sinks and recent tokens), compacted into fresh blocks as
    `ImportancePolicy` describes; the blocks beyond the budget go back to the pool. Keys keep their RoPE positions,
    and later steps (the question) attend exactly to what is kept.

    Unlike the other policies it never evicts on its own: nothing is evicted until `compress_context` is called (a
    cache used without it keeps everything). Its cost is one extra forward pass over the context (plus the prompt),
    and the scores' matmul per layer (about the attention's own).

    The cache does not see queries: load the model with ``attn_implementation="hf_pagedkv"``.

    Args:
        budget (`int`, *optional*): context tokens each (layer, KV head) keeps.
        compression_ratio (`float`, *optional*): in (0, 1), the fraction of the context removed.
        sink_tokens (`int`, *optional*, defaults to 4): leading tokens always kept.
        recent_tokens (`int`, *optional*, defaults to 16): trailing context tokens always kept.
        chunk_tokens (`int`, *optional*, defaults to 1024): reconstruction tokens per forward step (bounds the peak
            memory of the pass; the scores do not depend on it).
        kernel_size (`int`, *optional*, defaults to 1): a pooling of the scores over this many neighbouring
            tokens, odd (SnapKV's clustering step, so a kept token keeps its neighbours; 1: none, KVzip's own
            scores).
        pooling (`str`, *optional*, defaults to `"max"`): `"max"` (a token scores as its best neighbour) or `"avg"`
            (as the mean of its window; past either end only the tokens there are counted), as `SnapKV`'s.

    Raises:
        ValueError: as `ImportancePolicy`; `chunk_tokens` not an int >= 1; `kernel_size` not an odd int >= 1;
            `pooling` not one of `POOLINGS`.

    Example:

    ```python
    >>> from hf_pagedkv import KVzip, PagedCache, cache_kwargs, compress_context
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_pagedkv")
    >>> cache = PagedCache(config=model.config, retention=KVzip(compression_ratio=0.5))
    >>> model(context_ids, **cache_kwargs(cache))                  # prefill the context
    >>> compress_context(model, cache, context_ids, tokenizer=tok)  # reconstruct, score, evict
    >>> out = model.generate(torch.cat([context_ids, question_ids], 1), **cache_kwargs(cache), max_new_tokens=32)
    ```
    """

    recent_tokens: int = 16
    chunk_tokens: int = 1024
    kernel_size: int = 1
    pooling: str = "max"

    name = "kv_zip"
    reconstructs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunk_tokens", self.chunk_tokens, 1)
        check_pooling(self.kernel_size, self.pooling)

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """Nothing: KVzip compresses only through `compress_context` (`keep_for`)."""
        return EvictionPlan()

    def max_held(self, new: int, block_size: int) -> int | None:
        return None  # the context is compressed once; what comes after is kept

    def scores(self, keys: torch.Tensor, observed: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction scores of the held tokens.

        Args:
            keys (`torch.Tensor` of shape `[batch, num_kv_heads, held, head_dim]`): one layer's held keys.
            observed (`torch.Tensor` of shape `[batch, num_kv_heads, held]`): the layer's `ContextScores`.

        Returns:
            `torch.Tensor` of shape `[batch, num_kv_heads, held]`, float32: `observed`, max- or average-pooled
            (`pooling`) over `kernel_size` tokens.

        Raises:
            ValueError: no scores, or scores of another shape (the reconstruction pass did not run on this context).
        """
        if observed is None or tuple(observed.shape) != tuple(keys.shape[:3]):
            got = None if observed is None else tuple(observed.shape)
            raise ValueError(f"KVzip scores tokens by a reconstruction pass: expected scores of shape "
                             f"{tuple(keys.shape[:3])}, got {got}. Call hf_pagedkv.compress_context(model, cache, "
                             "context_ids) after the prefill.")
        return pool_scores(observed.float(), self.kernel_size, self.pooling)
