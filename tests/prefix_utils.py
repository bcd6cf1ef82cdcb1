"""Helpers for the prefix-caching tests: reference runs and a step-by-step greedy request."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import PagedCache, cache_kwargs
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

# A prefix hit computes only the suffix, in a step of its own, where the fresh run prefills everything at once:
# different step shapes, so logits agree to the cross-step bound, not bit for bit.
LOGIT_TOL = CROSS_STEP_LOGIT_ATOL
GEN = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}


@pytest.fixture(autouse=True)
def tiny_single_thread():
    """Run tiny models on one intra-op thread: their ops are too small to split, and on a shared machine extra
    threads only spin (the fuzz test runs ~8x faster). Import this fixture into a test module to use it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh_generate(model, input_ids: torch.Tensor, **kwargs):
    """`model.generate` with a new `DynamicCache`: the reference a prefix hit must reproduce."""
    return model.generate(input_ids, **cache_kwargs(DynamicCache()), **{**GEN, **kwargs})


def assert_same_output(ref, out, tol: float = LOGIT_TOL) -> None:
    """Greedy tokens identical, every step's logits within `tol` (default: the cross-step bound of a prefix hit)."""
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff <= tol, f"max |logit difference| {diff:.3g} > {tol}"


@torch.no_grad()
def fresh_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy-decode `n` tokens after `prompt` with a `DynamicCache`: (tokens, logits `[n, vocab]`)."""
    req = Request(model, prompt, n)
    req.cache = DynamicCache()
    while not req.done:
        req.step()
    return req.tokens, torch.stack(req.logits)


class Request:
    """One greedy request driven step by step, as a server would: prefill what the cache lacks, then decode.

    `cache` is set by the caller (e.g. `PagedCache.from_prefix`); `step()` runs one forward pass.
    """

    def __init__(self, model, prompt: list[int], max_new_tokens: int) -> None:
        self.model = model
        self.prompt = prompt  # token ids, no padding
        self.max_new_tokens = max_new_tokens
        self.cache: PagedCache | DynamicCache | None = None
        self.tokens: list[int] = []  # generated so far
        self.logits: list[torch.Tensor] = []  # [vocab] per generated token

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.max_new_tokens

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    @torch.no_grad()
    def step(self) -> None:
        """Feed every token the cache does not hold yet (the uncached prompt, or the last generated token)."""
        seq = self.sequence
        start = self.cache.get_seq_length()
        x = torch.tensor([seq[start:]])  # [1, new_tokens]
        logits = self.model(input_ids=x, **cache_kwargs(self.cache), use_cache=True).logits[0, -1]  # [vocab]
        self.logits.append(logits)
        self.tokens.append(int(logits.argmax()))

    def reset(self) -> None:
        """Start over (after an abort or preemption)."""
        self.cache, self.tokens, self.logits = None, [], []


def run_in_threads(work, n: int) -> None:
    """Run `work(t)` for `t` in ``range(n)``, each on its own thread; fail with every exception any of them raised."""
    errors = []

    def target(t):
        try:
            work(t)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
