"""`Engine.stats()`: queue lengths, counters, latency percentiles, KV bytes and prefix hits, with exact values."""

from hf_pagedkv import BlockPool, Engine
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, tiny_single_thread  # noqa: F401


def test_counters_latencies_and_kv_bytes():
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=64)
    a = engine.add_request(prompt(5, 1), max_new_tokens=4, eos_token_id=[])
    b = engine.add_request(prompt(3, 2), max_new_tokens=1, eos_token_id=[])
    engine.add_request(prompt(9, 3), max_new_tokens=4, eos_token_id=[])
    s = engine.stats()
    assert (s.num_waiting, s.num_running, s.num_steps, s.kv_bytes_peak) == (3, 0, 0, 0)
    engine.cancel("req_2")
    engine.step()  # a (5) and b (3) prefill; b is done after its first token
    s = engine.stats()
    assert (s.num_waiting, s.num_running, s.num_finished, s.num_cancelled) == (0, 1, 1, 1)
    assert (s.num_steps, s.num_tokens_computed, s.num_tokens_generated) == (1, 8, 2)
    run_checked(engine)
    s = engine.stats()
    # a: 5 prompt tokens + 3 fed-back tokens = 8 computed; its last step held 8 tokens = 2 blocks
    assert (s.num_steps, s.num_tokens_computed, s.num_tokens_generated) == (4, 11, 5)
    assert s.kv_bytes_peak == 3 * pool.stats().bytes_per_block  # first step: a's 2 blocks + b's 1
    assert s.kv_bytes_in_use == 0
    assert (s.ttft.count, s.tpot.count, s.e2e.count) == (2, 1, 2)  # b has one token: no time per output token
    assert s.ttft.p50 <= s.ttft.p95 <= s.ttft.p99 <= s.e2e.p99
    out = engine.output(a)
    assert s.e2e.p99 >= out.lifespan[1] - out.created_time - 1e-9
    assert abs(s.tpot.p50 - (out.timestamps[-1] - out.timestamps[0]) / 3) < 1e-9
    assert engine.output(b).generated_tokens and (s.num_preemptions, s.num_allocation_failures) == (0, 0)


def test_prefix_hits_and_preemptions_are_counted():
    system = prompt(12, seed=5)
    pool = BlockPool(block_size=BLOCK, num_blocks=14, prefix_caching=True, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=14)
    for n in (2, 3, 5, 6):
        engine.add_request(system + prompt(n, seed=n), max_new_tokens=10, eos_token_id=[])
    run_checked(engine)
    s = engine.stats()
    assert s.prefix_lookup_tokens == 4 * 12 + 2 + 3 + 5 + 6
    assert s.prefix_hit_tokens == 3 * 12  # the 3 system blocks, for requests 1-3
    assert s.prefix_hit_rate == s.prefix_hit_tokens / s.prefix_lookup_tokens
    assert s.num_preemptions > 0 and s.num_allocation_failures >= s.num_preemptions
    assert s.num_finished == 4 and s.kv_bytes_in_use == 0
    assert s.kv_bytes_peak <= 14 * pool.stats().bytes_per_block
