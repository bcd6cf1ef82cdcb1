"""Swapping whole caches to the host tier and back: generation continues bit for bit, refcounts decide what the
device keeps, and every failure leaves both tiers as they were."""

import gc
import threading
import time

import pytest
import torch
from transformers import DynamicCache

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, cache_kwargs
from hf_pagedkv.errors import CacheOffloadedError, InvariantError
from hf_pagedkv.storage.host_store import HostStore
from tests.conftest import ids, tiny_model
from tests.prefix_utils import GEN, run_in_threads, tiny_single_thread  # noqa: F401 (autouse fixture)
from tests.storage.test_host_store import FailAtEmpty

B = 4


def host_pool(**kwargs) -> BlockPool:
    return BlockPool(block_size=B, host_memory=kwargs.pop("host_memory", "1MiB"), debug=True, **kwargs)


@torch.no_grad()
def greedy(model, cache, x, steps: int, between=None):
    """Prefill `x`, then `steps` greedy decode steps; `between(step)` runs before each decode step. Returns the
    generated tokens `[batch, steps + 1]` and the logits `[steps + 1, batch, vocab]`."""
    out = model(x, **cache_kwargs(cache))
    tok, toks, logits = out.logits[:, -1:].argmax(-1), [], []
    for step in range(steps + 1):
        toks.append(tok)
        logits.append(out.logits[:, -1])
        if step == steps:
            break
        if between is not None:
            between(step)
        out = model(tok, **cache_kwargs(cache))
        tok = out.logits[:, -1:].argmax(-1)
    return torch.cat(toks, 1), torch.stack(logits)


def churn(model, pool) -> None:
    """Another request that takes (and writes) the device blocks an offload just freed, then finishes."""
    with torch.no_grad(), PagedCache(pool=pool, config=model.config) as other:
        model(ids(1, 9, seed=50), **cache_kwargs(other))


@pytest.mark.parametrize("arch, quant", [("llama", None), ("gemma2", None), ("llama", "k8v4"), ("gemma2", "k4v4")])
def test_generation_continues_exactly_after_offload_and_prefetch(arch, quant):
    model = tiny_model(arch)
    x = ids(2, 11, seed=1)
    # the reference: the same steps without a swap (unquantized: DynamicCache; quantized: the same codes)
    ref_cache = (DynamicCache(config=model.config) if quant is None
                 else PagedCache(pool=BlockPool(block_size=B, quant=quant), config=model.config))
    ref_tokens, ref_logits = greedy(model, ref_cache, x, 10)
    pool = host_pool(num_blocks=16, quant=quant)
    cache = PagedCache(pool=pool, config=model.config)

    def swap(step):
        if step not in (2, 7):
            return
        held = pool.stats().blocks_in_use
        cache.offload()
        pool.check_invariants()
        assert cache.is_offloaded and pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == held
        with pytest.raises(CacheOffloadedError, match="prefetch"):
            model(ids(2, 1), **cache_kwargs(cache))
        assert cache.get_seq_length() == 11 + step  # the length is still known
        churn(model, pool)
        cache.prefetch()
        cache.check_invariants()
        assert not cache.is_offloaded and pool.stats().blocks_in_use == held and pool.host.stats().blocks_in_use == 0

    tokens, logits = greedy(model, cache, x, 10, between=swap)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)  # the same steps: bit for bit, as without the swap
    assert pool.host.stats().blocks_offloaded == pool.host.stats().blocks_prefetched > 0
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_shared_and_published_blocks_stay_on_the_device_for_others():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, host_memory="1MiB", prefix_caching=True, debug=True)
    prompt = ids(1, 13, seed=2)
    a = PagedCache.from_prefix(pool, prompt, model=model)
    with torch.no_grad():
        model(prompt, **cache_kwargs(a))
    a.publish(prompt)  # 3 full blocks published
    b = a.fork()  # shares all 4 blocks
    ref_tokens, ref_logits = greedy(model, DynamicCache(), prompt, 5)
    a.offload()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 4  # b still holds every block: nothing left the device
    b.release()
    pool.check_invariants()
    assert (pool.stats().blocks_in_use, pool.stats().blocks_cached) == (0, 3)  # the published blocks stay cached
    out, hit = hf_pagedkv.generate(model, prompt, pool=pool, **GEN), pool.stats().hit_tokens
    assert hit == 12  # a third request hits them while `a` is offloaded
    a.prefetch()
    a.check_invariants()
    # `a` continues from its host copies (prefill of `prompt` done: decode its next tokens)
    with torch.no_grad():
        logits = model(ref_tokens[:, :1], **cache_kwargs(a)).logits[:, -1]
    assert torch.equal(logits, ref_logits[1])
    assert torch.equal(out.sequences[:, 13:14], ref_tokens[:, :1])
    a.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == 0


