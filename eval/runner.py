"""Model passes a drift run makes through a cache: teacher-forced scoring and greedy generation, token by token."""

from __future__ import annotations

import torch

from hf_pagedkv import cache_kwargs


@torch.inference_mode()
def prefill(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run the prompt `[1, prompt_len]` through `cache` and return the logits of its last position, `[vocab]`.

    Only the last position's logits are computed (`logits_to_keep=1`): a 2048-token prompt would otherwise
    materialise `[2048, vocab]` floats (400 MB for SmolLM2).
    """
    out = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


@torch.inference_mode()
def teacher_forced_logits(model, cache, window: torch.Tensor, prefill_len: int) -> torch.Tensor:
    """Prefill `window[:, :prefill_len]`, then feed the next tokens one at a time through `cache`.

    Each scored prediction is a decode step that reads its whole context through the cache under test, which is
    how a quantized cache is used in generation (a single prefill over the whole window would attend to the
    fresh, unquantized keys/values instead).

    Args:
        window (`torch.LongTensor` of shape `[1, prefill_len + score_len + 1]`): token ids.
        prefill_len (`int`): tokens prefilled at once.

    Returns:
        `torch.Tensor` of shape `[score_len, vocab]` (float32): logits predicting `window[0, prefill_len + 1:]`.
    """
    prefill(model, cache, window[:, :prefill_len])
    return decode_teacher_forced(model, cache, window, prefill_len)


@torch.inference_mode()
def decode_teacher_forced(model, cache, window: torch.Tensor, start: int) -> torch.Tensor:
    """Feed `window[:, start:-1]` one token at a time through a cache holding `window[:, :start]`.

    Returns:
        `torch.Tensor` of shape `[window_len - start - 1, vocab]` (float32): logits predicting `window[0, start + 1:]`.
    """
    logits = []
    for t in range(start, window.shape[1] - 1):
        out = model(input_ids=window[:, t: t + 1], **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)  # [window_len - start - 1, vocab]


@torch.inference_mode()
def greedy(model, cache, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None
           ) -> list[int]:
    """Greedy decoding (argmax, no logits processors) of up to `max_new_tokens` tokens after `prompt` `[1, len]`.

    Stops after an `eos_token_id` token (included) when one is given; with `None`, always generates
    `max_new_tokens` tokens, so continuations of every config have the same length.

    Returns:
        `list[int]`: the generated token ids.
    """
    return continue_greedy(model, cache, prefill(model, cache, prompt), max_new_tokens, eos_token_id)


@torch.inference_mode()
def continue_greedy(model, cache, last_logits: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | list[int] | None = None) -> list[int]:
    """Greedy decoding from a cache that already holds the prompt, whose last position gave `last_logits` `[vocab]`.

    Returns:
        `list[int]`: the generated token ids (see `greedy`).
    """
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    token = int(last_logits.argmax())
    tokens = [token]
    while len(tokens) < max_new_tokens and token not in eos:
        nxt = torch.tensor([[token]], dtype=torch.long, device=last_logits.device)
        out = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    return tokens
