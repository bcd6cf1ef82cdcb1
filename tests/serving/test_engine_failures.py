"""Cancel, stop tokens, an exception or a KeyboardInterrupt in a forward step, bad inputs: the request's blocks are
freed (or never taken) and the other requests go on, exact."""

import contextlib

import pytest
import torch

from hf_pagedkv import BlockPool, Engine
from hf_pagedkv.serving import RequestStatus
from tests.conftest import VOCAB, tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, solo, tiny_single_thread  # noqa: F401

NEW = 8


@contextlib.contextmanager
def raising_in_forward(model, make_error, on_call: int = 1, action=None):
    """Make the second decoder layer raise `make_error()` at its `on_call`-th forward (or run `action()` there)."""
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == on_call:
            if action is not None:
                action()
            else:
                raise make_error()

    handle = model.model.layers[1].register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def blocks_held(engine, rids):
    return sum(len(engine._requests[r].cache.block_tables()[0]) for r in rids if engine._requests[r].cache)


def test_cancel_waiting_running_and_finished():
    model = tiny_model("llama")
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(model, pool, max_batch_tokens=6)
    prompts = [prompt(5, 1), prompt(9, 2), prompt(6, 3)]
    a, b, c = (engine.add_request(p, max_new_tokens=NEW) for p in prompts)
    assert engine.cancel(c)  # still waiting: never touches the pool
    assert engine.output(c).status == RequestStatus.CANCELLED and engine.output(c).finish_reason == "cancelled"
    for _ in range(4):
        engine.step()
    assert engine.output(b).status in (RequestStatus.DECODING, RequestStatus.PREFILLING)
    before = pool.stats().blocks_in_use
    held_b = blocks_held(engine, [b])
    assert held_b > 0
    assert engine.cancel(b)  # running: its blocks go back at once
    assert pool.stats().blocks_in_use == before - held_b
    pool.check_invariants()
    run_checked(engine)
    assert engine.output(a).generated_tokens == solo("llama", prompts[0], NEW)
    assert not engine.cancel(a) and not engine.cancel(b)  # already ended
    assert pool.stats().blocks_in_use == 0
    with pytest.raises(KeyError, match="req_9"):
        engine.cancel("req_9")
    stats = engine.stats()
    assert (stats.num_cancelled, stats.num_finished) == (2, 1)


def test_cancel_during_the_forward_of_its_step():
    model = tiny_model("llama")
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(model, pool)
    prompts = [prompt(7, 4), prompt(10, 5)]
    a, b = (engine.add_request(p, max_new_tokens=NEW) for p in prompts)
    engine.step()
    with raising_in_forward(model, None, on_call=1, action=lambda: engine.cancel(b)):
        engine.step()  # b is cancelled from inside the forward: it ends with the step
    assert engine.output(b).status == RequestStatus.CANCELLED
    assert engine._requests[b].cache is None
    run_checked(engine)
    assert engine.output(a).generated_tokens == solo("llama", prompts[0], NEW)
    assert pool.stats().blocks_in_use == 0


def test_stop_token_ends_a_request():
    prompts = [prompt(6, 11), prompt(13, 12)]
    stop = solo("llama", prompts[0], NEW)[2]  # the third greedy token of the first prompt
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=8)
    a = engine.add_request(prompts[0], max_new_tokens=NEW, eos_token_id=stop)
    b = engine.add_request(prompts[1], max_new_tokens=NEW, eos_token_id=[])
    run_checked(engine)
    out = engine.output(a)
    assert out.finish_reason == "stop" and out.generated_tokens[-1] == stop
    assert out.generated_tokens == solo("llama", prompts[0], NEW, eos=stop)
    assert engine.output(b).finish_reason == "length"
    assert engine.output(b).generated_tokens == solo("llama", prompts[1], NEW)
    assert pool.stats().blocks_in_use == 0


