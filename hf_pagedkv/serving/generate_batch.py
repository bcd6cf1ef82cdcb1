"""`generate_batch`: transformers' `model.generate_batch`, on hf_pagedkv's engine and pool (one import to switch)."""

from __future__ import annotations

import copy

from hf_pagedkv.errors import counted
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.serving.engine import Engine
from hf_pagedkv.serving.request import RequestOutput
from hf_pagedkv.serving.request_checks import DEFAULT_MAX_NEW_TOKENS


def generate_batch(model, inputs: list[list[int]], generation_config=None, *, pool: BlockPool | None = None,
                   max_batch_tokens: int | None = None, progress_bar: bool = True,
                   max_new_tokens: int | None = None, retention=None) -> dict[str, RequestOutput]:
    """Generate for every prompt of `inputs` with continuous batching, in this thread, and return when all ended.

    The drop-in for ``model.generate_batch(inputs, generation_config)`` (transformers' continuous batching): the
    same inputs, and outputs with the same fields (`RequestOutput`: `generated_tokens`, `error`, `status`,
    `created_time`, `lifespan`, `timestamps`), keyed ``"req_0"``, ``"req_1"``, ... in input order. Greedy requests
    give the tokens of `model.generate` run on each prompt alone (fp32: identical tokens).

    Args:
        model (`PreTrainedModel`): a decoder-only model.
        inputs (`list[list[int]]`): the prompts' token ids.
        generation_config (`GenerationConfig` or `dict`, *optional*): `max_new_tokens` (else ``max_length -
            len(prompt)``, at least 1), `do_sample`, `temperature`, `top_k`, `top_p`, `eos_token_id`,
            `num_return_sequences`; the model's by default (a dict changes those fields of the model's).
        pool (`BlockPool`, *optional*): the KV pool (a fixed one preempts when full; ``prefix_caching=True``
            shares prompt prefixes); a new growable pool by default.
        max_batch_tokens (`int`, *optional*, defaults to 512): tokens per step.
        progress_bar (`bool`, *optional*, defaults to `True`): a tqdm bar of finished requests.
        max_new_tokens (`int`, *optional*): overrides the generation config's (as transformers' keyword does).
        retention (`RetentionPolicy` or `str`, *optional*): every request's retention policy, or a spec such as
            ``"sink_window:4:1024"`` (`Engine`'s `retention`).

    Returns:
        `dict[str, RequestOutput]`: one output per prompt and returned sequence; with ``num_return_sequences=n``
        each prompt's ``n - 1`` extra sequences are ``"req_<i>__child#<j>"``, listed before ``"req_<i>"``, as
        transformers names them (each its own request; with ``prefix_caching=True`` they prefill the prompt once).
        A request that could not run (too large for a fixed pool, or its step raised) has its `error` set and the
        others are unaffected.

    Raises:
        ValueError: a bad prompt (empty, ids outside the vocabulary), named by its index, before anything runs;
            bad engine, sampling or retention settings; ``num_beams > 1`` (no beam search here: `model.generate`
            with a `PagedCache` shares beams' blocks).
        KeyboardInterrupt: after every request's blocks were freed.
    """
    config = generation_config if generation_config is not None else model.generation_config
    if isinstance(config, dict):  # settings over the model's own, as `model.generate(**settings)` takes them
        settings, config = config, copy.deepcopy(model.generation_config)
        unknown = config.update(**settings)
        if unknown:
            raise ValueError(f"generate_batch: generation_config has no setting {sorted(unknown)[0]!r}; pass a "
                             "transformers GenerationConfig or a dict of its fields.")
    if not isinstance(inputs, (list, tuple)):
        raise ValueError(f"generate_batch: inputs must be a list of token-id lists, got {type(inputs).__name__}.")
    if (config.num_beams or 1) > 1:
        raise ValueError(f"generate_batch: num_beams={config.num_beams}, but continuous batching does not search "
                         "beams; use model.generate with a PagedCache (its beams share blocks), or num_beams=1.")
    copies = 1 if config.num_return_sequences is None else config.num_return_sequences
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"generate_batch: num_return_sequences must be an int >= 1, got {copies!r}.")
    engine = Engine(model, pool, generation_config=config, max_batch_tokens=max_batch_tokens, retention=retention)
    sampling = dict(do_sample=bool(config.do_sample))
    if config.do_sample:
        sampling.update(temperature=config.temperature if config.temperature is not None else 1.0,
                        top_k=config.top_k or 0, top_p=config.top_p if config.top_p is not None else 1.0)
    try:
        ids = []
        for i, prompt in enumerate(inputs):
            new = max_new_tokens if max_new_tokens is not None else config.max_new_tokens
            if new is None:
                length = config.max_length if config.max_length is not None else DEFAULT_MAX_NEW_TOKENS
                new = max(1, length - (len(prompt) if hasattr(prompt, "__len__") else 0))
            for rid in [f"req_{i}__child#{j}" for j in range(copies - 1)] + [f"req_{i}"]:
                ids.append(engine.add_request(prompt, rid, new, **sampling))
        bar = _progress(len(ids), progress_bar)
        done = 0
        while engine.has_unfinished:
            engine.step()
            finished = len(ids) - sum(not engine.output(rid).is_finished() for rid in ids) if bar else 0
            if bar is not None and finished > done:
                bar.update(finished - done)
                done = finished
        if bar is not None:
            bar.close()
        return {rid: engine.output(rid) for rid in ids}
    finally:
        engine.close()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # (transformers depends on tqdm; a bar is not worth failing for)
        return None
    return tqdm(total=total, desc=f"Solving {counted(total, 'request')}", unit="request")


__all__ = ["generate_batch"]
