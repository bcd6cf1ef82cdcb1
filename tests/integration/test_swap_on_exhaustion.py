"""`hf_pagedkv.generate(..., swap_on_exhaustion=True)`: when the pool is full, idle caches are swapped out to the host
tier (least recently used first) and the request runs; a swapped cache continues exactly after `prefetch()`."""

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, cache_kwargs
from tests.conftest import ids, tiny_model
from tests.prefix_utils import GEN, assert_same_output, fresh_generate, run_in_threads, tiny_single_thread  # noqa: F401

B = 4
BLOCK = 3072  # bytes of one block of the tiny llama (3 layers x K+V x 2 heads x 16 x fp32 x 4 tokens)


@torch.no_grad()
def decode(model, cache, tok: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy decode steps from token `tok` `[1, 1]`: (the tokens fed, each step's logits)."""
    toks, logits = [], []
    for _ in range(steps):
        toks.append(tok.item())
        out = model(tok, **cache_kwargs(cache)).logits[:, -1]
        logits.append(out)
        tok = out.argmax(-1, keepdim=True)
    return toks, logits


@torch.no_grad()
def start(model, cache, x: torch.Tensor) -> torch.Tensor:
    """Prefill `x`; the first generated token `[1, 1]`."""
    return model(x, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_full_pool_swaps_the_idle_cache_out_and_it_continues_exactly(prefix_caching):
    model = tiny_model("llama")
    xa, xb = ids(1, 11, seed=1), ids(1, 13, seed=2)
    # the reference for A: 8 decode steps without any swap
    ref = DynamicCache()
    ref_toks, ref_logits = decode(model, ref, start(model, ref, xa), 8)

    pool = BlockPool(block_size=B, num_blocks=8, host_memory="1MiB", prefix_caching=prefix_caching, debug=True)
    a = PagedCache(pool=pool, config=model.config)
    tok = start(model, a, xa)
    toks, logits = decode(model, a, tok, 3)  # A holds 14 tokens: 4 of the 8 blocks
    pool.check_invariants()
    tables = a.block_tables()
    assert pool.stats().blocks_in_use == 4
    # B needs 13 + 6 - 1 = 18 tokens = 5 blocks: without the flag the pool is exhausted, as before
    with pytest.raises(PoolExhaustedError, match="BlockPool is full"):
        hf_pagedkv.generate(model, xb, pool=pool, **GEN)
    pool.check_invariants()
    assert a.block_tables() == tables and not a.is_offloaded and pool.stats().blocks_in_use == 4
    assert pool.host.stats().blocks_offloaded == 0
    # with the flag, A (idle) goes to the host tier and B runs: its output is a fresh run's
    out = hf_pagedkv.generate(model, xb, pool=pool, swap_on_exhaustion=True, **GEN)
    pool.check_invariants()
    assert_same_output(fresh_generate(model, xb), out)
    assert a.is_offloaded and pool.stats().blocks_in_use == 0
    st = pool.stats()
    assert (st.host_blocks_in_use, st.blocks_to_host, st.bytes_to_host) == (4, 4, 4 * BLOCK)
    # A comes back and continues bit for bit: the same tokens and logits as the run without a swap
    a.prefetch()
    a.check_invariants()
    pool.check_invariants()
    more_toks, more_logits = decode(model, a, torch.tensor([[ref_toks[3]]]), 5)
    assert toks + more_toks == ref_toks
    for got, want in zip(logits + more_logits, ref_logits):
        assert torch.equal(got, want)
    a.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0


def test_the_least_recently_used_idle_cache_goes_first():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=10, host_memory="1MiB", debug=True)
    a, c = PagedCache(pool=pool, config=model.config), PagedCache(pool=pool, config=model.config)
    tok_a = start(model, a, ids(1, 7, seed=3))  # 2 blocks
    start(model, c, ids(1, 11, seed=4))  # 3 blocks
    decode(model, a, tok_a, 1)  # A used again: C is the least recently used now
    pool.check_invariants()
    idle = pool.idle_owners()
    assert [o.token for o in idle] == [c.seq_id, a.seq_id]
    assert idle[0].last_use < idle[1].last_use and idle[0].last_used_at <= idle[1].last_used_at
    assert [(o.num_blocks, o.num_exclusive_blocks) for o in idle] == [(3, 3), (2, 2)]
    assert pool.idle_owners(exclude=[c.seq_id]) == idle[1:]
    with pool.owner_busy(c.seq_id):  # a running request's cache is not idle
        assert [o.token for o in pool.idle_owners()] == [a.seq_id]
    # a request of 5 + 20 - 1 = 24 tokens = 6 blocks, with 5 free: swapping C (3 blocks) is enough
    x = ids(1, 5, seed=5)
    out = hf_pagedkv.generate(model, x, pool=pool, swap_on_exhaustion=True, max_new_tokens=20, do_sample=False,
                              min_new_tokens=20)
    pool.check_invariants()
    assert out.shape[1] == 25
    assert c.is_offloaded and not a.is_offloaded
    assert [o.token for o in pool.idle_owners()] == [a.seq_id]  # an offloaded cache holds no device block
    # a fork shares every block: swapping either out frees nothing, and both say so
    b = a.fork()
    assert [o.num_exclusive_blocks for o in pool.idle_owners()] == [0, 0]
    for cache in (a, b, c):
        cache.release()
    pool.check_invariants()
    assert pool.idle_owners() == [] and pool.stats().blocks_in_use == 0


def test_no_room_anywhere_raises_the_original_error_and_changes_nothing():
    model = tiny_model("llama")
    x = ids(1, 13, seed=2)
    # a host tier of 2 blocks cannot take A's 4: A stays, the request fails as without the flag
    pool = BlockPool(block_size=B, num_blocks=8, host_memory=2 * BLOCK, debug=True)
    a = PagedCache(pool=pool, config=model.config)
    decode(model, a, start(model, a, ids(1, 11, seed=1)), 3)
    tables = a.block_tables()
    with pytest.raises(PoolExhaustedError, match="BlockPool is full") as info:
        hf_pagedkv.generate(model, x, pool=pool, swap_on_exhaustion=True, **GEN)
    assert info.value.__notes__ == ["swap_on_exhaustion: no idle cache could be swapped out: none is idle, or the "
                                    "host tier has no room for one (raise host_memory)."]  # nothing was swapped
    pool.check_invariants()
    assert a.block_tables() == tables and not a.is_offloaded and pool.stats().host_blocks_in_use == 0
    a.release()
    # a request too large for the whole pool: every idle cache is swapped, then the original error, with a note
    pool = BlockPool(block_size=B, num_blocks=8, host_memory="1MiB", debug=True)
    a = PagedCache(pool=pool, config=model.config)
    start(model, a, ids(1, 5, seed=6))
    with pytest.raises(PoolExhaustedError, match="BlockPool is full") as info:
        hf_pagedkv.generate(model, ids(1, 30, seed=7), pool=pool, swap_on_exhaustion=True, max_new_tokens=8,
                            do_sample=False)
    assert "swapped 1 idle caches" in "".join(info.value.__notes__)
    pool.check_invariants()
    assert a.is_offloaded and pool.stats().blocks_in_use == 0
    a.prefetch()
    a.release()
    pool.check_invariants()
    # the flag needs a host tier
    with pytest.raises(ValueError, match="host_memory"):
        hf_pagedkv.generate(model, x, pool=BlockPool(block_size=B, num_blocks=8), swap_on_exhaustion=True, **GEN)


def test_four_threads_swapping_idle_caches_out_of_one_pool():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=12, host_memory="1MiB")
    idle_prompts = [ids(1, 11, seed=10 + k) for k in range(3)]  # 3 idle caches of 3 blocks: 3 of 12 blocks free
    refs = []
    for x in idle_prompts:
        ref = DynamicCache()
        refs.append(decode(model, ref, start(model, ref, x), 2))
    idle = [PagedCache(pool=pool, config=model.config) for _ in idle_prompts]
    firsts = [start(model, cache, x) for cache, x in zip(idle, idle_prompts)]
    # 4 threads x 2 requests of 5 + 6 - 1 = 10 tokens = 3 blocks: the 4 running at once fit only when every idle
    # cache is swapped out, and always fit then (12 blocks)
    prompts = [[ids(1, 5, seed=20 + 2 * t + j) for j in range(2)] for t in range(4)]
    want = [[fresh_generate(model, x) for x in row] for row in prompts]
    results = {}

    def worker(t):
        for j, x in enumerate(prompts[t]):
            results[t, j] = hf_pagedkv.generate(model, x, pool=pool, swap_on_exhaustion=True, **GEN)

    run_in_threads(worker, 4)
    pool.check_invariants()
    for t in range(4):
        for j in range(2):
            assert_same_output(want[t][j], results[t, j])
    assert any(cache.is_offloaded for cache in idle)
    for cache, first, (ref_toks, ref_logits) in zip(idle, firsts, refs):
        cache.prefetch()  # a no-op for one never swapped
        toks, logits = decode(model, cache, first, 2)
        assert toks == ref_toks and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
        cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_swap_on_exhaustion_must_be_a_bool(bad):
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=8, host_memory="1MiB")
    with pytest.raises(ValueError, match="`swap_on_exhaustion` must be True or False"):
        hf_pagedkv.generate(model, ids(1, 9, seed=1), pool=pool, swap_on_exhaustion=bad, **GEN)
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


