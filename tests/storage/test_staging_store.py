"""`StagingStore` on its own: which stage ids come out, when and how it grows, what the views address, debug NaN,
byte accounting and misuse (double free, unknown stage).

The store used throughout: stages of 4 tokens, two layers::

    layer 0: 2 KV heads, key_dim 3, value_dim 5, fp32   ->  4 * 2 * (3 + 5) * 4 B = 256 B per stage
    layer 1: 1 KV head,  key_dim 2, value_dim 2, bf16   ->  4 * 1 * (2 + 2) * 2 B =  32 B per stage
"""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.staging_store import StagingStore

B = 4
CPU = torch.device("cpu")
SPECS = {0: LayerSpec(2, 3, 5, torch.float32, CPU), 1: LayerSpec(1, 2, 2, torch.bfloat16, CPU)}


def make_store(debug: bool = False) -> StagingStore:
    store = StagingStore(B, debug=debug)
    for idx, spec in SPECS.items():
        store.add_layer(idx, spec)
    return store


def tensors(store: StagingStore) -> list[torch.Tensor]:
    return [t for d in (store.keys, store.values) for t in d.values()]


def stage_is_nan(store: StagingStore, stage: int) -> list[bool]:
    """For every tensor: is every element of `stage` NaN."""
    return [bool(t[:, stage * B: (stage + 1) * B].isnan().all()) for t in tensors(store)]


def mark(store: StagingStore, stage: int) -> None:
    """Fill `stage` with its own id (+ 0.5 in the values) in every layer, through the `block` view."""
    for idx in SPECS:
        store.block(store.keys, idx, stage).fill_(stage)
        store.block(store.values, idx, stage).fill_(stage + 0.5)


def test_stages_are_allocated_as_needed_and_the_lowest_ids_come_first():
    store = make_store()
    assert store.num_stages == 0 and store.num_used == 0 and tensors(store)[0].shape[1] == 0
    assert store.allocate() == 0
    assert store.num_stages == 1  # one sequence, one stage: no minimum of 8
    assert [store.allocate() for _ in range(2)] == [1, 2]
    assert store.num_stages == 3 and store.num_used == 3
    assert [tuple(t.shape) for t in tensors(store)] == [(2, 12, 3), (1, 12, 2), (2, 12, 5), (1, 12, 2)]


def test_a_freed_stage_is_reused_before_fresh_ones_most_recently_freed_first():
    store = make_store()
    assert [store.allocate() for _ in range(5)] == [0, 1, 2, 3, 4]
    store.free(3)
    store.free(1)
    assert store.num_used == 3
    # the free list is a stack: the last stage freed comes back first, then the fresh ids in increasing order
    assert [store.allocate() for _ in range(4)] == [1, 3, 5, 6]
    assert store.num_used == 7 and store.num_stages == 7


def test_capacity_grows_by_a_quarter_when_full_and_never_shrinks():
    store = make_store()
    assert [store.allocate() for _ in range(8)] == list(range(8))
    assert store.num_stages == 8
    assert store.allocate() == 8  # the 9th stage: capacity grows by 8 // 4, the first new id comes out
    assert store.num_stages == 10 and store.num_used == 9
    assert [tuple(t.shape)[1] for t in tensors(store)] == [40] * 4
    assert [store.allocate() for _ in range(7)] == list(range(9, 16))  # 10 -> 12 -> 15 -> 18
    assert store.num_stages == 18
    for s in range(16):
        store.free(s)
    assert store.num_used == 0 and store.num_stages == 18  # freeing keeps the capacity


def test_content_survives_growth():
    store = make_store()
    for _ in range(8):
        mark(store, store.allocate())
    store.free(5)
    store.allocate()  # reuses 5, no growth
    assert store.num_stages == 8
    assert store.allocate() == 8 and store.num_stages == 10  # grows
    for idx in SPECS:
        for s in range(8):
            assert bool((store.block(store.keys, idx, s) == s).all())
            assert bool((store.block(store.values, idx, s) == s + 0.5).all())
        assert bool((store.keys[idx][:, 32:] == 0).all())  # new stages start zeroed outside debug mode


def test_block_and_blocks_are_views_of_the_right_slots():
    store = make_store()
    for _ in range(3):
        store.allocate()
    view = store.block(store.keys, 0, 2)
    assert tuple(view.shape) == (2, B, 3)
    view.copy_(torch.arange(24, dtype=torch.float32).view(2, 4, 3))  # write through the view
    k = store.keys[0]
    assert torch.equal(k[:, 8:12], torch.arange(24, dtype=torch.float32).view(2, 4, 3))  # stage 2 = slots 8..11
    assert bool((k[:, :8] == 0).all()) and bool((k[:, 12:] == 0).all())  # no other slot changed
    assert bool((store.keys[1] == 0).all()) and bool((store.values[0] == 0).all())  # nor another layer or half
    all_stages = store.blocks(store.keys, 0)
    assert tuple(all_stages.shape) == (2, 3, B, 3)  # [num_kv_heads, num_stages, block_size, key_dim]
    assert torch.equal(all_stages[:, 2], view)
    all_stages[:, 1, 1] = -1.0  # a view too: token 1 of stage 1 is slot 5
    assert bool((k[:, 5] == -1).all()) and int((k == -1).sum()) == 2 * 3
    v = store.blocks(store.values, 1)
    assert tuple(v.shape) == (1, 3, B, 2) and v.dtype == torch.bfloat16


