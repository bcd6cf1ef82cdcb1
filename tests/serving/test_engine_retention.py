"""Retention policies in the `Engine`, per request: greedy requests prefilled in one step and never preempted give
the tokens of a solo `model.generate` on a `PagedCache` with the same policy (fp32, tiny models, sliding windows
too); a prompt prefilled in chunks gives the tokens of the same chunks run alone; preempted (recomputed or swapped)
requests finish with the pool's invariants held and no block left in use; retention lets a small fixed pool run
what it must preempt, or refuse, without; bad or unsupported policies are refused naming the call."""

import pytest
import torch

from hf_pagedkv import BlockPool, Engine, PagedCache, cache_kwargs, generate_batch
from hf_pagedkv.retention import KVzip, KeyNorm, PyramidKV, SinkWindow, SnapKV
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, solo, tiny_single_thread  # noqa: F401

POLICY = SinkWindow(sink_tokens=4, window=8)  # a sink block and two or three blocks of window (block size 4)
SPEC = "sink_window:4:8"
NEW = 24  # tokens generated: the window is passed many times


def solo_retention(name, ids, new, policy=POLICY, chunk=None):
    """Greedy tokens of `ids` alone on a `PagedCache(retention=policy)`: `model.generate` (one prefill step), or,
    with `chunk`, the prompt fed in chunks of that many tokens and then decoded token by token (up to the model's
    stop token, as `generate`). Returns the tokens and the cache's `retention_stats()`."""
    model = tiny_model(name)
    cache = PagedCache(config=model.config, block_size=BLOCK, retention=policy)
    try:
        with torch.no_grad():
            if chunk is None:
                input_ids = torch.tensor([ids])
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                     max_new_tokens=new, **cache_kwargs(cache))
                return out[0, len(ids):].tolist(), cache.retention_stats()
            for lo in range(0, len(ids), chunk):
                logits = model(input_ids=torch.tensor([ids[lo: lo + chunk]]), **cache_kwargs(cache)).logits
            tokens = [int(logits[0, -1].argmax())]
            eos = model.generation_config.eos_token_id
            stop = set([eos] if isinstance(eos, int) else eos or [])
            while len(tokens) < new and tokens[-1] not in stop:
                logits = model(input_ids=torch.tensor([tokens[-1:]]), **cache_kwargs(cache)).logits
                tokens.append(int(logits[0, -1].argmax()))
            return tokens, cache.retention_stats()
    finally:
        cache.release()


def finished(engine, rids):
    outs = [engine.output(r) for r in rids]
    assert all(o.status.name == "FINISHED" and o.error is None for o in outs), outs
    return outs


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_one_step_prefills_equal_solo_generate_with_the_same_policy(name):
    # several requests decoding side by side, each prompt prefilled in one step: exactly the solo tokens
    prompts = [prompt(n, seed=n) for n in (3, 9, 16, 21)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model(name), pool, retention=SPEC)
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    run_checked(engine)
    outs = finished(engine, rids)
    refs = [solo_retention(name, p, NEW) for p in prompts]
    assert [o.generated_tokens for o in outs] == [tokens for tokens, _ in refs]
    assert all(stats.tokens_evicted > 0 for _, stats in refs)  # the policy evicted in every reference run
    assert any(tokens != solo(name, p, NEW) for p, (tokens, _) in zip(prompts, refs))  # and changed an answer
    assert pool.stats().blocks_in_use == 0 and engine.stats().num_preemptions == 0


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_chunked_prefill_equals_the_same_chunks_run_alone(name):
    # a budget of 5 tokens cuts a prompt of 30 into chunks of 5 (off block boundaries); the policy evicts between
    # them, so the later chunks attend to held keys at virtual positions (and, in gemma2's sliding layers, to a
    # window of 8 realigned after each eviction): the answer is that of the same chunks fed to a PagedCache alone,
    # whose masks transformers builds from `get_mask_sizes`, and not that of a one-step prefill
    p = prompt(30, seed=9)
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model(name), pool, max_batch_tokens=5, retention=POLICY)
    rid = engine.add_request(p, max_new_tokens=NEW)
    run_checked(engine)
    chunked, stats = solo_retention(name, p, NEW, chunk=5)
    assert finished(engine, [rid])[0].generated_tokens == chunked
    assert chunked != solo_retention(name, p, NEW)[0]  # evicting between the chunks changed the answer
    assert stats.num_evictions > 0
    assert pool.stats().blocks_in_use == 0


