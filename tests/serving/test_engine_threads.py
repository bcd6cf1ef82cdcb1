"""The background loop: requests added, streamed and cancelled from other threads; stop and resume; streaming in
the caller's thread (which steps the engine)."""

import threading

import pytest

from hf_pagedkv import BlockPool, Engine
from hf_pagedkv.serving import RequestStatus
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, solo, tiny_single_thread  # noqa: F401

NEW = 10


def test_background_loop_serves_threads_that_stream():
    prompts = [prompt(n, seed=50 + n) for n in (3, 8, 13, 18, 6, 11)]
    pool = BlockPool(block_size=BLOCK, num_blocks=30, debug=True)
    got = {}

    def client(engine, i):
        rid = engine.add_request(prompts[i], max_new_tokens=NEW)
        got[i] = list(engine.stream(rid))

    with Engine(tiny_model("llama"), pool, max_batch_tokens=9) as engine:
        assert engine.is_started
        threads = [threading.Thread(target=client, args=(engine, i)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not engine.is_started
    assert [got[i] for i in range(len(prompts))] == [solo("llama", p, NEW) for p in prompts]
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_stop_keeps_requests_and_step_resumes_them():
    prompts = [prompt(9, 61), prompt(14, 62)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=4)
    engine.start()
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    engine.stop()
    assert not engine.is_started
    run_checked(engine)  # whatever the thread did, the rest is stepped here
    assert [engine.output(r).generated_tokens for r in rids] == [solo("llama", p, NEW) for p in prompts]


def test_stream_steps_the_engine_without_a_thread_and_cancel_ends_it():
    prompts = [prompt(5, 71), prompt(7, 72)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool)
    a, b = (engine.add_request(p, max_new_tokens=NEW) for p in prompts)
    stream = engine.stream(b)
    first = [next(stream) for _ in range(3)]
    engine.cancel(b)
    rest = list(stream)
    assert first + rest == solo("llama", prompts[1], NEW)[: len(first) + len(rest)]
    assert engine.output(b).status == RequestStatus.CANCELLED
    assert list(engine.stream(a)) == solo("llama", prompts[0], NEW)
    out = engine.pop_output(a)
    assert out.request_id == a and len(out.timestamps) == NEW
    assert pool.stats().blocks_in_use == 0


def test_a_stream_closed_or_dropped_before_its_end_cancels_the_request():
    prompts = [prompt(5, 73), prompt(9, 74), prompt(6, 75)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool)
    a, b, c = (engine.add_request(p, max_new_tokens=NEW) for p in prompts)
    stream = engine.stream(a)
    assert next(stream) == solo("llama", prompts[0], NEW)[0]
    stream.close()
    assert engine.output(a).status == RequestStatus.CANCELLED
    dropped = engine.stream(b)
    next(dropped)
    del dropped  # a client that goes away
    assert engine.output(b).status == RequestStatus.CANCELLED
    assert list(engine.stream(c)) == solo("llama", prompts[2], NEW)  # the others go on, exact
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_close_cancels_unfinished_requests_and_frees_their_blocks():
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool)
    rids = [engine.add_request(prompt(n, n), max_new_tokens=NEW) for n in (6, 10)]
    engine.step()
    assert pool.stats().blocks_in_use > 0
    engine.close()
    assert pool.stats().blocks_in_use == 0
    assert {engine.output(r).status for r in rids} == {RequestStatus.CANCELLED}


def test_a_fault_outside_the_forward_fails_the_running_requests_and_the_loop_goes_on():
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=64)
    first = engine.add_request(prompt(9, 71), max_new_tokens=NEW)
    engine.step()  # admitted: running
    schedule, calls = engine._scheduler.schedule, []

    def faulty_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scheduler fault")
        return schedule()

    engine._scheduler.schedule = faulty_once
    with engine:
        with pytest.raises(RuntimeError, match="engine fault"):
            list(engine.stream(first))
        second = engine.add_request(prompt(7, 72), max_new_tokens=NEW)
        assert list(engine.stream(second)) == solo("llama", prompt(7, 72), NEW)
    out = engine.output(first)
    assert (out.status, out.error, len(out.generated_tokens)) == (RequestStatus.FAILED, "engine fault (see the log)", 1)
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0