def test_exception_in_a_forward_fails_that_steps_requests_only():
    model = tiny_model("llama")
    pool = BlockPool(block_size=BLOCK, debug=True)
    engine = Engine(model, pool, max_batch_tokens=6)
    prompts = [prompt(5, 21), prompt(5, 22), prompt(5, 23), prompt(5, 24)]
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    # the first step holds request 0 (5 tokens) and 1 token of request 1; 2 and 3 wait
    with raising_in_forward(model, lambda: RuntimeError("boom in layer 1"), on_call=1):
        assert engine.step() == 0
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0  # the failed requests' blocks are back
    for rid in rids[:2]:
        out = engine.output(rid)
        assert out.status == RequestStatus.FAILED and out.finish_reason == "error"
        assert out.error == "RuntimeError: boom in layer 1"
    run_checked(engine)
    for rid, p in zip(rids[2:], prompts[2:]):
        assert engine.output(rid).generated_tokens == solo("llama", p, NEW)
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        list(engine.stream(rids[0]))
    assert engine.stats().num_failed == 2 and pool.stats().blocks_in_use == 0


def test_keyboard_interrupt_mid_step_requeues_and_resumes_exactly():
    model = tiny_model("llama")
    pool = BlockPool(block_size=BLOCK, num_blocks=24, debug=True)
    engine = Engine(model, pool, max_batch_tokens=10)
    prompts = [prompt(n, 30 + n) for n in (4, 9, 14)]
    rids = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    for _ in range(3):
        engine.step()
    in_step = [r for r in rids if engine._requests[r].cache is not None]
    assert in_step
    with raising_in_forward(model, KeyboardInterrupt, on_call=1):
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0  # every request of the step is queued again, its blocks freed
    assert all(engine.output(r).status == RequestStatus.PENDING for r in in_step)
    run_checked(engine)
    for rid, p in zip(rids, prompts):
        assert engine.output(rid).generated_tokens == solo("llama", p, NEW)
    assert pool.stats().blocks_in_use == 0


def test_too_large_request_fails_at_admission_others_run():
    pool = BlockPool(block_size=BLOCK, num_blocks=8, debug=True)  # 32 tokens
    engine = Engine(tiny_model("llama"), pool)
    ok = engine.add_request(prompt(10, 1), max_new_tokens=NEW)
    big = engine.add_request(prompt(30, 2), max_new_tokens=NEW)  # 37 tokens stored: 10 blocks > 8
    ok2 = engine.add_request(prompt(12, 3), max_new_tokens=NEW)
    run_checked(engine)
    out = engine.output(big)
    assert out.status == RequestStatus.FAILED and out.generated_tokens == []
    assert "needs 10 KV blocks" in out.error and "holds 8" in out.error
    assert engine.output(ok).generated_tokens == solo("llama", prompt(10, 1), NEW)
    assert engine.output(ok2).generated_tokens == solo("llama", prompt(12, 3), NEW)
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[5, VOCAB]), f"token id {VOCAB} .*vocabulary"),
    (dict(input_ids=[5, -1]), "token id -1"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long)), r"\[1, seq_len\]"),
    (dict(input_ids=torch.ones(3)), "integer token ids"),
    (dict(input_ids="hello"), "list of int"),
    (dict(input_ids=[5, True]), r"its element 1 is True \(bool\)"),
    (dict(input_ids=[[5, 6]]), r"its element 0 is \[5, 6\] \(list\)"),
    (dict(input_ids=[5] * 513), "513 tokens, more than the model's context of 512"),
    (dict(input_ids=[5, 6], max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(input_ids=[5, 6], max_new_tokens=-3), "max_new_tokens"),
    (dict(input_ids=[5, 6], max_new_tokens=2.0), "max_new_tokens"),
    (dict(input_ids=[5] * 500, max_new_tokens=13), r"500 tokens \+ max_new_tokens 13 pass the model's context of "
                                                    "512 positions .* at most 12"),
    (dict(input_ids=[5, 6], do_sample=True, temperature=0.0), "temperature 0 is greedy decoding: give do_sample="),
    (dict(input_ids=[5, 6], temperature=-1.0), "temperature must be a finite number > 0, got -1.0"),
    (dict(input_ids=[5, 6], do_sample=True, top_p=0.0), "top_p"),
    (dict(input_ids=[5, 6], do_sample=True, top_k=-1), "top_k"),
    (dict(input_ids=[5, 6], eos_token_id="x"), "eos_token_id"),
])
def test_bad_inputs_raise_naming_the_request_and_leave_the_pool_alone(kwargs, match):
    pool = BlockPool(block_size=BLOCK, num_blocks=16, debug=True)
    engine = Engine(tiny_model("llama"), pool)
    before = pool.stats()
    with pytest.raises(ValueError, match=match) as info:
        engine.add_request(request_id="bad-one", **kwargs)
    assert "bad-one" in str(info.value)
    after = pool.stats()
    assert (after.blocks_in_use, after.num_blocks, after.lookups) == (before.blocks_in_use, before.num_blocks, 0)
    assert engine.stats().num_waiting == 0 and not engine.has_unfinished
    engine.add_request([5, 6], request_id="bad-one", max_new_tokens=2)  # the id was not taken
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], request_id="bad-one")


