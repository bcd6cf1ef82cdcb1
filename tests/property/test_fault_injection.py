"""Exception safety of the operations that move blocks: an error (a `RuntimeError`, as a failed allocation or copy
raises) or a `KeyboardInterrupt` injected at the n-th torch call inside `offload()`, `prefetch()`, `compact()`, a
prefix hit that promotes blocks from the host tier, a swapping `hf_pagedkv.generate`, `release()` and the freeing
of collected caches, for every n until the operation completes before reaching n. After each: the invariants hold,
every cache still continues exactly as without the fault (nothing lost, nothing corrupted), and releasing
everything leaves no block held, device or host. On plain, hybrid (a sliding-window layer group) and quantized
(k8v4) pools of two-layer models."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from tests.conftest import VOCAB, ids
from tests.prefix_utils import tiny_single_thread  # noqa: F401 (autouse fixture)

B = 4
KINDS = {"plain": ("llama", None), "hybrid": ("gemma2", None), "quantized": ("llama", "k8v4")}
_MODELS: dict = {}
# torch calls that only read a tensor's metadata: they cannot fail, so they are no point of failure
CANNOT_FAIL = {"__get__", "numel", "element_size", "dim", "size", "is_floating_point", "is_inference", "data_ptr",
               "is_contiguous", "is_pinned"}


def two_layer_model(arch: str):
    """A tiny random model of two layers (Gemma2: a sliding-window layer of window 8, then a full one), built once:
    fewer layers, fewer torch calls per operation, fewer faults to inject."""
    if arch not in _MODELS:
        torch.manual_seed(4321)
        common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, pad_token_id=0)
        model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama"
                 else Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=8)))
        model.generation_config.pad_token_id = 0
        _MODELS[arch] = model.eval()
    return _MODELS[arch]


class FailAt(TorchFunctionMode):
    """Raise `error` at the `n`-th torch call made by hf_pagedkv code, counting every such call but those that
    cannot fail (`CANNOT_FAIL`). Calls made by transformers' model code do not count, nor do those of the codecs
    (`hf_pagedkv.storage.codecs`, pure functions of tensors): a failure inside either leaves the pool as a failure
    at the next call hf_pagedkv makes does."""

    def __init__(self, n: int, error: type[BaseException]) -> None:
        super().__init__()
        self.n = n  # the call that raises (1-based)
        self.error = error  # RuntimeError or KeyboardInterrupt
        self.calls = 0  # hf_pagedkv's torch calls seen so far

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("hf_pagedkv") and not caller.startswith("hf_pagedkv.storage.codecs") \
                and getattr(func, "__name__", "") not in CANNOT_FAIL:
            self.calls += 1
            if self.calls == self.n:
                raise self.error(f"injected at torch call {self.n} ({getattr(func, '__name__', func)})")
        return func(*args, **(kwargs or {}))


def run_with_faults(setup, operation, check) -> int:
    """For n = 1, 2, ... and each of `RuntimeError` and `KeyboardInterrupt`: `state = setup()`, run
    `operation(state)` raising that at its n-th torch call, then check the pool's and every cache's invariants,
    `check(state)`, and that releasing every cache of ``state["caches"]`` leaves no block held (but the pool's pad
    blocks), device or host; until the operation completes before reaching n. Returns its number of torch calls."""
    n = 1
    while True:
        for error in (RuntimeError, KeyboardInterrupt):
            state = setup()
            pool = state["pool"]
            fault = FailAt(n, error)
            try:
                with fault:
                    operation(state)
            except error as e:
                assert str(e).startswith(f"injected at torch call {n} "), e
            else:
                assert fault.calls < n, f"the {error.__name__} injected at torch call {n} was swallowed"
            pool.check_invariants()
            for cache in state["caches"]:
                cache.check_invariants()
            check(state)
            for cache in state["caches"]:
                cache.release()
            pool.check_invariants()
            stats = pool.stats()
            pads = sum(g.pad_block is not None for g in pool.groups)
            assert (stats.blocks_in_use, stats.host_blocks_in_use) == (pads, 0), (n, error, stats)
            if fault.calls < n:
                return fault.calls
        n += 1


def new_pool(quant, **kwargs) -> BlockPool:
    return BlockPool(block_size=B, quant=quant, host_memory="1MiB", debug=True, **kwargs)


@torch.no_grad()
def prefilled(model, pool, x) -> PagedCache:
    cache = PagedCache(pool=pool, config=model.config)
    model(x, **cache_kwargs(cache))
    return cache


@torch.no_grad()
def next_logits(model, cache: PagedCache, tok: int = 7) -> torch.Tensor:
    """The logits `[vocab]` of one more token fed to `cache`: equal to a reference only if its K/V are intact."""
    cache.prefetch()  # a no-op unless the operation under test left it offloaded
    return model(torch.tensor([[tok]]), **cache_kwargs(cache)).logits[0, -1]


@pytest.mark.parametrize("kind", KINDS)
def test_offload_and_prefetch_are_all_or_nothing(kind):
    arch, quant = KINDS[kind]
    model = two_layer_model(arch)
    x = ids(1, 10, seed=1)

    def setup(offloaded=False):
        pool = new_pool(quant, num_blocks=12, prefix_caching=True)
        cache = prefilled(model, pool, x)
        cache.publish(x, model=model)  # published full blocks: kept cached-idle on the device when dropped
        other = cache.fork()  # shares every block: an offload keeps them on the device for it
        with torch.no_grad():
            model(ids(1, 1, seed=2), **cache_kwargs(other))  # its own copy of the last block
        if offloaded:
            cache.offload()
        return {"pool": pool, "caches": [cache, other]}

    ref = next_logits(model, setup()["caches"][0])

    def check(state):
        assert torch.equal(next_logits(model, state["caches"][0]), ref)

    assert run_with_faults(setup, lambda state: state["caches"][0].offload(), check) > 0
    assert run_with_faults(lambda: setup(offloaded=True), lambda state: state["caches"][0].prefetch(), check) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_compact_is_all_or_nothing(kind):
    arch, quant = KINDS[kind]
    model = two_layer_model(arch)

    def setup():
        pool = new_pool(quant)  # growable
        first = prefilled(model, pool, ids(1, 9, seed=3))  # blocks 0, 1, 2
        cache = prefilled(model, pool, ids(1, 6, seed=4))  # blocks 3, 4
        first.release()  # compaction moves the cache's blocks down to 0, 1
        return {"pool": pool, "caches": [cache]}

    ref = next_logits(model, setup()["caches"][0])

    def compact(state):
        assert state["pool"].compact() > 0

    def check(state):
        assert torch.equal(next_logits(model, state["caches"][0]), ref)

    assert run_with_faults(setup, compact, check) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_hit_promoting_host_blocks_is_all_or_nothing(kind):
    arch, quant = KINDS[kind]
    model = two_layer_model(arch)
    prompt = ids(1, 10, seed=5)

    def setup():
        pool = new_pool(quant, num_blocks=6, prefix_caching=True)
        with torch.no_grad(), PagedCache.from_prefix(pool, prompt, model=model) as cache:
            model(prompt, **cache_kwargs(cache))
            cache.publish(prompt)  # 2 full blocks, cached-idle once released
        for g in range(len(pool.groups)):  # taking every block evicts (demotes) them to the host tier
            pool._free(pool._allocate(6, group=g), g)
        assert pool.host.stats().blocks_cached > 0 and pool.stats().blocks_cached == 0
        return {"pool": pool, "caches": []}

    @torch.no_grad()
    def hit_logits(pool) -> torch.Tensor:
        with PagedCache.from_prefix(pool, prompt, model=model) as cache:
            assert cache.get_seq_length() == 8
            return model(prompt[:, 8:], **cache_kwargs(cache)).logits[0, -1]

    ref = hit_logits(setup()["pool"])

    def promote(state):
        state["caches"].append(PagedCache.from_prefix(state["pool"], prompt, model=model))

    def check(state):
        for cache in state["caches"]:
            cache.release()
        state["caches"].clear()
        assert torch.equal(hit_logits(state["pool"]), ref)  # the prefix, in either tier, is intact

    assert run_with_faults(setup, promote, check) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_swapping_generate_is_all_or_nothing(kind):
    arch, quant = KINDS[kind]
    model = two_layer_model(arch)
    x = ids(1, 8, seed=8)
    gen = dict(max_new_tokens=2, do_sample=False)

    def setup():
        pool = new_pool(quant, num_blocks=5)
        # 3 of the 5 blocks: the request's prefill (2 blocks) fits, its decode step (a third) swaps the cache out
        idle = prefilled(model, pool, ids(1, 9, seed=9))
        return {"pool": pool, "caches": [idle]}

    state = setup()
    want = hf_pagedkv.generate(model, x, pool=state["pool"], swap_on_exhaustion=True, **gen)
    assert state["caches"][0].is_offloaded
    ref = next_logits(model, state["caches"][0])

    def swap(state):
        state["out"] = hf_pagedkv.generate(model, x, pool=state["pool"], swap_on_exhaustion=True, **gen)

    def check(state):
        if "out" in state:
            assert torch.equal(state["out"], want)
        assert torch.equal(next_logits(model, state["caches"][0]), ref)

    assert run_with_faults(setup, swap, check) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_release_and_freeing_collected_caches_are_all_or_nothing(kind):
    arch, quant = KINDS[kind]
    model = two_layer_model(arch)

    def setup(collected=False):
        pool = new_pool(quant, num_blocks=12)
        caches = [prefilled(model, pool, ids(1, 10, seed=10)), prefilled(model, pool, ids(1, 6, seed=11))]
        caches[1].offload()  # its blocks in the host tier
        if collected:
            del caches  # dropped without release(): their blocks are freed at the next pool operation
            assert pool.owners.num_pending == 2
            return {"pool": pool, "caches": []}
        return {"pool": pool, "caches": caches}

    def release(state):
        for cache in state["caches"]:
            cache.release()

    def check(state):
        pass  # run_with_faults checks that, once every cache is released, every block is free, device and host

    assert run_with_faults(setup, release, check) > 0
    assert run_with_faults(lambda: setup(collected=True), lambda state: state["pool"].stats(), check) > 0
