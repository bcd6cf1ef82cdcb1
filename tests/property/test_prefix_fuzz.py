"""Seeded fuzz: a small server loop over one prefix-caching pool sized for about 1.5 long sequences.

32 greedy requests whose prompts share random-length prefixes of a few documents are admitted, decoded,
finished or aborted in a random interleaving. When the pool is full, admission waits and a decode preempts its
request (released, restarted later). After every action the pool invariants hold; every finished output equals
its fresh run; at the end nothing is in use.
"""

import os
import random
from collections import deque

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError
from tests.conftest import VOCAB, ids, tiny_model
from tests.prefix_utils import (
    LOGIT_TOL,
    Request,
    fresh_greedy,
    tiny_single_thread,  # noqa: F401 (autouse fixture)
)

B = 4
NEW_TOKENS = 4
DOC_TOKENS = 36
LONGEST = DOC_TOKENS + 6 + NEW_TOKENS  # prompt (document prefix + suffix) plus generated tokens
SEEDS = [int(s) for s in os.environ.get("PREFIX_FUZZ_SEEDS", "0,1,2").split(",")]  # more: PREFIX_FUZZ_SEEDS=0,1,2,3,4


def make_prompts(rnd: random.Random, n: int) -> list[list[int]]:
    docs = [ids(1, DOC_TOKENS, seed=100 + d)[0].tolist() for d in range(3)]
    prompts = []
    for _ in range(n):
        shared = rnd.choice([0, B, 2 * B, 3 * B, rnd.randint(0, DOC_TOKENS)])  # block-aligned or not
        suffix = [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(1, 6))]
        prompts.append(rnd.choice(docs)[:shared] + suffix)
    return prompts


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_admit_decode_finish_abort(seed):
    model = tiny_model("llama")
    rnd = random.Random(seed)
    prompts = make_prompts(rnd, 32)
    refs = [fresh_greedy(model, p, NEW_TOKENS) for p in prompts]
    pool = BlockPool(block_size=B, num_blocks=3 * LONGEST // (2 * B), prefix_caching=True, debug=True)
    pending: deque[int] = deque(range(len(prompts)))
    active: dict[int, Request] = {}
    finished: dict[int, Request] = {}
    counts = {"admit": 0, "wait": 0, "decode": 0, "preempt": 0, "finish": 0, "abort": 0}

    def release(i: int) -> Request:
        req = active.pop(i)
        req.cache.release()
        return req

    for _ in range(5000):
        if len(finished) == len(prompts):
            break
        ready = [i for i, r in active.items() if r.done]
        running = [i for i, r in active.items() if not r.done]
        actions = (["admit"] * 3 if pending else []) + (["decode"] * 6 if running else []) \
            + (["finish"] * 2 if ready else []) + (["abort"] if active else [])
        action = rnd.choice(actions)
        if action == "admit":  # attach to the cached prefix, prefill the rest, publish the prompt
            i = pending.popleft()
            req = Request(model, prompts[i], NEW_TOKENS)
            req.cache = PagedCache.from_prefix(pool, req.prompt, model=model, debug=True)
            try:
                req.step()
            except PoolExhaustedError:
                req.cache.release()
                pending.append(i)  # wait for space
                counts["wait"] += 1
            else:
                req.cache.publish([req.prompt])
                active[i] = req
                counts["admit"] += 1
        elif action == "decode":
            i = rnd.choice(running)
            try:
                active[i].step()
                counts["decode"] += 1
            except PoolExhaustedError:  # preempt: drop its blocks, restart it later
                release(i).reset()
                pending.append(i)
                counts["preempt"] += 1
        elif action == "finish":  # publish the whole sequence (the cache holds all but the last token)
            i = rnd.choice(ready)
            req = active[i]
            req.cache.publish([req.sequence])
            finished[i] = release(i)
            counts["finish"] += 1
        else:  # abort: the client went away; the request is retried from scratch later
            i = rnd.choice(list(active))
            release(i).reset()
            pending.append(i)
            counts["abort"] += 1
        pool.check_invariants()
    assert len(finished) == len(prompts), counts

    for i, req in finished.items():
        tokens, logits = refs[i]
        assert req.tokens == tokens, f"request {i}: {req.tokens} != fresh {tokens}"
        diff = (torch.stack(req.logits) - logits).abs().max().item()
        assert diff <= LOGIT_TOL, f"request {i}: max |logit difference| {diff:.3g}"
    s = pool.stats()
    assert s.blocks_in_use == 0 and s.num_sequences == 0  # no leak
    pool.check_invariants()
    # the run exercised what it is meant to: hits, evictions, waiting, aborts
    assert s.hit_tokens > 0 and s.evictions > 0, s
    assert counts["abort"] > 0 and counts["wait"] + counts["preempt"] > 0, counts
