"""Greedy requests served together give each the tokens of its solo `model.generate` (fp32, DynamicCache): mixed
lengths, prompts at block boundaries, chunk boundaries, preemption in a small fixed pool, prefix caching, and
sliding-window models. The pool's invariants hold after every step and no block is in use at the end."""

import pytest
import torch

from hf_pagedkv import BlockPool, Engine, PagedCache, cache_kwargs
from tests.conftest import tiny_model
from tests.serving.engine_helpers import (BLOCK, boundary_lengths, prompt, run_checked, solo,  # noqa: F401
                                          tiny_single_thread)

NEW = 9  # tokens generated per request: crosses at least two block boundaries while decoding


def serve(name, prompts, pool, max_batch_tokens, new=NEW):
    engine = Engine(tiny_model(name), pool, max_batch_tokens=max_batch_tokens)
    rids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    run_checked(engine)
    return engine, [engine.output(r) for r in rids]


def assert_solo(name, prompts, outs, new=NEW):
    for p, out in zip(prompts, outs):
        assert out.error is None and out.status.name == "FINISHED", out
        assert out.generated_tokens == solo(name, p, new), f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("max_batch_tokens", [3, 8, 13, 512])
def test_block_boundary_prompts_equal_solo(max_batch_tokens):
    # prompts of k*B-1, k*B, k*B+1 tokens; budgets of 3 and 13 cut prefill chunks off block boundaries, 8 on them,
    # 512 prefills every prompt in one step
    prompts = [prompt(n, seed=n) for n in boundary_lengths()]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens)
    assert_solo("llama", prompts, outs)
    assert pool.stats().blocks_in_use == 0
    assert engine.stats().num_tokens_computed == sum(len(p) + NEW - 1 for p in prompts)


def test_one_step_holds_decodes_and_prefill_chunks():
    # a late long prompt is prefilled in chunks while the early requests decode, in the same forward steps
    prompts = [prompt(5, 1), prompt(7, 2), prompt(30, 3)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=10)
    first = [engine.add_request(p, max_new_tokens=NEW) for p in prompts[:2]]
    engine.step()  # both prompts in one step (12 > 10 tokens: the second is cut at 5)
    engine.step()
    late = engine.add_request(prompts[2], max_new_tokens=NEW)
    mixed = []
    while engine.has_unfinished:
        running = [engine.output(r).status.name for r in first + [late]]
        mixed.append(running)
        engine.step()
        pool.check_invariants()
    assert ["DECODING", "DECODING", "PREFILLING"] in mixed  # decodes next to a prefill chunk
    assert_solo("llama", prompts, [engine.output(r) for r in first + [late]])


@pytest.mark.parametrize("num_blocks", [12, 20])
def test_preemption_keeps_every_request_exact(num_blocks):
    # a small fixed pool: the latest requests are preempted (blocks freed) and recomputed later, tokens unchanged
    prompts = [prompt(n, seed=100 + n) for n in (5, 9, 12, 17, 22, 3, 8)]
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=16)
    assert_solo("llama", prompts, outs)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_allocation_failures >= stats.num_preemptions
    assert sum(o.num_preemptions for o in outs) == stats.num_preemptions
    assert stats.num_failed == 0 and stats.num_finished == len(prompts)
    assert pool.stats().blocks_in_use == 0


def test_preemption_order_is_latest_arrival_first():
    # 3 requests of 11 prompt tokens + 8 new in 12 blocks of 4: the third cannot get blocks while the first two
    # run, and the second is preempted (never the first) when the first needs more
    prompts = [prompt(11, seed=s) for s in (1, 2, 3)]
    pool = BlockPool(block_size=BLOCK, num_blocks=12, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=64, new=8)
    assert outs[0].num_preemptions == 0
    assert outs[1].num_preemptions + outs[2].num_preemptions == engine.stats().num_preemptions > 0
    assert_solo("llama", prompts, outs, new=8)


