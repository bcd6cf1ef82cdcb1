"""`check_request`: an `add_request` call's arguments checked and turned into a `Request` (nothing else touched)."""

from __future__ import annotations

import torch

from hf_pagedkv.errors import EMPTY_PROMPT, counted, out_of_vocabulary
from hf_pagedkv.serving.request import Request
from hf_pagedkv.serving.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 20  # when neither the call nor the generation config says (transformers' max_length)


def check_request(request_id, input_ids, max_new_tokens, generation_config, vocab_size: int, sampling: dict,
                  seed, eos_token_id, arrival: int, device, max_positions: int | None = None) -> Request:
    """A new `Request`, or `ValueError` naming the request and what is wrong with it.

    Args:
        request_id (`str`): the request's id.
        input_ids (`list[int]` or `torch.Tensor` of shape `[seq_len]` or `[1, seq_len]`): the prompt.
        max_new_tokens (`int` or `None`): None takes the generation config's (or `DEFAULT_MAX_NEW_TOKENS`).
        generation_config (`GenerationConfig`): default max_new_tokens and stop tokens.
        vocab_size (`int`): token ids must be in ``[0, vocab_size)``.
        sampling (`dict`): `do_sample`, `temperature`, `top_p`, `top_k`.
        seed (`int` or `None`): None draws one from torch's global generator (sampling only).
        eos_token_id (`int`, `list[int]` or `None`): stop tokens; None takes the generation config's.
        arrival (`int`): the request's place in arrival order.
        device (`torch.device`): where its sampling generator lives.
        max_positions (`int`, *optional*): the model's context (`max_position_embeddings`); a longer prompt, or
            one whose max_new_tokens would pass it, is refused (as the server and `hf-pagedkv generate` do).
    """
    where = f"add_request({request_id!r})"
    if not isinstance(request_id, str):
        raise ValueError(f"add_request: request_id must be a str, got {type(request_id).__name__} {request_id!r}.")
    prompt = _token_list(input_ids, where)
    if not prompt:
        raise ValueError(f"{where}: {EMPTY_PROMPT}.")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where}: {out_of_vocabulary(bad, f'position {prompt.index(bad)}', vocab_size)}")
    if max_positions is not None and len(prompt) > max_positions:
        raise ValueError(f"{where}: the prompt has {counted(len(prompt), 'token')}, more than the model's context "
                         f"of {max_positions} (max_position_embeddings); shorten it.")
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if max_positions is not None and len(prompt) + max_new_tokens > max_positions:
        raise ValueError(f"{where}: the prompt's {counted(len(prompt), 'token')} + max_new_tokens {max_new_tokens:,} "
                         f"pass the model's context of {max_positions:,} positions (max_position_embeddings): lower "
                         f"max_new_tokens to at most {max_positions - len(prompt):,}, or shorten the prompt.")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, ())) if sampling.get("do_sample") else 0
    params = SamplingParams(**sampling, seed=seed)
    params.check(where)
    stop = _stop_ids(generation_config.eos_token_id if eos_token_id is None else eos_token_id, where,
                     eos_token_id is None)
    return Request(request_id, prompt, max_new_tokens, params, stop, arrival, torch.device(device))


def _token_list(input_ids, where: str) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool or input_ids.dim() not in (1, 2) \
                or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"{where}: input_ids must be integer token ids of shape [seq_len] or [1, seq_len], got "
                             f"{input_ids.dtype} of shape {tuple(input_ids.shape)}.")
        return input_ids.reshape(-1).tolist()
    if isinstance(input_ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in input_ids):
        return list(input_ids)
    if isinstance(input_ids, (list, tuple)):
        i, bad = next((i, t) for i, t in enumerate(input_ids) if isinstance(t, bool) or not isinstance(t, int))
        raise ValueError(f"{where}: input_ids must be a list of int token ids (or a [seq_len] tensor); its element "
                         f"{i} is {bad!r} ({type(bad).__name__}).")
    raise ValueError(f"{where}: input_ids must be a list of int token ids (or a [seq_len] tensor), got "
                     f"{type(input_ids).__name__}.")


def _stop_ids(eos, where: str, from_config: bool) -> frozenset[int]:
    """Stop tokens as a set; negative ids mean none (transformers' convention)."""
    if eos is None:
        return frozenset()
    ids = [eos] if isinstance(eos, int) else eos
    if isinstance(eos, bool) or not isinstance(ids, (list, tuple, set, frozenset)) \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        source = "the generation config's eos_token_id" if from_config else "eos_token_id"
        raise ValueError(f"{where}: {source} must be an int or a list of ints, got {eos!r}.")
    return frozenset(t for t in ids if t >= 0)


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "check_request"]
