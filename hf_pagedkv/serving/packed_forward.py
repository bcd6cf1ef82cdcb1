"""`PackedForward`: one forward of a scheduled step, its requests' tokens packed into one row (`packed_cache.py`)."""

from __future__ import annotations

import inspect

import torch

from hf_pagedkv._compat import cache_kwargs
from hf_pagedkv.adapter.paged_cache import PagedCache
from hf_pagedkv.serving.packed_attention import packed_attention
from hf_pagedkv.serving.packed_cache import PackedCache, PackedSegment
from hf_pagedkv.serving.request import Request
from hf_pagedkv.serving.scheduler import StepBatch


class PackedForward:
    """Runs a `StepBatch` through the model: builds the packed `input_ids` and `position_ids` `[1, num_step_tokens]`
    and a `PackedCache` over the requests' own caches, switches the model to the packed attention for the call,
    and returns the logits of the positions that predict a token (each sampling chunk's last token).

    Decode segments read their blocks in place (``"hf_pagedkv"``'s `paged_attention_forward`: quantized codes read
    by the C kernel on the CPU, nothing de-quantized) when the pool is quantized, or when the model's own attention
    is ``"hf_pagedkv"``; otherwise (a full-precision pool, the model on `sdpa`) every segment attends with `sdpa`
    over its history, exactly as `generate` does.

    Args:
        model (`PreTrainedModel`): the model; fixed.
        pool (`BlockPool`, *optional*): the requests' pool; a quantized one (`pool.quant.is_quantized`) is read in
            place at decode. None: as a full-precision pool.
    """

    def __init__(self, model, pool=None) -> None:
        self.model = model  # fixed
        # decode segments read in place whatever the model's attention: de-quantizing each request's whole history
        # in every layer and step costs more than the read of the codes; fixed
        self.quantized_pool = pool is not None and pool.quant.is_quantized
        self.device = model.device  # where the inputs go; fixed
        # only the sampled positions go through the LM head (transformers' `logits_to_keep`), when the model takes it
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """The step's forward.

        Returns:
            `torch.Tensor` of shape `[sampling chunks, vocab]`: the logits of each chunk with `samples`, in order.
        """
        ids, positions, keep, segments = [], [], [], []
        for c in batch.chunks:
            lo = len(ids)
            ids += _tokens(c.request, c.start, c.start + c.num_tokens)
            positions += range(c.start, c.start + c.num_tokens)
            segments.append(PackedSegment(c.request.cache, lo, len(ids), c.start))
            if c.samples:
                keep.append(len(ids) - 1)  # the chunk's last token predicts the next one
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, num_step_tokens]
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, num_step_tokens]
        kwargs = {}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = torch.tensor(keep, device=self.device) if keep else 1
        with torch.no_grad(), packed_attention(self.model, self.quantized_pool) as read_in_place:
            cache = PackedCache(segments, read_in_place)
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **cache_kwargs(cache),
                             **kwargs)
        logits = out.logits[0]  # [kept positions, vocab]
        if not keep:
            return logits[:0]
        return logits if self.keeps_logits else logits[keep]

    def size_pool(self, pool) -> None:
        """Register the model's layers in `pool` (and so give a `max_memory` pool its blocks, counted when the
        first layer registers): run one token through a throwaway cache."""
        cache = PagedCache(pool=pool, config=self.model.config)
        try:
            with torch.no_grad():
                self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=True,
                           **cache_kwargs(cache))
        finally:
            cache.release()


def _tokens(req: Request, lo: int, hi: int) -> list[int]:
    """Tokens ``lo .. hi - 1`` of prompt + generated, without joining the two lists."""
    P = len(req.prompt)
    if lo >= P:
        return req.generated[lo - P: hi - P]
    return req.prompt[lo: min(hi, P)] + req.generated[: max(0, hi - P)]


__all__ = ["PackedForward"]
