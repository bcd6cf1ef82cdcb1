"""Invariant 4: a full block of a quantized pool is encoded once, by the write that fills it, and never re-quantized;
a crop into an encoded block reopens it, which is the one documented second encode (counted afresh).

`QuantizedPageStore.states.num_encodes[b]` counts the steps that encoded block b since it was last freed or (re)opened;
`check_invariants()` reports a count above 1 (and a count that disagrees with the block's state) as invariant 4.
Block size 4 throughout, two layers of 2 KV heads with head_dim 16 (written directly with `update`) or the tiny
Llama (3 layers)."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import PagedCache, QuantConfig
from hf_pagedkv.errors import InvariantError
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_store import QuantizedPageStore
from tests.conftest import ids, tiny_model

B = 4


def kv(q: int, seed: int) -> list[torch.Tensor]:
    """k0, v0, k1, v1 for one row of `q` tokens: `[1, 2, q, 16]` each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, q, 16, generator=g) for _ in range(4)]


def step(cache: PagedCache, t: list[torch.Tensor]) -> None:
    k0, v0, k1, v1 = t
    cache.update(k0, v0, 0)
    cache.update(k1, v1, 1)


def encodes(cache: PagedCache) -> list[int]:
    """Encode count of each block of row 0, in token order."""
    store = cache.pool.groups[0].store
    return [store.states.num_encodes[b] for b in cache.block_tables()[0]]


def count_encodes(monkeypatch, cache: PagedCache) -> list[int]:
    """Spy on the key codec: the list fills with the number of blocks each encode call gets (one call per layer)."""
    calls: list[int] = []
    codec = cache.pool.groups[0].store.key_codec
    original = codec.encode

    def spy(x):
        calls.append(x.shape[1])  # x: [num_kv_heads, blocks, block_size, key_dim]
        return original(x)

    monkeypatch.setattr(codec, "encode", spy)
    return calls


def test_each_full_block_counts_one_encode_and_open_blocks_none():
    cache = PagedCache(block_size=B, quant="k8v4", debug=True)  # debug: invariants checked after every step
    step(cache, kv(6, seed=0))  # [ b0: encoded | b1: 2 tokens, open ]
    assert encodes(cache) == [1, 0]
    step(cache, kv(1, seed=1))
    step(cache, kv(1, seed=2))  # fills b1: encoded now, once
    assert encodes(cache) == [1, 1]
    step(cache, kv(5, seed=3))  # 13 tokens: b2 filled in one step, b3 open with 1
    assert encodes(cache) == [1, 1, 1, 0]
    cache.check_invariants()
    blocks = cache.block_tables()[0]
    store = cache.pool.groups[0].store
    cache.release()
    assert [store.states.num_encodes[b] for b in blocks] == [0, 0, 0, 0]  # a freed block starts over


def test_encoding_a_full_block_a_second_time_breaks_invariant_4():
    cache = PagedCache(block_size=B, quant="k8v4")  # not debug: the fault is checked explicitly below
    step(cache, kv(6, seed=0))
    b0 = cache.block_tables()[0][0]
    store = cache.pool.groups[0].store
    # the fault: a slot mapping that names every slot of the already encoded b0 again (say a table that still
    # lists it as the row's last block), planned and written through the store's own write path
    plan = store.prepare_write(torch.arange(b0 * B, (b0 + 1) * B), torch.device("cpu"))
    assert plan.done_blocks.tolist() == [b0]  # the store encodes it again
    again = kv(B, seed=9)
    store.write(0, plan, again[0], again[1])
    store.write(1, plan, again[2], again[3])
    assert store.states.num_encodes[b0] == 2
    with pytest.raises(InvariantError, match=rf"invariant 4 \(a full block is encoded once\) broken: blocks \[{b0}\] "
                                             r"encoded \[2\] times since they were last opened"):
        cache.pool.check_invariants()
    with pytest.raises(InvariantError, match="invariant 4"):  # the cache's own check reports it too
        cache.check_invariants()