def test_debug_mode_new_and_freed_stages_are_nan():
    store = make_store(debug=True)
    a, b = store.allocate(), store.allocate()
    assert all(stage_is_nan(store, s) == [True] * 4 for s in range(2))  # new storage is NaN until written
    mark(store, a)
    mark(store, b)
    store.free(a)
    assert stage_is_nan(store, a) == [True] * 4
    assert stage_is_nan(store, b) == [False] * 4 and bool((store.block(store.keys, 0, b) == b).all())
    assert [store.allocate() for _ in range(8)] == [a, 2, 3, 4, 5, 6, 7, 8]  # the 9th in use grows to 10
    assert store.num_stages == 10
    assert all(stage_is_nan(store, s) == [True] * 4 for s in range(10) if s != b)  # a reused stage is NaN too
    assert bool((store.block(store.values, 1, b) == b + 0.5).all())


def test_outside_debug_mode_a_freed_stage_keeps_its_content():
    store = make_store()
    s = store.allocate()
    mark(store, s)
    store.free(s)
    assert stage_is_nan(store, s) == [False] * 4 and bool((store.block(store.keys, 1, s) == s).all())


def test_bytes_per_stage_is_the_bytes_of_one_stage_of_every_tensor():
    store = make_store()
    assert store.bytes_per_stage() == 256 + 32
    store.allocate()
    real = sum(t.numel() * t.element_size() for t in tensors(store))
    assert real == store.num_stages * store.bytes_per_stage() == 1 * 288 == store.bytes_reserved()
    assert store.bytes_in_use() == 288
    assert StagingStore(B).bytes_per_stage() == 0  # no layer yet


def test_double_free_and_unknown_stage_raise():
    store = make_store()
    for _ in range(9):  # 9 stages in use of 10: stage 9 was never handed out
        store.allocate()
    for s in range(9):
        store.free(s)
    with pytest.raises(AssertionError, match="double free of stage 0"):
        store.free(0)
    with pytest.raises(AssertionError, match="double free of stage 9"):  # a stage never handed out is free too
        store.free(9)
    with pytest.raises(AssertionError, match=r"free of unknown stage 10 \(the store has stages 0\.\.9\)"):
        store.free(10)
    with pytest.raises(AssertionError, match="free of unknown stage -1"):
        store.free(-1)
    assert store.num_used == 0 and sorted(store._free) == list(range(10))  # the failed frees changed nothing
    with pytest.raises(AssertionError, match=r"free of unknown stage 0 \(the store has no stages\)"):
        StagingStore(B).free(0)


def test_add_layer_twice_raises_and_a_late_layer_gets_every_stage():
    store = StagingStore(B)
    store.add_layer(0, SPECS[0])
    store.allocate()
    store.add_layer(1, SPECS[1])
    assert tuple(store.keys[1].shape) == (1, 4, 2)
    with pytest.raises(AssertionError, match="layer 1 already has stages"):
        store.add_layer(1, SPECS[1])


def test_stages_are_copied_read_and_written_by_id_and_nothing_else_changes():
    store = make_store()
    for stage in range(3):
        store.allocate()
        mark(store, stage)
    store.copy_stages(0, [(2, 0)])  # layer 0 only: stage 0 becomes a copy of stage 2
    assert store.block(store.keys, 0, 0).eq(2).all() and store.block(store.values, 0, 0).eq(2.5).all()
    assert store.block(store.keys, 1, 0).eq(0).all()  # layer 1 keeps its stage 0
    got = store.read_stages(store.values, 0, [1, 2], 3)  # the first 3 tokens of stages 1 and 2, in that order
    assert tuple(got.shape) == (2, 2, 3, 5) and got.is_contiguous()
    assert got[:, 0].eq(1.5).all() and got[:, 1].eq(2.5).all()
    store.write_stages(store.values, 0, [1], torch.full((2, 1, 3, 5), -1.0))  # tokens 0..2 of stage 1
    v = store.blocks(store.values, 0)  # [num_kv_heads, num_stages, B, value_dim]
    assert v[:, 1, :3].eq(-1).all() and v[:, 1, 3].eq(1.5).all() and v[:, 2].eq(2.5).all()
    assert store.block(store.keys, 0, 1).eq(1).all()  # the keys of stage 1 are untouched
