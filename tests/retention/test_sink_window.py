"""`SinkWindow` (StreamingLLM): middle blocks are freed as a stream grows, and what stays is exactly what attention
sees -- checked against the model run without a cache under a mask hiding exactly the evicted positions."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import SinkWindow
from hf_pagedkv.blocks.block_table import num_blocks_for
from tests.conftest import ids, tiny_model
from tests.retention.reference import masked_reference, run_steps, sink_window_visible
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4  # block size: small, so a short stream crosses many block boundaries
# a prefill, decode steps, then multi-token steps after evictions (a question, chunked prefill, assisted decoding)
STEPS = [13, 1, 1, 1, 5, 1, 7, 1, 1, 3, 1, 1, 9, 1]


@pytest.fixture(scope="module")
def llama(one_thread):
    return tiny_model("llama")


@pytest.mark.parametrize("sink_tokens, window", [(4, 8), (0, 8), (2, 11), (4, 1)])
def test_outputs_equal_the_masked_reference(llama, sink_tokens, window):
    x = ids(1, sum(STEPS), seed=3)
    policy = SinkWindow(sink_tokens=sink_tokens, window=window)
    cache = PagedCache(block_size=B, config=llama.config, retention=policy, debug=True)
    visible, held = sink_window_visible(STEPS, B, sink_tokens, window)
    seen = []

    def check(c, start, q):
        c.check_invariants()
        seen.append((c.get_seq_length(), c.retention_stats().tokens_held))

    got = run_steps(llama, x, STEPS, cache, before=check)
    want = masked_reference(llama, x, visible)
    assert (got - want).abs().max() < CROSS_STEP_LOGIT_ATOL  # different step shapes: reassociated sums only
    # positions keep counting every token; what is held is what the rule keeps
    assert [s for s, _ in seen] == [sum(STEPS[:i]) for i in range(len(STEPS))]
    assert [h for _, h in seen[1:]] == [len(h) for h in held[:-1]]
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (sum(STEPS), len(held[-1]))
    assert stats.tokens_evicted > 0 and stats.num_evictions > 0
    cache.check_invariants()
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().blocks_in_use == 0


def test_a_window_that_evicts_nothing_equals_dynamic_cache(llama):
    x = ids(2, 12, seed=5)
    cache = PagedCache(block_size=B, config=llama.config, retention=SinkWindow(sink_tokens=4, window=64), debug=True)
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    out = llama.generate(x, **cache_kwargs(cache), **kw)
    ref = llama.generate(x, **cache_kwargs(DynamicCache(config=llama.config)), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))  # same steps: bit-identical in fp32
    assert cache.retention_stats().tokens_evicted == 0


def test_a_cache_built_without_config_evicts_the_same(llama):
    x = ids(1, sum(STEPS), seed=3)
    policy = SinkWindow(sink_tokens=4, window=8)
    lazy = PagedCache(block_size=B, retention=policy, debug=True)
    built = PagedCache(block_size=B, config=llama.config, retention=policy)
    assert torch.equal(run_steps(llama, x, STEPS, lazy), run_steps(llama, x, STEPS, built))
    assert lazy.retention_stats() == built.retention_stats() and lazy.retention_stats().tokens_evicted > 0
    lazy.release()
    built.release()


def test_a_long_stream_holds_only_the_sink_and_window_blocks(llama):
    W, S = 16, 4
    pool = BlockPool(block_size=B, num_blocks=12)  # a fixed pool 12 blocks deep: 48 tokens, the stream is 400
    cache = PagedCache(pool=pool, config=llama.config, retention=SinkWindow(sink_tokens=S, window=W))
    x = ids(1, 8, seed=1)
    out = llama.generate(x, **cache_kwargs(cache), max_new_tokens=393, min_new_tokens=393, do_sample=False)
    assert out.shape[1] == 401 and cache.get_seq_length() == 400
    stats = pool.stats()
    # sink block + the blocks of the last W - 1 tokens plus this step's token (at most one partial block more)
    budget_blocks = num_blocks_for(S, B) + num_blocks_for(W, B)
    assert budget_blocks <= stats.blocks_in_use <= budget_blocks + 1
    assert stats.bytes_in_use == stats.blocks_in_use * stats.bytes_per_block
    held = cache.retention_stats().tokens_held
    assert stats.blocks_in_use == num_blocks_for(held, B) and held <= S + W + B - 1
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_quantized_blocks_are_evicted_as_blocks(llama):
    x = ids(1, sum(STEPS), seed=3)
    policy = SinkWindow(sink_tokens=4, window=8)
    fp = PagedCache(block_size=B, config=llama.config, retention=policy)
    q8 = PagedCache(block_size=B, config=llama.config, retention=policy, quant="k8v8", debug=True)
    checks = []
    got = run_steps(llama, x, STEPS, q8, before=lambda c, s, q: (c.check_invariants(), checks.append(s)))
    want = run_steps(llama, x, STEPS, fp)
    # int8 keys per channel and values per token: the logits move a little, the evicted set is the same
    assert (got - want).abs().max() < 0.05
    assert q8.block_tables() and len(q8.block_tables()[0]) == len(fp.block_tables()[0])
    assert q8.retention_stats() == fp.retention_stats()
    # window-only in a quantized pool: the first block (the fp sink) is freed, its successor is read decoded
    q0 = PagedCache(block_size=B, config=llama.config, retention=SinkWindow(0, 8), quant="k8v8", debug=True)
    run_steps(llama, x, STEPS, q0, before=lambda c, s, q: c.check_invariants())
    q0.check_invariants()
    for c in (fp, q8, q0):
        c.release()


def test_forks_and_beams_share_the_kept_blocks(llama):
    x = ids(1, 21, seed=2)
    cache = PagedCache(block_size=B, config=llama.config, retention=SinkWindow(sink_tokens=4, window=8), debug=True)
    run_steps(llama, x, [17, 1, 1, 1, 1], cache)
    fork = cache.fork()
    pool = cache.pool
    shared = cache.block_tables()[0]
    assert fork.block_tables()[0] == shared and all(pool.groups[0].allocator.refcount(b) == 2 for b in shared)
    # the fork continues with other tokens: both evict, the sink block stays shared, each equals a lone run
    a, b = ids(1, 9, seed=10), ids(1, 9, seed=11)
    la = run_steps(llama, a, [1] * 9, cache)
    lb = run_steps(llama, b, [1] * 9, fork)
    assert cache.block_tables()[0][0] == fork.block_tables()[0][0] == shared[0]
    assert pool.groups[0].allocator.refcount(shared[0]) == 2
    lone = PagedCache(block_size=B, config=llama.config, retention=SinkWindow(sink_tokens=4, window=8))
    run_steps(llama, x, [17, 1, 1, 1, 1], lone)
    assert torch.equal(run_steps(llama, b, [1] * 9, lone), lb)
    assert not torch.equal(la, lb)
    for c in (cache, fork, lone):
        c.check_invariants()
        c.release()
    # beam search and num_return_sequences: rows share blocks, evict together, nothing leaks
    pool = BlockPool(block_size=B)
    beams = PagedCache(pool=pool, config=llama.config, retention=SinkWindow(sink_tokens=4, window=8), debug=True)
    out = llama.generate(ids(1, 10, seed=4), **cache_kwargs(beams), num_beams=3, num_return_sequences=2,
                         max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert out.shape == (2, 40)
    assert beams.retention_stats().tokens_evicted > 0
    first = {row[0] for row in beams.block_tables()}
    assert len(first) == 1  # every beam still names the prompt's sink block
    beams.check_invariants()
    beams.release()
    assert pool.stats().blocks_in_use == 0


def test_evict_events_stats_and_crop(llama):
    pool = BlockPool(block_size=B)
    pool.events.enable()
    cache = PagedCache(pool=pool, config=llama.config, retention=SinkWindow(sink_tokens=4, window=8))
    x = ids(1, 30, seed=6)
    run_steps(llama, x, [20, 1, 3], cache)
    evicts = [e for e in pool.events.take_events() if e["kind"] == "evict"]
    assert evicts and all(e["policy"] == "sink_window" and e["seq"] == cache.seq_id for e in evicts)
    assert sum(e["tokens"] for e in evicts) == cache.retention_stats().tokens_evicted
    # assisted decoding crops the last step's tokens: fine; reaching into what the eviction kept is refused
    cache.crop(-2)
    assert cache.get_seq_length() == 22
    with pytest.raises(ValueError, match="evicted tokens cannot come back"):
        cache.crop(-10)
    cache.check_invariants()
    cache.release()


def test_bad_retention_arguments_are_refused(llama):
    with pytest.raises(ValueError, match="window"):
        SinkWindow(sink_tokens=4, window=0)
    with pytest.raises(ValueError, match="sink_tokens"):
        SinkWindow(sink_tokens=-1, window=8)
    with pytest.raises(ValueError, match="unknown policy 'sink'; the policies: sink_window"):
        PagedCache(retention="sink")  # a spec string, parsed as the CLI parses it
    with pytest.raises(ValueError, match="retention policy"):
        PagedCache(retention=object())