def test_greedy_takes_temperature_zero_and_fills_the_context_exactly():
    # temperature 0 is OpenAI's greedy: with do_sample=False it is ignored, as every sampling setting is; a prompt
    # with max_new_tokens that reach the context's last position runs
    engine = Engine(tiny_model("llama"), BlockPool(block_size=BLOCK, debug=True))
    zero = engine.add_request(prompt(6, 91), max_new_tokens=NEW, temperature=0.0)
    full = engine.add_request([5] * 508, max_new_tokens=4, eos_token_id=[])
    run_checked(engine)
    assert engine.output(zero).generated_tokens == solo("llama", prompt(6, 91), NEW)
    assert len(engine.output(full).generated_tokens) == 4


def test_default_ids_skip_ids_a_caller_took():
    engine = Engine(tiny_model("llama"), BlockPool(block_size=BLOCK))
    assert engine.add_request([5, 6], request_id="req_1", max_new_tokens=2) == "req_1"
    assert engine.add_request([5, 6], request_id="req_3", max_new_tokens=2) == "req_3"
    ids = [engine.add_request([5, 6], max_new_tokens=2) for _ in range(3)]
    assert ids == ["req_2", "req_4", "req_5"]  # arrivals 2, 3 (req_3 taken), 4 (req_4 given before)
    run_checked(engine)
    engine.pop_output("req_2")
    assert engine.add_request([5, 6], max_new_tokens=2) == "req_6"  # never a default id given before


def test_a_max_memory_pool_below_one_block_is_refused_when_the_engine_is_built():
    pool = BlockPool(block_size=BLOCK, max_memory="1KiB")
    with pytest.raises(ValueError, match=r"^Engine: max_memory=1024 bytes is less than one block"):
        Engine(tiny_model("llama"), pool)


def test_keyboard_interrupt_while_tokens_are_applied(monkeypatch):
    # the interrupt comes after the forward, while the step's tokens are sampled: every unfinished request of the
    # step is recomputed, and the seeded one still draws what it draws uninterrupted
    import hf_pagedkv.serving.engine as engine_module

    prompts = [prompt(6, 81), prompt(9, 82)]

    def run(interrupt):
        pool = BlockPool(block_size=BLOCK, debug=True)
        engine = Engine(tiny_model("llama"), pool)
        greedy = engine.add_request(prompts[0], max_new_tokens=NEW)
        sampled = engine.add_request(prompts[1], max_new_tokens=NEW, do_sample=True, seed=3)
        for _ in range(3):
            engine.step()
        if interrupt:
            real = engine_module.sample

            def once(*args):
                monkeypatch.setattr(engine_module, "sample", real)
                raise KeyboardInterrupt

            monkeypatch.setattr(engine_module, "sample", once)
            with pytest.raises(KeyboardInterrupt):
                engine.step()
            pool.check_invariants()
            assert pool.stats().blocks_in_use == 0
        run_checked(engine)
        return engine.output(greedy).generated_tokens, engine.output(sampled).generated_tokens

    assert run(True) == run(False)
    assert run(True)[0] == solo("llama", prompts[0], NEW)