def test_failures_leave_both_tiers_as_they_were():
    model = tiny_model("llama")
    x = ids(1, 11, seed=3)  # 3 blocks
    with pytest.raises(ValueError, match="host_memory"):
        with PagedCache(pool=BlockPool(block_size=B), config=model.config) as c:
            model(x, **cache_kwargs(c))
            c.offload()
    # a host tier of 2 blocks (a block of the tiny llama is 3 KiB): too small for the cache
    pool = host_pool(num_blocks=8, host_memory=2 * 3072)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    tables = cache.block_tables()
    with pytest.raises(PoolExhaustedError, match="host tier"):
        cache.offload()
    assert not cache.is_offloaded and cache.block_tables() == tables and pool.host.stats().blocks_in_use == 0
    pool.check_invariants()
    with pytest.raises(ValueError, match="whole"):
        cache.offload(layer_idx=0)

    pool = host_pool(num_blocks=4)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    cache.offload()
    hog = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(ids(1, 9, seed=4), **cache_kwargs(hog))  # 3 of the 4 device blocks
    with pytest.raises(PoolExhaustedError, match="stays offloaded"):
        cache.prefetch()
    assert cache.is_offloaded and pool.host.stats().blocks_in_use == 3
    pool.check_invariants()
    hog.release()
    cache.release()  # an offloaded cache's release frees its host blocks
    assert pool.host.stats().blocks_in_use == 0
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    cache.offload()
    del cache  # dropped without release: collected, its host blocks freed at the next pool operation
    gc.collect()
    pool.check_invariants()
    assert pool.host.stats().blocks_in_use == 0 and pool.stats().blocks_in_use == 0


def test_host_invariants_catch_a_lost_host_block():
    model = tiny_model("llama")
    pool = host_pool(num_blocks=8)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(ids(1, 9, seed=6), **cache_kwargs(cache))
    cache.offload()
    tier, _ = pool.host.tiers[0]
    tier.held[cache.seq_id].pop()  # a host block nobody holds any more, still counted in use
    with pytest.raises(InvariantError, match="invariant 9"):
        pool.check_invariants()


def test_four_threads_swapping_on_one_pool():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, host_memory="1MiB", prefix_caching=True)
    prompts = [ids(1, 9 + t, seed=20 + t) for t in range(4)]
    refs = [greedy(model, DynamicCache(), x, 6) for x in prompts]
    results = {}

    def worker(t):
        for _ in range(2):
            cache = PagedCache(pool=pool, config=model.config)
            swaps = (lambda step: (cache.offload(), cache.prefetch()) if step % 2 == 0 else None)
            results[t] = greedy(model, cache, prompts[t], 6, between=swaps)
            cache.release()

    run_in_threads(worker, 4)
    for t, (tokens, logits) in results.items():
        assert torch.equal(tokens, refs[t][0]) and torch.equal(logits, refs[t][1])
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == 0
    assert pool.host.stats().blocks_prefetched == pool.host.stats().blocks_offloaded > 0


