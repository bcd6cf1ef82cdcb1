"""Preemption by swapping to the host tier (`BlockPool(host_memory=...)`): a preempted request's cache moves to host
memory and back, so nothing is recomputed and its tokens are exactly those of an unpreempted run; when the host
tier is full, preemption falls back to recomputation."""

from hf_pagedkv import BlockPool, Engine
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, solo, tiny_single_thread  # noqa: F401

NEW = 9
PROMPTS = [prompt(n, seed=500 + n) for n in (5, 9, 12, 17, 22, 3, 8)]


def serve(pool, **kwargs):
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=16)
    rids = [engine.add_request(p, max_new_tokens=NEW, **kwargs) for p in PROMPTS]
    run_checked(engine)
    return engine, [engine.output(r) for r in rids]


def test_swapped_requests_resume_without_recomputation():
    pool = BlockPool(block_size=BLOCK, num_blocks=14, host_memory="1MiB", debug=True)
    engine, outs = serve(pool)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swaps == stats.num_preemptions
    # every token computed once: the prompt, then each generated token but the last
    assert stats.num_tokens_computed == sum(len(p) + len(o.generated_tokens) - 1 for p, o in zip(PROMPTS, outs))
    assert [o.generated_tokens for o in outs] == [solo("llama", p, NEW) for p in PROMPTS]
    s = pool.stats()
    assert s.blocks_in_use == 0 and s.host_blocks_in_use == 0
    assert s.blocks_to_host > 0 and s.blocks_from_host == s.blocks_to_host


def test_a_full_host_tier_falls_back_to_recomputation():
    one_block = 3 * 2 * 2 * 16 * 4 * BLOCK  # layers x (K, V) x KV heads x head_dim x fp32 bytes x tokens
    pool = BlockPool(block_size=BLOCK, num_blocks=10, host_memory=4 * one_block, debug=True)
    engine, outs = serve(pool)
    stats = engine.stats()
    assert 0 < stats.num_swaps < stats.num_preemptions  # some caches did not fit the 4 host blocks
    once = sum(len(p) + len(o.generated_tokens) - 1 for p, o in zip(PROMPTS, outs))
    assert stats.num_tokens_computed > once  # the others were recomputed
    assert [o.generated_tokens for o in outs] == [solo("llama", p, NEW) for p in PROMPTS]
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0


def test_seeded_sampling_with_swaps_and_cancelling_a_swapped_request():
    _, free = serve(BlockPool(block_size=BLOCK, debug=True), do_sample=True, seed=7, top_k=30)
    pool = BlockPool(block_size=BLOCK, num_blocks=14, host_memory="1MiB", debug=True)
    engine, swapped = serve(pool, do_sample=True, seed=7, top_k=30)
    assert engine.stats().num_swaps > 0
    assert [o.generated_tokens for o in swapped] == [o.generated_tokens for o in free]
    # a request swapped out, then cancelled while it waits: its host blocks are freed
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=16)
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in PROMPTS]
    while not any(engine._requests[r].cache is not None and engine._requests[r].cache.is_offloaded for r in rids):
        engine.step()
        assert engine.has_unfinished
    assert pool.stats().host_blocks_in_use > 0
    for r in rids:
        engine.cancel(r)
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0


def test_swap_with_prefix_caching():
    system = prompt(8, seed=9)
    prompts = [system + prompt(n, seed=600 + n) for n in (2, 5, 7, 4)]
    pool = BlockPool(block_size=BLOCK, num_blocks=12, host_memory="1MiB", prefix_caching=True, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=10)
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    run_checked(engine)
    assert engine.stats().num_swaps > 0
    assert [engine.output(r).generated_tokens for r in rids] == [solo("llama", p, NEW) for p in prompts]
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0
