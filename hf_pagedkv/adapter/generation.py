"""`generate`: `model.generate` on a shared `BlockPool`, with prefix caching when the pool has it (attach, generate,
publish, release), and optionally swapping idle caches out to the host tier when the pool is full."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from hf_pagedkv._compat import CACHE_KWARG_NAMES, cache_kwargs
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.adapter.paged_cache import PagedCache
from hf_pagedkv.errors import EMPTY_PROMPT, PoolExhaustedError, out_of_vocabulary

logger = logging.getLogger(__name__)


def generate(model, input_ids: torch.LongTensor, pool: BlockPool, attention_mask: torch.Tensor | None = None,
             *, swap_on_exhaustion: bool = False, **generate_kwargs):
    """Run `model.generate` on `input_ids` with caches from `pool`, reusing the blocks of any prefix already cached
    there when the pool has prefix caching.

    Each row gets a cache on `pool` and runs `model.generate`; the cache is released afterwards, even if `generate`
    raises. With `BlockPool(prefix_caching=True)` the cache comes from `PagedCache.from_prefix` (the model computes
    only the tokens after the longest cached full-block prefix), and its full blocks are published before release
    -- the prompt and, for greedy or sampling without beams, the generated tokens too, so a follow-up turn hits the
    whole conversation. Without prefix caching nothing is looked up or published. Rows are generated one by one
    (each may hit a different prefix); left padding is removed first, so only real tokens are hashed and the output
    matches an unpadded run.

    Args:
        model (`PreTrainedModel`): a decoder-only model.
        input_ids (`torch.LongTensor` of shape `[batch, seq_len]` or `[seq_len]`): the prompts.
        pool (`BlockPool`): the pool the caches take their blocks from, shared by every request of this model
            (`prefix_caching=True` to share prompt prefixes between requests).
        attention_mask (`torch.Tensor` of shape `[batch, seq_len]`, *optional*): 1 for real tokens, 0 for left
            padding.
        swap_on_exhaustion (`bool`, *optional*, defaults to `False`): when a step of a row finds a fixed pool out
            of blocks (`PoolExhaustedError`), swap the least recently used idle caches of `pool` (other
            `PagedCache`s on it that no running request holds, see `BlockPool.idle_owners`) out to its host tier
            with `PagedCache.offload()`, and go on with that step: the row is not run again, so a `streamer` sees
            each token once and a sampling row draws from the random generator as it would without the swap (the
            same output). When no idle cache is left to swap (or the host tier is full), raise the error, with a
            note of what was swapped. A swapped cache stays offloaded until its owner calls `cache.prefetch()`, and
            then continues exactly. Needs `BlockPool(host_memory=...)`.
        generate_kwargs: passed to `model.generate` (`max_new_tokens`, `do_sample`, `num_beams`,
            `return_dict_in_generate`, ...); not the cache (`past_key_values`, or `cache` from 5.24).

    Returns:
        What `model.generate` returns for a batch of one. For a larger batch: a `[batch * num_return_sequences,
        seq_len + max_new]` tensor laid out as batched `generate` lays it out (the prompts as given, the new
        tokens right-padded with the pad token), or, with `return_dict_in_generate=True`, a list with one output
        per row (sequences without the padding).

    Raises:
        ValueError: `pool` not a `BlockPool`; `model` without `generate` and `config`; a cache given
            (`past_key_values` or `cache`); an empty prompt (a row without tokens); `attention_mask` not a
            left-padding mask of the same shape as `input_ids`; token ids not integers in the model's vocabulary
            ``[0, vocab_size)`` (nothing is run nor taken from `pool`); `swap_on_exhaustion` not a bool, or given
            without a host tier.
        PoolExhaustedError: a fixed pool has too few blocks for a row (with `swap_on_exhaustion`, even after
            swapping every idle cache out). The pool is left as before that row (and the swapped caches offloaded).

    Example:

    ```python
    >>> import hf_pagedkv
    >>> pool = hf_pagedkv.BlockPool(prefix_caching=True)
    >>> out = hf_pagedkv.generate(model, system_and_question_ids, pool=pool, max_new_tokens=32)
    >>> pool.stats().hit_rate    # share of prompt tokens served from cached blocks
    ```
    """
    if not isinstance(pool, BlockPool):
        raise ValueError(f"hf_pagedkv.generate needs `pool=` a hf_pagedkv.BlockPool, got {type(pool).__name__}.")
    if not callable(getattr(model, "generate", None)) or getattr(model, "config", None) is None:
        raise ValueError(f"hf_pagedkv.generate needs `model` a transformers model with .generate and .config (e.g. "
                         f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__}.")
    if not isinstance(swap_on_exhaustion, bool):
        raise ValueError(f"`swap_on_exhaustion` must be True or False, got {swap_on_exhaustion!r}.")
    if swap_on_exhaustion and pool.host is None:
        raise ValueError("swap_on_exhaustion=True swaps idle caches out to the pool's host tier, and this pool has "
                         "none: create it with BlockPool(..., host_memory=\"8GiB\"), or drop swap_on_exhaustion.")
    if given := [name for name in CACHE_KWARG_NAMES if name in generate_kwargs]:
        raise ValueError(f"hf_pagedkv.generate makes its own caches from `pool`; do not pass `{given[0]}`.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise ValueError(f"`input_ids` must be a [batch, seq_len] tensor, got {type(input_ids).__name__}"
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}.")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    empty = _empty_rows(input_ids, attention_mask)
    if empty:
        where = f" (row {empty[0]} of {input_ids.shape[0]})" if input_ids.shape[0] > 1 else ""
        raise ValueError(f"hf_pagedkv.generate: {EMPTY_PROMPT}{where}.")
    rows = _unpadded_rows(input_ids, attention_mask)
    _check_token_ids(model, rows, input_ids)
    run = _generate_row_swapping if swap_on_exhaustion else _generate_row
    outs = [run(model, row, pool, generate_kwargs) for row in rows]
    if len(outs) == 1 and (attention_mask is None or bool(attention_mask.all())):
        return outs[0]
    if generate_kwargs.get("return_dict_in_generate"):
        return outs
    return _pad_batch(model, input_ids, rows, outs, generate_kwargs)


def _empty_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Rows without a real token (no column, or an all-zero mask row); [0] for a batch of no rows."""
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        return list(range(input_ids.shape[0])) or [0]
    if attention_mask is None or attention_mask.shape != input_ids.shape:
        return []
    return (~attention_mask.bool().any(1)).nonzero().reshape(-1).tolist()