def test_prefix_caching_shares_prompt_blocks_in_flight():
    # four questions after one 16-token system prompt; the first request's prompt blocks are published as soon
    # as its prefill step completes, so the later ones (admitted in later steps: the first step's 19 tokens fill
    # its budget) attach to them
    system = prompt(16, seed=7)
    prompts = [system + prompt(n, seed=20 + n) for n in (3, 5, 6, 9)]
    pool = BlockPool(block_size=BLOCK, prefix_caching=True, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=19)
    assert_solo("llama", prompts, outs)
    stats = engine.stats()
    # request 0 computes all 19 prompt tokens; 1-3 find the 16 system tokens (4 blocks) cached
    assert stats.prefix_hit_tokens == 3 * 16
    assert stats.prefix_lookup_tokens == sum(map(len, prompts))
    assert pool.stats().blocks_in_use == 0 and pool.stats().blocks_cached > 0


def test_requests_arriving_together_prefill_a_shared_prefix_once():
    # one step's budget holds every prompt, yet requests 1 and 2 wait one step for request 0's 16 system tokens
    # instead of computing them again; request 3 (another prefix) is not held back behind them
    system = prompt(16, seed=9)
    prompts = [system + prompt(n, seed=50 + n) for n in (3, 5, 6)] + [prompt(10, seed=59)]
    pool = BlockPool(block_size=BLOCK, prefix_caching=True, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=512)
    assert_solo("llama", prompts, outs)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 2 * 16
    assert stats.num_tokens_computed == 16 + 3 + 5 + 6 + 10 + sum(len(o.generated_tokens) - 1 for o in outs)
    first = [o.timestamps[0] for o in outs]  # a step's tokens share its time
    assert first[3] == first[0] < first[1] == first[2]
    assert pool.stats().blocks_in_use == 0


def test_prefix_caching_with_preemption():
    system = prompt(12, seed=8)
    prompts = [system + prompt(n, seed=40 + n) for n in (2, 7, 4, 9, 5)]
    pool = BlockPool(block_size=BLOCK, num_blocks=16, prefix_caching=True, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=16)
    assert_solo("llama", prompts, outs)
    assert engine.stats().num_preemptions > 0
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("name", ["gemma2", "qwen2", "gpt2"])
def test_other_architectures(name):
    # gemma2: sliding-window (8) and full layers in two layer groups, attention soft-capping
    prompts = [prompt(n, seed=n) for n in (3, 9, 17, 26)]
    for num_blocks in (None, 24):
        pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, debug=True)
        _, outs = serve(name, prompts, pool, max_batch_tokens=11)
        assert_solo(name, prompts, outs)
        assert pool.stats().blocks_in_use == 0


def test_compaction_between_steps_keeps_tokens_and_is_skipped_for_a_shared_pool():
    # requests prefilled together interleave their decode blocks; compaction moves them back into runs
    prompts = [prompt(n, seed=200 + n) for n in (6, 10, 14, 9)]
    moved = {}
    for compact in (0, 256):
        pool = BlockPool(block_size=BLOCK, debug=True)
        engine = Engine(tiny_model("llama"), pool, max_batch_tokens=64, compact_blocks=compact)
        rids = [engine.add_request(p, max_new_tokens=12) for p in prompts]
        run_checked(engine)
        assert_solo("llama", prompts, [engine.output(r) for r in rids], new=12)
        moved[compact] = pool.stats().blocks_moved
    assert moved[0] == 0 and moved[256] > 0
    # another cache holds a row in the pool: its owner may be running a forward in another thread, so no moves
    pool = BlockPool(block_size=BLOCK, debug=True)
    other = PagedCache(pool=pool, config=tiny_model("llama").config)
    tiny_model("llama")(input_ids=torch.tensor([[5, 6, 7]]), **cache_kwargs(other))
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=64)
    rids = [engine.add_request(p, max_new_tokens=12) for p in prompts]
    run_checked(engine)
    assert pool.stats().blocks_moved == 0
    assert_solo("llama", prompts, [engine.output(r) for r in rids], new=12)
    other.release()


def test_model_on_the_read_in_place_attention(monkeypatch):
    # a model configured with "hf_pagedkv": decode segments read their blocks in place (paged attention), the
    # model gets its attention back after every step, and the greedy tokens are still the solo ones
    import hf_pagedkv.attention.attention_function as attention_function

    reads = []
    real = attention_function.paged_attention
    monkeypatch.setattr(attention_function, "paged_attention", lambda *a, **k: reads.append(1) or real(*a, **k))
    model = tiny_model("llama")
    prompts = [prompt(n, seed=300 + n) for n in (3, 9, 17, 26)]
    refs = [solo("llama", p, NEW) for p in prompts]
    model.set_attn_implementation("hf_pagedkv")
    try:
        pool = BlockPool(block_size=BLOCK, debug=True)
        engine, outs = serve("llama", prompts, pool, max_batch_tokens=11)
        assert model.config._attn_implementation == "hf_pagedkv"
    finally:
        model.set_attn_implementation("sdpa")
    assert [o.generated_tokens for o in outs] == refs
    assert pool.stats().blocks_in_use == 0
    assert len(reads) > 0