def test_a_counter_that_disagrees_with_the_block_state_breaks_invariant_4():
    cache = PagedCache(block_size=B, quant="k8v4")
    step(cache, kv(6, seed=0))
    b0, b1 = cache.block_tables()[0]
    store = cache.pool.groups[0].store
    cache.check_invariants()
    store.states.num_encodes[b0] = 0  # an encoded block with no encode counted
    with pytest.raises(InvariantError, match=rf"invariant 4 .* blocks \[{b0}\] in state encoded=\[1\] with \[0\] "
                                             "encodes counted"):
        cache.pool.check_invariants()
    store.states.num_encodes[b0], store.states.num_encodes[b1] = 1, 1  # an open block with one counted
    with pytest.raises(InvariantError, match=rf"invariant 4 .* blocks \[{b1}\] in state encoded=\[0\] with \[1\]"):
        cache.pool.check_invariants()
    store.states.num_encodes[b1] = 0
    cache.check_invariants()


def test_stage_problems_are_still_invariant_6():
    cache = PagedCache(block_size=B, quant="k8v4")
    step(cache, kv(6, seed=0))
    store = cache.pool.groups[0].store
    b1 = cache.block_tables()[0][1]
    store.states.stage_of.pop(b1)  # the open block loses its stage: one stage in use that nobody owns
    with pytest.raises(InvariantError, match=r"invariant 6 \(quantized store stages\) broken: 0 blocks own 0 "
                                             r"distinct stages, 1 in use"):
        cache.pool.check_invariants()


def test_crop_then_refill_token_by_token_reopens_the_block_into_a_stage(monkeypatch):
    """Blocks [enc | enc | open 2] cropped to 5 tokens: b1 keeps 1 token, still encoded. The next write reopens it
    (its kept token decoded into a stage, open: no encode counted), the write that fills it encodes it again: b1 is
    encoded twice in all, once since it was reopened."""
    model = tiny_model("llama")
    x = ids(1, 13, seed=6)
    cache = PagedCache(block_size=B, quant="k8v4", debug=True)  # invariants checked after every step and the crop
    calls = count_encodes(monkeypatch, cache)
    with torch.no_grad():
        model(x[:, :6], past_key_values=cache)
        for t in range(6, 10):
            model(x[:, t: t + 1], past_key_values=cache)
        assert encodes(cache) == [1, 1, 0] and sum(calls) == 3 * 2  # 3 layers, 2 full blocks
        b1 = cache.block_tables()[0][1]
        cache.crop(-5)
        assert cache.get_seq_length() == 5 and encodes(cache) == [1, 1]  # still encoded, and readable
        model(x[:, 5:6], past_key_values=cache)  # reopened into a stage
        states = cache.pool.groups[0].store.states
        assert encodes(cache) == [1, 0] and states.encoded[b1] == 0 and b1 in states.stage_of
        model(x[:, 6:7], past_key_values=cache)
        assert encodes(cache) == [1, 0] and sum(calls) == 3 * 2
        model(x[:, 7:8], past_key_values=cache)  # refilled: encoded again
        assert encodes(cache) == [1, 1] and sum(calls) == 3 * 3
        for t in range(8, 13):
            model(x[:, t: t + 1], past_key_values=cache)
    assert cache.block_tables()[0][1] == b1 and encodes(cache) == [1, 1, 1, 0]
    assert sum(calls) == 3 * 4  # b0, b1 twice, b2; in every layer
    cache.check_invariants()
    cache.release()


@pytest.mark.parametrize("q", [1, 6])
def test_crop_then_a_write_that_refills_at_once_encodes_the_block_again_once(monkeypatch, q):
    """Cropped to 7 tokens, b1 keeps 3; the next step's first token fills it: its kept tokens are decoded and the
    block encoded again in that step (with one token, or with 6 that fill b2 too)."""
    model = tiny_model("llama")
    x = ids(1, 13, seed=6)
    cache = PagedCache(block_size=B, quant="k8v4", debug=True)
    with torch.no_grad():
        model(x[:, :10], past_key_values=cache)
        cache.crop(-3)
        calls = count_encodes(monkeypatch, cache)
        model(x[:, 7: 7 + q], past_key_values=cache)
    assert encodes(cache) == ([1, 1] if q == 1 else [1, 1, 1, 0])
    assert calls == [1 if q == 1 else 2] * 3  # b1 (and b2) encoded by one call per layer
    cache.check_invariants()
    cache.release()