class StreamLog(BaseStreamer):
    """What a streaming client receives, and whether `watched` was swapped out when each piece arrived."""

    def __init__(self, watched: PagedCache | None = None) -> None:
        self.watched = watched
        self.puts: list[list[int]] = []  # token ids of each put
        self.swapped: list[bool] = []  # watched.is_offloaded at each put
        self.num_ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())
        self.swapped.append(self.watched is not None and self.watched.is_offloaded)

    def end(self) -> None:
        self.num_ends += 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_row_preempted_mid_decode_goes_on_where_it_was(do_sample):
    model = tiny_model("llama")
    x = ids(1, 10, seed=11)
    gen = dict(max_new_tokens=20, min_new_tokens=20, do_sample=do_sample)
    # the same seeded request on a pool with room: what the client must see, and the output
    want = StreamLog()
    torch.manual_seed(5)
    ref = hf_pagedkv.generate(model, x, pool=BlockPool(block_size=B, num_blocks=12), streamer=want, **gen)
    pool = BlockPool(block_size=B, num_blocks=12, host_memory="1MiB", debug=True)
    idle = PagedCache(pool=pool, config=model.config)
    start(model, idle, ids(1, 27, seed=12))  # an idle session holding 7 of the 12 blocks
    log = StreamLog(watched=idle)
    torch.manual_seed(5)
    out = hf_pagedkv.generate(model, x, pool=pool, swap_on_exhaustion=True, streamer=log, **gen)
    pool.check_invariants()
    # 5 blocks were free, 20 tokens: the 11th decode step (the 21st token) swapped the session out, then the row
    # went on (puts: the prompt, the prefill's token, then one per decode step)
    assert log.swapped == [False] * 12 + [True] * 9 and idle.is_offloaded
    assert torch.equal(out, ref)  # the same tokens as without the preemption (the same draws when sampling)
    assert log.puts == want.puts and log.num_ends == want.num_ends == 1  # the prompt once, each new token once
    assert log.puts[0] == x[0].tolist() and [len(p) for p in log.puts[1:]] == [1] * 20
    idle.prefetch()
    idle.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().host_blocks_in_use == 0