def test_a_small_fixed_pool_runs_with_retention_what_it_preempts_without():
    # 3 requests of 8 + 40 tokens need 12 blocks of 4 each without retention (36 > 16: preemptions); with
    # sink_window:4:8 each holds at most 5 blocks, so all three run side by side to the end
    prompts = [prompt(8, seed=s) for s in (1, 2, 3)]

    def serve(retention):
        pool = BlockPool(block_size=BLOCK, num_blocks=16, debug=True)
        engine = Engine(tiny_model("llama"), pool, retention=retention)
        rids = [engine.add_request(p, max_new_tokens=40) for p in prompts]
        run_checked(engine)
        outs = finished(engine, rids)
        assert pool.stats().blocks_in_use == 0
        return engine.stats(), outs

    plain, _ = serve(None)
    kept, outs = serve(SPEC)
    assert plain.num_preemptions > 0
    assert kept.num_preemptions == 0 and kept.num_allocation_failures == 0
    assert kept.num_steps < plain.num_steps  # (no recomputation)
    assert [o.generated_tokens for o in outs] == [solo_retention("llama", p, 40)[0] for p in prompts]


def test_a_request_longer_than_the_pool_runs_with_retention():
    # 8 + 200 tokens need 52 blocks: more than the pool's 16, so it is refused without a policy; with one it holds
    # at most sinks + window + a step's tokens (a recomputation's step may hold max_batch_tokens): 30 tokens
    pool = BlockPool(block_size=BLOCK, num_blocks=16, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=16)
    p = prompt(8, seed=4)
    plain = engine.add_request(p, max_new_tokens=200)
    kept = engine.add_request(p, max_new_tokens=200, retention=POLICY)
    run_checked(engine)
    assert engine.output(plain).status.name == "FAILED" and "needs 52 KV blocks" in engine.output(plain).error
    out = finished(engine, [kept])[0]
    assert len(out.generated_tokens) == 200 and out.generated_tokens == solo_retention("llama", p, 200)[0]
    assert engine.stats().kv_bytes_peak <= 16 * pool.groups[0].store.bytes_per_block
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("host", [None, "1MiB"])
def test_preempted_requests_finish_and_free_every_block(host):
    # 8 blocks for 4 requests of up to 5 blocks each: requests are preempted (recomputed from their tokens in a
    # fresh cache, or swapped to the host tier and back) and still finish, the invariants holding at every step
    prompts = [prompt(n, seed=n) for n in (6, 11, 14, 9)]
    pool = BlockPool(block_size=BLOCK, num_blocks=8, host_memory=host, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=7, retention=SPEC)
    rids = [engine.add_request(p, max_new_tokens=30) for p in prompts]
    run_checked(engine)
    outs = finished(engine, rids)
    assert engine.stats().num_preemptions > 0
    assert (engine.stats().num_swaps > 0) == (host is not None)
    assert all(len(o.generated_tokens) == 30 for o in outs)
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_a_token_level_policy_in_a_fixed_pool():
    # KeyNorm compacts every row to its budget before each step once it holds more (fresh blocks, then the old
    # ones freed): the scheduler promises the fresh blocks, so no step runs out; one-step prefills: solo tokens
    policy = KeyNorm(budget=10, sink_tokens=2, recent_tokens=4)
    prompts = [prompt(n, seed=n) for n in (12, 5, 17)]
    pool = BlockPool(block_size=BLOCK, num_blocks=20, debug=True)
    engine = Engine(tiny_model("llama"), pool, retention=policy)
    rids = [engine.add_request(p, max_new_tokens=16) for p in prompts]
    run_checked(engine)
    outs = finished(engine, rids)
    refs = [solo_retention("llama", p, 16, policy) for p in prompts]
    assert [o.generated_tokens for o in outs] == [tokens for tokens, _ in refs]
    assert all(stats.num_evictions > 0 for _, stats in refs)
    assert pool.stats().blocks_in_use == 0


def test_retention_requests_publish_their_prompt_blocks():
    # they look nothing up (an attached prefix would be evicted at other points), but publish their full prompt
    # blocks, computed before any eviction, for the requests after them
    model = tiny_model("llama")
    pool = BlockPool(block_size=BLOCK, prefix_caching=True, debug=True)
    engine = Engine(model, pool, retention=SPEC)
    p = prompt(13, seed=6)
    rid = engine.add_request(p, max_new_tokens=NEW)
    run_checked(engine)
    assert finished(engine, [rid])[0].generated_tokens == solo_retention("llama", p, NEW)[0]
    assert engine.stats().prefix_lookup_tokens == 0
    cache = PagedCache.from_prefix(pool, p, model=model)
    try:
        assert cache.get_seq_length() == 12  # the prompt's 3 full blocks
    finally:
        cache.release()


