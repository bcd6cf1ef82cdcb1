"""What a pool reports is what it holds: `bytes_reserved` is the bytes of its storage tensors (walked one by one),
`bytes_in_use` the bytes held for the blocks in use, and a pool grown by one long prefill reserves little more
than it uses."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.config import PRESETS
from tests.conftest import ids, tiny_model

NUM_LAYERS, HEADS, DIM = 2, 2, 16


def real_bytes(pool: BlockPool) -> int:
    """Bytes of every storage tensor of every layer group, each storage counted once."""
    seen, total = set(), 0
    for group in pool.groups:
        for t in group.store.tensors():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def fake_kv(batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, n, DIM, generator=g), torch.randn(batch, HEADS, n, DIM, generator=g))


def step(cache: PagedCache, batch: int, n: int, seed: int) -> None:
    for layer in range(NUM_LAYERS):
        cache.update(*fake_kv(batch, n, seed + layer), layer_idx=layer)


def held_bytes(pool: BlockPool) -> int:
    """What the blocks in use hold, counted from the tensors: each used block's slice of the block-indexed
    tensors, plus every stage (partial block) and sink stage handed out."""
    total = 0
    for group in pool.groups:
        store, used = group.store, group.allocator.num_used_blocks
        if not store.is_quantized:
            total += used * sum(t.nbytes // store.num_blocks for t in store.tensors())
            continue
        block_tensors = [t for idx in store.specs for t in store.codes[idx] + store.scales[idx]]
        total += used * sum(t.nbytes // store.num_blocks for t in block_tensors)
        for area in (store.staging, store.sinks):
            if area.num_stages:
                total += area.num_used * sum(t.nbytes // area.num_stages for t in area.tensors())
    return total


@pytest.mark.parametrize("quant", list(PRESETS))
def test_bytes_reserved_is_the_bytes_of_the_storage_tensors_and_in_use_what_the_used_blocks_hold(quant):
    pool = BlockPool(quant=quant)
    with PagedCache(pool=pool) as cache:
        assert pool.stats().bytes_reserved == real_bytes(pool) == 0
        step(cache, 3, 70, seed=0)  # 3 rows: full blocks, an open partial block per row, sink tokens
        s = pool.stats()
        assert s.bytes_reserved == real_bytes(pool) > 0
        assert s.bytes_in_use == held_bytes(pool) > 0
        for t in range(40):  # decode past a block boundary (a 16-token block fills at 80, a 32-token one at 96)
            step(cache, 3, 1, seed=100 + t)
            assert pool.stats().bytes_reserved == real_bytes(pool)
            assert pool.stats().bytes_in_use == held_bytes(pool)
        cache.check_invariants()
        if pool.quant.is_quantized:  # the open blocks' stages and the sinks are counted, not only codes
            store = pool.groups[0].store
            assert store.staging.num_used >= 3 and store.sinks.num_used == 3
            assert s.bytes_in_use > s.blocks_in_use * s.bytes_per_block
    assert pool.stats().bytes_in_use == 0 and pool.stats().bytes_reserved == real_bytes(pool)


@pytest.mark.parametrize("quant", ["fp", "k8v8", "k8v4", "k4v4"])
def test_a_4096_token_run_reserves_at_most_15_percent_over_what_it_holds(quant):
    """One 4096-token prefill + 64 decode steps: the pool grew to the prefill's need plus a small headroom, and
    the staging area holds one stage per row, not a minimum of 8."""
    pool = BlockPool(quant=quant)
    with PagedCache(pool=pool) as cache:
        step(cache, 1, 4096, seed=0)
        for t in range(64):
            step(cache, 1, 1, seed=10 + t)
        s = pool.stats()
        assert s.bytes_reserved == real_bytes(pool)
        assert s.bytes_reserved <= 1.15 * s.bytes_in_use, (s.bytes_reserved, s.bytes_in_use)
        if pool.quant.is_quantized:
            assert pool.groups[0].store.staging.num_stages <= 2 and pool.groups[0].store.sinks.num_stages == 1


def test_new_storage_is_poisoned_only_in_debug_mode():
    """Debug mode fills new storage with NaN; outside it the quantized store's codes, scales and stages start
    zeroed, never NaN (the fp store's new storage is left uninitialized: `torch.empty`, never read before written,
    so it cannot be checked for a fill)."""
    for debug in (False, True):
        for quant in ("fp", "k8v4"):
            pool = BlockPool(quant=quant, debug=debug)
            with PagedCache(pool=pool) as cache:
                step(cache, 1, 40, seed=0)
                tensors = [t for t in pool.groups[0].store.tensors() if t.dtype.is_floating_point]
                if debug:
                    assert any(bool(t.isnan().any()) for t in tensors), quant
                elif quant != "fp":
                    assert not any(bool(t.isnan().any()) for t in tensors), quant


def test_the_model_planner_and_the_pool_agree_after_generate():
    """A real forward pass through a tiny model (quantized): reserved = the tensors, in use = what they hold."""
    model = tiny_model("llama")
    with PagedCache(quant="k8v4") as cache:
        model.generate(ids(2, 45), past_key_values=cache, max_new_tokens=6, do_sample=False)
        s = cache.pool.stats()
        assert s.bytes_reserved == real_bytes(cache.pool) and s.bytes_in_use == held_bytes(cache.pool)