@pytest.mark.parametrize("quant", ["k8v8", "k4v4"])
def test_quantized_pool_equals_solo_paged_generate(quant):
    # each request's blocks are encoded on their own (per block, when full), so a request served in packed steps
    # gets the tokens it gets alone in a PagedCache of the same storage; the steps interleave the caches layer by
    # layer, and a block encoded by one request's first layer keeps its stage until its last layer wrote it
    from hf_pagedkv import PagedCache

    model = tiny_model("llama")
    prompts = [prompt(n, seed=400 + n) for n in (3, 9, 17, 26, 8)]
    refs = []
    for p in prompts:
        with PagedCache(pool=BlockPool(block_size=BLOCK, quant=quant), config=model.config) as cache:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 **cache_kwargs(cache))
            refs.append(out[0, len(p):].tolist())
    # every prompt in one chunk (a chunk attends to the earlier chunks' tokens de-quantized, a one-shot prefill to
    # them in full precision): the solo tokens
    pool = BlockPool(block_size=BLOCK, quant=quant, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=64)
    assert [o.generated_tokens for o in outs] == refs
    assert pool.stats().blocks_in_use == 0
    # chunked prefill and preemption (recomputed tokens attend to each other in full precision): the tokens may
    # drift within the codec's error, so here the invariants (checked after every step: encode once, every stage
    # owned by a live block, no poisoned read), completion and no leak
    pool = BlockPool(block_size=BLOCK, quant=quant, num_blocks=12, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=11)
    assert engine.stats().num_preemptions > 0 and engine.stats().num_finished == len(prompts)
    assert all(len(o.generated_tokens) == NEW for o in outs)
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_quantized_pool_decodes_read_in_place(quant):
    # a quantized pool's decode segments read their codes in place (the model stays on sdpa): one in-place read per
    # request, layer and decode token, but for the first layer of each request's first decode step (there its cache
    # hands a de-quantized copy, read by sdpa, with the view the attention confirms; later steps start confirmed);
    # the tokens are those of a solo PagedCache generate with the "hf_pagedkv" attention on the same storage (every
    # prompt prefilled in one step)
    from hf_pagedkv.attention import READ_COUNTS

    model = tiny_model("llama")
    prompts = [prompt(n, seed=500 + n) for n in (3, 9, 17, 26, 8)]
    refs = []
    model.set_attn_implementation("hf_pagedkv")
    try:
        for p in prompts:
            with PagedCache(pool=BlockPool(block_size=BLOCK, quant=quant), config=model.config) as cache:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                     **cache_kwargs(cache))
                refs.append(out[0, len(p):].tolist())
    finally:
        model.set_attn_implementation("sdpa")
    READ_COUNTS.reset()
    pool = BlockPool(block_size=BLOCK, quant=quant, debug=True)
    engine, outs = serve("llama", prompts, pool, max_batch_tokens=64)
    snap = READ_COUNTS.snapshot()
    assert model.config._attn_implementation == "sdpa"
    assert [o.generated_tokens for o in outs] == refs
    assert engine.stats().num_steps == NEW  # one prefill step, then the decode steps
    decoded = sum(len(o.generated_tokens) - 1 for o in outs)  # decode segments (a request may stop at eos)
    served = snap["served"]
    assert snap["fallbacks"] == {} and not any(k.startswith("fp") for k in served), snap
    assert decoded >= 3 * (NEW - 1)
    decoding = sum(len(o.generated_tokens) > 1 for o in outs)
    assert sum(served.values()) == decoded * model.config.num_hidden_layers - decoding, snap
    assert pool.stats().blocks_in_use == 0
    # a full-precision pool keeps sdpa (bit-exact against generate): no read in place
    READ_COUNTS.reset()
    engine, outs = serve("llama", prompts, BlockPool(block_size=BLOCK, debug=True), max_batch_tokens=64)
    assert READ_COUNTS.snapshot()["served"] == {}
    assert_solo("llama", prompts, outs)