def test_an_owner_offload_racing_a_swap_of_the_same_cache_is_one_decision():
    model = tiny_model("llama")
    x = ids(1, 21, seed=7)  # 6 blocks
    ref_tokens, ref_logits = greedy(model, DynamicCache(), x, 1)
    pool = host_pool(num_blocks=16)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    errors = []

    def owner():  # the cache's owner offloads it (a client preempting its own session)
        try:
            cache.offload()
        except Exception as e:  # noqa: BLE001 (what it raised is the point)
            errors.append(e)

    with pool.lock:  # another thread's swap (generate(swap_on_exhaustion=True)) offloads idle caches under the lock
        thread = threading.Thread(target=owner)
        thread.start()
        time.sleep(0.2)  # the owner's offload() waits for the lock now
        for idle in pool.idle_owners():
            idle.offload()
    thread.join()
    # one offload happened; the other saw it and changed nothing
    assert len(errors) == 1 and isinstance(errors[0], CacheOffloadedError), errors
    assert "offloaded already" in str(errors[0])
    pool.check_invariants()
    assert cache.is_offloaded and pool.host.stats().blocks_in_use == 6 and pool.stats().blocks_in_use == 0
    with pytest.raises(CacheOffloadedError, match="offloaded already"):
        cache.offload()  # the same from this thread
    cache.prefetch()
    cache.check_invariants()
    assert (cache.num_rows, cache.get_seq_length(), pool.host.stats().blocks_in_use) == (1, 21, 0)
    with torch.no_grad():
        logits = model(ref_tokens[:, :1], **cache_kwargs(cache)).logits[:, -1]
    assert torch.equal(logits, ref_logits[1])  # its K/V came back whole
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == 0


def test_a_hybrid_offload_failing_in_its_second_layer_group_changes_nothing(monkeypatch):
    model = tiny_model("gemma2")
    x = ids(1, 21, seed=8)
    ref_tokens, ref_logits = greedy(model, DynamicCache(config=model.config), x, 1)
    pool = host_pool(num_blocks=64, host_memory="4MiB")
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    tables = (cache.block_tables(None), cache.block_tables(8))
    real, groups = HostStore.write, []

    def write(store, host_blocks, tensors):  # the copy of the second layer group fails (say, its allocation)
        groups.append(len(host_blocks))
        if len(groups) == 2:
            raise RuntimeError("injected: host allocation failed")
        real(store, host_blocks, tensors)

    monkeypatch.setattr(HostStore, "write", write)
    with pytest.raises(RuntimeError, match="injected"):
        cache.offload()
    monkeypatch.undo()
    # the full group's 6 blocks were copied, then the sliding group's failed (it drops blocks at the next step)
    assert groups == [6, 6]
    pool.check_invariants()  # invariant 9: no cache holds blocks in both tiers
    assert not cache.is_offloaded and (cache.block_tables(None), cache.block_tables(8)) == tables
    assert pool.host.stats().blocks_in_use == 0  # the first group's host blocks went back
    cache.offload()  # it works the next time, and continues exactly
    cache.prefetch()
    with torch.no_grad():
        logits = model(ref_tokens[:, :1], **cache_kwargs(cache)).logits[:, -1]
    assert torch.equal(logits, ref_logits[1])
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.host.stats().blocks_in_use == 0


def test_a_host_store_whose_first_allocation_failed_allocates_later():
    model = tiny_model("llama")
    pool = BlockPool(block_size=B, num_blocks=12, prefix_caching=True, host_memory="1MiB", debug=True)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(ids(1, 13, seed=9), **cache_kwargs(cache))
    tables = cache.block_tables()
    with pytest.raises(RuntimeError, match="injected"), FailAtEmpty(2):  # the host store's second tensor fails
        cache.offload()
    assert not cache.is_offloaded and cache.block_tables() == tables
    store = pool.host.tiers[0][1]
    assert (store.tensors, store.bytes_reserved) == ({}, 0)  # no partial layout left behind
    pool.check_invariants()
    cache.release()
    # requests that publish their prompts; the later ones must evict (demote to the host tier) the earlier ones'
    for k in range(4):
        out = hf_pagedkv.generate(model, ids(1, 30, seed=10 + k), pool=pool, max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 32)
        pool.check_invariants()
    assert pool.host.stats().blocks_demoted > 0 and len(store.tensors) == 6  # 3 layers, keys and values
    del store.tensors["2.values"]  # a partial layout is caught
    with pytest.raises(InvariantError, match="invariant 9 .* the host store's layout is broken"):
        pool.check_invariants()