def test_a_request_overrides_the_engine_default():
    p = prompt(13, seed=5)
    engine = Engine(tiny_model("llama"), BlockPool(block_size=BLOCK, prefix_caching=True, debug=True),
                    retention=SPEC)
    default, none, own = (engine.add_request(p, max_new_tokens=NEW),
                          engine.add_request(p, max_new_tokens=NEW, retention=None),
                          engine.add_request(p, max_new_tokens=NEW, retention=SinkWindow(4, 12)))
    run_checked(engine)
    got = [o.generated_tokens for o in finished(engine, [default, none, own])]
    assert got == [solo_retention("llama", p, NEW)[0], solo("llama", p, NEW),
                   solo_retention("llama", p, NEW, SinkWindow(4, 12))[0]]
    assert len(set(map(tuple, got))) == 3
    assert engine.pool.stats().blocks_in_use == 0


def test_generate_batch_takes_a_retention_spec():
    prompts = [prompt(n, seed=n) for n in (4, 10)]
    outs = generate_batch(tiny_model("llama"), prompts, pool=BlockPool(block_size=BLOCK), max_new_tokens=NEW,
                          progress_bar=False, retention=SPEC)
    assert [outs[f"req_{i}"].generated_tokens for i in range(2)] == [solo_retention("llama", p, NEW)[0]
                                                                        for p in prompts]


@pytest.mark.parametrize("retention, message", [
    ("sink_window:4", "1 part after the name; expected sink_window:SINK:WINDOW"),
    ("no_such:3", "unknown policy 'no_such'"),
    (KVzip(compression_ratio=0.5, scoring="plain"), "reconstruction pass"),
    (PyramidKV(compression_ratio=0.5), "layer groups of their own"),
    (SnapKV(compression_ratio=0.5), "attn_implementation='hf_pagedkv'"),
    (0.5, "retention must be a hf_pagedkv.retention policy"),
])
def test_bad_or_unsupported_policies_are_refused_naming_the_call(retention, message):
    engine = Engine(tiny_model("llama"), BlockPool(block_size=BLOCK))
    with pytest.raises(ValueError, match="add_request\\('r1'\\)") as e:
        engine.add_request([5, 6, 7], "r1", retention=retention)
    assert message in str(e.value)
    assert not engine.has_unfinished  # nothing was queued
    with pytest.raises(ValueError, match="^Engine: ") as e:
        Engine(tiny_model("llama"), BlockPool(block_size=BLOCK), retention=retention)
    assert message in str(e.value)


def test_a_token_level_policy_runs_in_the_fewest_blocks_it_can():
    # KeyNorm(budget=8) with steps of at most 4 tokens holds at most 12 tokens (3 blocks) and compacts the kept 8
    # into 2 fresh blocks before freeing the old ones: 5 blocks at once. A pool of 5 runs it to the end (its step
    # promises count the old blocks freed before the new tokens open theirs); one of 4 refuses it at admission
    policy = KeyNorm(budget=8, sink_tokens=2, recent_tokens=4)
    p = prompt(6, seed=8)
    for num_blocks, status in ((5, "FINISHED"), (4, "FAILED")):
        pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, debug=True)
        engine = Engine(tiny_model("llama"), pool, max_batch_tokens=4, retention=policy)
        rid = engine.add_request(p, max_new_tokens=30)
        run_checked(engine, max_steps=200)
        out = engine.output(rid)
        assert out.status.name == status, out
        assert pool.stats().blocks_in_use == 0
    assert "needs 5 KV blocks" in out.error and "with retention=KeyNorm(budget=8" in out.error
    assert "max_batch_tokens=4" in out.error


@pytest.mark.parametrize("pool_settings", [dict(quant="k8v8"), dict(quant="k4v4", max_memory="40KiB")])
def test_quantized_pools_with_retention_finish(pool_settings):
    # chunked prefills (budget 9) next to decodes, a quantized store (a fixed budget with its full-precision stages
    # for the second): every request finishes, invariants hold at every step, no block is left in use
    pool = BlockPool(block_size=BLOCK, debug=True, **pool_settings)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=9, retention=SPEC)
    rids = [engine.add_request(prompt(n, seed=n), max_new_tokens=30) for n in (5, 13, 20, 7)]
    run_checked(engine)
    assert all(len(o.generated_tokens) == 30 for o in finished(engine, rids))
    assert pool.stats().blocks_in_use == 0
