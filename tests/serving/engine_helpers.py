"""Helpers for the serving tests: the solo reference run, prompts at block boundaries, and a checked step loop."""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from hf_pagedkv import cache_kwargs
from tests.conftest import VOCAB, tiny_model
from tests.prefix_utils import tiny_single_thread  # noqa: F401 (autouse fixture, for the modules importing it)

BLOCK = 4  # block size of the serving tests' pools: small, so short prompts cross several block boundaries



def prompt(length: int, seed: int) -> list[int]:
    """Random token ids avoiding the special ids 0..2 (2 is the tiny models' eos)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def boundary_lengths(block: int = BLOCK, ks=(1, 2, 5)) -> list[int]:
    """Prompt lengths k*block - 1, k*block, k*block + 1."""
    return [n for k in ks for n in (k * block - 1, k * block, k * block + 1)]


@functools.lru_cache(maxsize=None)
def _solo(name: str, ids: tuple[int, ...], max_new_tokens: int, eos: int | None) -> tuple[int, ...]:
    model = tiny_model(name)
    input_ids = torch.tensor([ids])
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, **cache_kwargs(DynamicCache(config=model.config)), **kwargs)
    return tuple(out[0, len(ids):].tolist())


def solo(name: str, ids: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy tokens of `model.generate` on `ids` alone with a `DynamicCache` (the reference), memoized."""
    return list(_solo(name, tuple(ids), max_new_tokens, eos))


def run_checked(engine, max_steps: int = 10_000) -> int:
    """Step `engine` until no request is left, checking the pool's invariants after every step. Returns steps."""
    steps = 0
    while engine.has_unfinished:
        engine.step()
        engine.pool.check_invariants()
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return steps
