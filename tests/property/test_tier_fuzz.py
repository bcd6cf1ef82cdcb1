"""Seeded fuzz with a small host tier: the server loop of test_prefix_fuzz, but a decode that finds the device tier
full swaps its request out (`offload`) instead of dropping it, and swapped requests come back (`prefetch`) when
there is room. Evicted prefix blocks go to the host tier too. After every action both tiers' invariants hold and
the host counters stay within [0, capacity]; every finished output equals its fresh run."""

import random
from collections import deque

import torch

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError
from tests.conftest import tiny_model
from tests.prefix_utils import LOGIT_TOL, Request, fresh_greedy, tiny_single_thread  # noqa: F401
from tests.property.test_prefix_fuzz import B, LONGEST, NEW_TOKENS, make_prompts

BLOCK_BYTES = 3072  # one block of the tiny llama: 3 layers x 2 heads x (16 + 16) dims x 4 bytes x 4 tokens


def test_fuzz_with_swapping_and_a_small_host_tier():
    model = tiny_model("llama")
    rnd = random.Random(7)
    prompts = make_prompts(rnd, 24)
    refs = [fresh_greedy(model, p, NEW_TOKENS) for p in prompts]
    pool = BlockPool(block_size=B, num_blocks=3 * LONGEST // (2 * B), prefix_caching=True, debug=True,
                     host_memory=10 * BLOCK_BYTES)
    pending: deque[int] = deque(range(len(prompts)))
    active: dict[int, Request] = {}
    swapped: dict[int, Request] = {}
    finished: dict[int, Request] = {}
    counts = {"admit": 0, "wait": 0, "decode": 0, "swap out": 0, "swap in": 0, "drop": 0, "finish": 0}

    def check():
        pool.check_invariants()
        if pool.host.tiers:
            h = pool.host.stats()
            assert h.num_blocks == 10
            assert 0 <= h.blocks_in_use <= 10 and 0 <= h.blocks_cached <= 10 and 0 <= h.blocks_free <= 10
            assert h.blocks_in_use + h.blocks_cached + h.blocks_free == h.num_blocks
            s = pool.stats()  # the same counts in PoolStats, and the bytes of every copy so far
            assert (s.host_blocks, s.host_blocks_in_use, s.host_blocks_cached, s.host_blocks_free) == (
                h.num_blocks, h.blocks_in_use, h.blocks_cached, h.blocks_free)
            assert s.bytes_to_host == s.blocks_to_host * BLOCK_BYTES == (h.blocks_offloaded + h.blocks_demoted) \
                * BLOCK_BYTES
            assert s.bytes_from_host == s.blocks_from_host * BLOCK_BYTES

    for _ in range(5000):
        if len(finished) == len(prompts):
            break
        ready = [i for i, r in active.items() if r.done]
        running = [i for i, r in active.items() if not r.done]
        actions = (["admit"] * 3 if pending else []) + (["decode"] * 6 if running else []) \
            + (["finish"] * 2 if ready else []) + (["swap in"] * 2 if swapped else [])
        action = rnd.choice(actions)
        if action == "admit":
            i = pending.popleft()
            req = Request(model, prompts[i], NEW_TOKENS)
            req.cache = PagedCache.from_prefix(pool, req.prompt, model=model, debug=True)
            try:
                req.step()
            except PoolExhaustedError:
                req.cache.release()
                pending.append(i)
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
            except PoolExhaustedError:  # preempt by swapping out; drop only when the host tier is full too
                req = active.pop(i)
                try:
                    req.cache.offload()
                    swapped[i] = req
                    counts["swap out"] += 1
                except PoolExhaustedError:
                    req.cache.release()
                    req.reset()
                    pending.append(i)
                    counts["drop"] += 1
        elif action == "swap in":
            i = rnd.choice(list(swapped))
            try:
                swapped[i].cache.prefetch()
            except PoolExhaustedError:
                counts["wait"] += 1
            else:
                active[i] = swapped.pop(i)
                counts["swap in"] += 1
        else:
            i = rnd.choice(ready)
            req = active.pop(i)
            req.cache.publish([req.sequence])
            req.cache.release()
            finished[i] = req
            counts["finish"] += 1
        check()
    assert len(finished) == len(prompts), counts
    for i, req in finished.items():
        tokens, logits = refs[i]
        assert req.tokens == tokens, f"request {i}: {req.tokens} != fresh {tokens}"
        diff = (torch.stack(req.logits) - logits).abs().max().item()
        assert diff <= LOGIT_TOL, f"request {i}: max |logit difference| {diff:.3g}"
    s, h = pool.stats(), pool.host.stats()
    assert s.blocks_in_use == 0 and h.blocks_in_use == 0
    # the run exercised what it is meant to: swaps both ways, demotions and hits served from the host
    assert counts["swap out"] > 0 and counts["swap in"] > 0, counts
    assert h.blocks_demoted > 0 and h.blocks_promoted > 0, h
