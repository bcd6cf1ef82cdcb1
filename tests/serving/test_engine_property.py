"""A hypothesis test of the engine: random arrivals, cancellations, token budgets, prompt lengths and pool sizes
(with and without prefix caching, and a host tier to swap to). After every step the pool's invariants hold; every
finished request has its solo greedy tokens, a cancelled one a prefix of them, a request too large for the pool an
error; at the end no block is in use, on the device or in the host tier."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_pagedkv import BlockPool, Engine
from hf_pagedkv.serving import RequestStatus
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, solo, tiny_single_thread  # noqa: F401

SHARED = prompt(8, seed=999)  # a prefix some prompts start with (two blocks)
HOST_BLOCK = 3 * 2 * 2 * 16 * 4 * BLOCK  # bytes of one block of the tiny Llama (a host tier of 4 fills up)

event = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 22), st.integers(1, 7), st.booleans(), st.integers(0, 10 ** 6)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(event, min_size=3, max_size=25), max_batch_tokens=st.integers(1, 24),
       num_blocks=st.sampled_from([None, 10, 16, 30]), prefix_caching=st.booleans(),
       host_memory=st.sampled_from([None, 4 * HOST_BLOCK, 2 ** 20]))
def test_random_arrivals_cancellations_and_budgets(events, max_batch_tokens, num_blocks, prefix_caching,
                                                   host_memory):
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching, debug=True,
                     host_memory=host_memory)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=max_batch_tokens)
    asked = {}  # request id -> (prompt, max_new_tokens)

    def step():
        engine.step()
        pool.check_invariants()

    for ev in events:
        if ev[0] == "add":
            _, length, new, shared, seed = ev
            ids = (SHARED + prompt(length, seed))[:max(length, 1)] if shared else prompt(length, seed)
            asked[engine.add_request(ids, max_new_tokens=new)] = (ids, new)
        elif ev[0] == "cancel" and asked:
            engine.cancel(sorted(asked)[ev[1] % len(asked)])
            pool.check_invariants()
        elif ev[0] == "step":
            for _ in range(ev[1]):
                step()
    steps = 0
    while engine.has_unfinished:
        step()
        steps += 1
        assert steps < 2000
    for rid, (ids, new) in asked.items():
        out = engine.output(rid)
        ref = solo("llama", ids, new)
        if out.status == RequestStatus.FINISHED:
            assert out.generated_tokens == ref
        elif out.status == RequestStatus.CANCELLED:
            assert out.generated_tokens == ref[: len(out.generated_tokens)]
        else:
            assert out.status == RequestStatus.FAILED and num_blocks is not None
            assert -(-(len(ids) + new - 1) // BLOCK) > num_blocks and "KV blocks" in out.error
    assert pool.stats().blocks_in_use == 0
    assert host_memory is None or pool.stats().host_blocks_in_use == 0