def _check_token_ids(model, rows: list[torch.Tensor], input_ids: torch.Tensor) -> None:
    """Raise `ValueError` unless every real token of `rows` (each `[1, n]`) is an integer id in the model's
    vocabulary ``[0, num_embeddings)``, as the serving engine's `check_request` does: else the embedding raises an
    index error (or a device-side assert under CUDA) from inside `model.generate`, before or after a cache is made."""
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"`input_ids` must hold integer token ids (torch.long), got {input_ids.dtype}; encode the "
                         "prompt with the model's tokenizer.")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):  # a model that tells neither: the embedding checks
        return
    for r, row in enumerate(rows):
        bad = ((row < 0) | (row >= vocab)).reshape(-1).nonzero()
        if bad.numel():
            pos = int(bad[0])
            where = f"row {r}, " if len(rows) > 1 else ""
            position = f"{where}position {pos} of the prompt's real tokens"
            raise ValueError(f"hf_pagedkv.generate: {out_of_vocabulary(int(row.reshape(-1)[pos]), position, vocab)}")


def _unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens, `[1, num_real_tokens]`."""
    if attention_mask is None:
        return [input_ids[r: r + 1] for r in range(input_ids.shape[0])]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}.")
    mask = attention_mask.bool()
    # left padding: zeros then ones, so each row's mask never goes from 1 back to 0
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()) or not bool(mask[:, -1].all()):
        raise ValueError("`attention_mask` must describe left padding (0s then 1s in each row); right padding and "
                         "holes are not supported by hf_pagedkv.generate.")
    return [input_ids[r, mask[r]][None] for r in range(input_ids.shape[0])]


def _generate_row(model, ids: torch.Tensor, pool: BlockPool, kwargs: dict, make_room=None):
    """One row's `model.generate` on a cache of `pool`, released afterwards. `make_room(cache, error)`, if given,
    becomes the cache's `on_exhausted` (bound to it)."""
    with contextlib.ExitStack() as stack:  # on the way out: unmark, then release the cache
        # NOTE: created and marked busy under the pool lock, so another thread's swap_on_exhaustion never sees it
        # idle (and swaps it out) before it runs
        with pool.lock:
            if pool.prefix_caching:
                cache = PagedCache.from_prefix(pool, ids, model=model)
            else:
                cache = PagedCache(pool=pool, config=model.config)
            stack.callback(cache.release)
            stack.enter_context(pool.owner_busy(cache.seq_id))  # not offered for swapping out while it runs
            if make_room is not None:
                cache.on_exhausted = functools.partial(make_room, cache)
        return _run_and_publish(model, ids, cache, pool, kwargs)