def test_a_second_plan_in_the_same_step_does_not_count_again():
    """A step is planned again for the layers still to write when they sit on another device (or after an
    unshare): those layers encode the step's completed blocks for the first time, so the count stays 1. The next
    step planning the same full block again is the fault. A bare store, two layers, 4 blocks."""
    store = QuantizedPageStore(B, QuantConfig.resolve("k8v4"))
    for layer in (0, 1):
        store.add_layer(layer, LayerSpec(2, 16, 16, torch.float32, torch.device("cpu")))
    store.grow(4)
    slots = torch.arange(2 * B, 3 * B)  # all of block 2, from offset 0
    new = kv(B, seed=1)
    plan = store.prepare_write(slots, torch.device("cpu"), new_step=True)
    store.write(0, plan, new[0], new[1])
    replan = store.prepare_write(slots, torch.device("cpu"), new_step=False)  # layer 1 on another device
    assert plan.done_blocks.tolist() == replan.done_blocks.tolist() == [2]
    store.write(1, replan, new[2], new[3])
    assert list(store.states.num_encodes) == [0, 0, 1, 0] and store.check(live={2}) == []
    store.prepare_write(slots, torch.device("cpu"), new_step=True)  # a new step encodes block 2 again
    assert list(store.states.num_encodes) == [0, 0, 2, 0]
    assert store.check(live={2}) == [(4, "blocks [2] encoded [2] times since they were last opened")]
    store.release([2])
    assert list(store.states.num_encodes) == [0, 0, 0, 0] and store.check(live=set()) == []


def test_rows_unshared_mid_step_count_one_encode_per_block():
    """Two rows equal in layer 0 share the block their 4 new tokens fill (written once, from offset 0); layer 1
    differs, so the second row gets a copy of it mid-step and the step is planned again. Each row's block was
    encoded once per layer: the writer's by both plans, the copy's (its layer-0 codes copied) by the second."""
    g = torch.Generator().manual_seed(0)
    prefill = [torch.randn(1, 2, 4, 16, generator=g) for _ in range(4)]
    nxt = [torch.randn(2, 2, 4, 16, generator=g) for _ in range(4)]
    nxt[0][1], nxt[1][1] = nxt[0][0], nxt[1][0]  # rows equal in layer 0 only
    cache = PagedCache(block_size=B, quant="k8v4", debug=True)
    step(cache, prefill)  # b0 encoded
    cache.batch_repeat_interleave(2)
    step(cache, nxt)
    (a0, a1), (c0, c1) = cache.block_tables()
    assert a0 == c0 and a1 != c1  # the prefill block shared, this step's block unshared
    store = cache.pool.groups[0].store
    assert [store.states.num_encodes[b] for b in (a0, a1, c1)] == [1, 1, 1]
    cache.check_invariants()
    cache.release()


def test_fork_and_copy_on_write_carry_the_count():
    model = tiny_model("llama")
    a = PagedCache(block_size=B, quant="k4v4", debug=True)
    with torch.no_grad():
        model(ids(1, 10), past_key_values=a)  # [enc | enc | open 2]
        a.crop(-5)  # 5 tokens: b1 encoded, cropped to 1 token
        b = a.fork()
        model(ids(1, 1, seed=3), past_key_values=b)  # b copies b1 before writing (a still reads it), and reopens it
    assert a.block_tables()[0][1] != b.block_tables()[0][1]
    assert encodes(a) == [1, 1] and encodes(b) == [1, 0]  # a's b1 untouched; b's copy is open again
    b.check_invariants()
    a.release()
    b.release()