def _run_and_publish(model, ids: torch.Tensor, cache: PagedCache, pool: BlockPool, kwargs: dict):
    out = model.generate(ids, **cache_kwargs(cache), attention_mask=torch.ones_like(ids), **kwargs)
    if not pool.prefix_caching:
        return out
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    config = kwargs.get("generation_config") or model.generation_config
    plain = (kwargs.get("num_beams", config.num_beams) or 1) == 1 and kwargs.get("assistant_model") is None \
        and kwargs.get("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens) is None
    # NOTE: beam search returns the best finished beams, not the cache rows in order, and assisted decoding
    # crops; there only the prompt (identical in every row) is known to match the cached K/V.
    if plain and sequences.shape[0] == cache.num_rows:
        cache.publish(sequences)
    else:
        cache.publish(ids)
    return out


def _generate_row_swapping(model, ids: torch.Tensor, pool: BlockPool, kwargs: dict):
    """`_generate_row` whose steps, when they find the pool exhausted, swap the least recently used idle caches out
    to the host tier and are planned again (`generate(swap_on_exhaustion=True)`).

    NOTE: the row goes on where it stopped rather than running again from its start: a rerun would repeat what
    generate did before (a streamer would see the prompt and the first tokens twice) and sample from a random
    generator the first run advanced (another output than the same seeded request without the swap)."""
    swapped: list[int] = []

    def make_room(cache: PagedCache, error: PoolExhaustedError) -> bool:
        held = len({b for row in cache.block_tables() for b in row})  # of the full-attention group
        more = _swap_out(pool, max(1, _request_blocks(model, ids, pool, kwargs) - held))
        if more:
            swapped.extend(more)
            logger.info("hf_pagedkv.generate: pool exhausted; swapped idle caches %s out to the host tier", more)
            return True
        if swapped:
            error.add_note(f"swap_on_exhaustion: swapped {len(swapped)} idle caches (seq_id {swapped}) out to the "
                           "host tier; no idle cache is left to swap (or the host tier is full).")
        else:
            error.add_note("swap_on_exhaustion: no idle cache could be swapped out: none is idle, or the host tier "
                           "has no room for one (raise host_memory).")
        return False

    return _generate_row(model, ids, pool, kwargs, make_room)


def _swap_out(pool: BlockPool, need: int) -> list[int]:
    """Offload idle caches of `pool`, least recently used first, until `need` blocks of the full-attention group
    could be reserved (at least one cache when any frees a block). Returns their tokens."""
    swapped = []
    with pool.lock:  # no other thread marks a listed cache busy (and starts running it) before it is swapped
        for idle in pool.idle_owners():
            if swapped and pool.groups[0].can_reserve(need):
                break
            if idle.num_exclusive_blocks == 0:  # every block is shared with another cache: swapping frees nothing
                continue
            try:
                idle.offload()
            except PoolExhaustedError:  # the host tier has no room for this one; a smaller one may fit
                continue
            swapped.append(idle.token)
    return swapped


def _request_blocks(model, ids: torch.Tensor, pool: BlockPool, kwargs: dict) -> int:
    """Blocks one row of prompt plus new tokens takes in a full-attention group, without prefix hits or sharing.

    NOTE: a lower bound for beams and several return sequences (they share the prompt and copy only their tails);
    it only decides how many caches to swap before the next try, which swaps more if it fails again."""
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new is None:
        new = max(0, (kwargs.get("max_length", config.max_length) or 0) - ids.shape[1])
    return -(-(ids.shape[1] + new) // pool.block_size)


def _pad_batch(model, input_ids: torch.Tensor, rows: list[torch.Tensor], outs: list[torch.Tensor], kwargs: dict):
    """Lay per-row outputs out as batched `generate` does: prompt as given, new tokens right-padded."""
    news = [out[:, row.shape[1]:] for row, out in zip(rows, outs)]  # [num_return_sequences, new_r]
    width = max(n.shape[1] for n in news)
    config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    if pad is None:
        eos = kwargs.get("eos_token_id", config.eos_token_id)
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None and any(n.shape[1] != width for n in news):
        raise ValueError("rows generated different lengths and the model has no pad_token_id; pass pad_token_id=.")
    out = []
    for r, new in enumerate(news):
        fill = new.new_full((new.shape[0], width - new.shape[1]), pad if pad is not None else 0)
        prompt = input_ids[r: r + 1].expand(new.shape[0], -1)  # [num_return_sequences, seq_len]
        out.append(torch.cat([prompt, new, fill], dim=1))
    return torch.cat(out, dim=0)  # [batch * num_return_sequences, seq_len + width]
