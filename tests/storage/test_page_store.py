"""`PageStore` on its own: slots in, the same K/V out; growth, copies, debug poisoning and byte accounting.

The store used throughout: block size 4, two layers that differ in everything a layer spec can differ in::

    layer 0: 2 KV heads, key_dim 3, value_dim 5, fp32   ->  2 * (3 + 5) * 4 B = 64 B per token, 256 B per block
    layer 1: 2 KV heads, key_dim 4, value_dim 2, bf16   ->  2 * (4 + 2) * 2 B = 24 B per token,  96 B per block

Values are small integers (exact in bf16), so every comparison is `torch.equal`.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.page_store import LayerSpec, PageStore
from hf_pagedkv.storage.quantized_store import QuantizedPageStore

B = 4
CPU = torch.device("cpu")
SPECS = {0: LayerSpec(2, 3, 5, torch.float32, CPU), 1: LayerSpec(2, 4, 2, torch.bfloat16, CPU)}


def make_store(num_blocks: int = 3, debug: bool = False) -> PageStore:
    store = PageStore(B, debug=debug)
    for idx, spec in SPECS.items():
        store.add_layer(idx, spec)
    store.grow(num_blocks)
    return store


def kv(layer: int, rows: int, q: int, base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct small integers `[rows, num_kv_heads, q, dim]`: keys count up from `base`, values down from -1-base."""
    spec = SPECS[layer]
    k = torch.arange(rows * spec.num_kv_heads * q * spec.key_dim) + base
    v = -torch.arange(rows * spec.num_kv_heads * q * spec.value_dim) - 1 - base
    return (k.reshape(rows, spec.num_kv_heads, q, spec.key_dim).to(spec.dtype),
            v.reshape(rows, spec.num_kv_heads, q, spec.value_dim).to(spec.dtype))


def real_bytes(store: PageStore) -> int:
    """Bytes of the storage tensors themselves."""
    return sum(t.numel() * t.element_size() for t in store.tensors())


def keys_of(store: PageStore, idx: int) -> torch.Tensor:
    """A layer's whole key storage as one tensor (its segments concatenated)."""
    return store.keys[idx].materialize()


def values_of(store: PageStore, idx: int) -> torch.Tensor:
    return store.values[idx].materialize()


def fill_all(store: PageStore) -> dict:
    """Write every slot of every layer with distinct values; return what each layer's storage holds then."""
    slots = torch.arange(store.num_blocks * B)
    for idx in SPECS:
        k, v = kv(idx, 1, len(slots), base=100 * idx)
        store.write(idx, slots, k, v)
    return {idx: (keys_of(store, idx).clone(), values_of(store, idx).clone()) for idx in SPECS}


def is_nan(t: torch.Tensor) -> torch.Tensor:
    """Per slot: every element of the slot (all heads, all channels) is NaN. `[num_slots]` bool."""
    return t.isnan().all(dim=2).all(dim=0)


def test_layout_is_head_major_with_one_slot_range_per_block():
    store = make_store(num_blocks=3)
    assert store.num_blocks == 3
    assert tuple(store.keys[0].shape) == (2, 12, 3) and tuple(store.values[0].shape) == (2, 12, 5)
    assert tuple(store.keys[1].shape) == (2, 12, 4) and tuple(store.values[1].shape) == (2, 12, 2)
    assert store.keys[0].dtype == torch.float32 and store.values[1].dtype == torch.bfloat16
    # a block id names the same slot range in every layer
    assert store.block_slots([2, 0], CPU).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert store.block_slots([1], CPU).tolist() == [4, 5, 6, 7]
    assert LayerSpec.of(*kv(0, 1, 2)) == SPECS[0] and LayerSpec.of(*kv(1, 1, 2)) == SPECS[1]


@pytest.mark.parametrize("layer", [0, 1], ids=["fp32", "bf16"])
def test_write_then_read_gather_returns_exactly_what_was_written(layer):
    store = make_store(num_blocks=3)
    k, v = kv(layer, rows=2, q=3)  # [2, 2, 3, dim]
    # row 0 in block 1 (slots 4, 5, 6); row 1 scattered over blocks 2, 0, 2 (slots 9, 0, 10)
    slots = torch.tensor([[4, 5, 6], [9, 0, 10]])
    store.write(layer, slots.reshape(-1), k, v)  # the slot mapping is row-major
    # storage holds token t of row r, head h at [h, slots[r, t]]
    assert torch.equal(keys_of(store, layer)[1, 9], k[1, 1, 0])
    assert torch.equal(values_of(store, layer)[0, 6], v[0, 0, 2])
    got_k, got_v = store.read_gather(layer, slots)
    assert got_k.shape == k.shape and got_v.shape == v.shape and got_k.dtype == SPECS[layer].dtype
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # one gather for the batch: each row's head is a contiguous [seq_len, head_dim] matrix (what attention reads)
    assert all(t.stride()[2:] == (t.shape[-1], 1) for t in (got_k, got_v))
    # rows read in another order, and a row read twice (beams sharing blocks)
    got_k, got_v = store.read_gather(layer, slots[[1, 0, 1]])
    assert torch.equal(got_k, k[[1, 0, 1]]) and torch.equal(got_v, v[[1, 0, 1]])


@pytest.mark.parametrize("layer", [0, 1], ids=["fp32", "bf16"])
def test_read_view_of_consecutive_slots_is_a_view_of_the_storage(layer):
    store = make_store(num_blocks=3)
    k, v = kv(layer, rows=1, q=6)
    store.write(layer, torch.arange(3, 9), k, v)  # slots 3..8: the end of block 0, block 1, the start of block 2
    got_k, got_v = store.read_view(layer, 3, 6)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)  # [1, 2, 6, dim]
    assert got_k.data_ptr() == keys_of(store, layer)[:, 3:].data_ptr()  # no copy: attention reads the pool itself
    assert got_v.data_ptr() == values_of(store, layer)[:, 3:].data_ptr()
    got_k, _ = store.read_view(layer, 5, 2)  # any sub-range
    assert torch.equal(got_k, k[:, :, 2:4])


def test_writes_to_one_layer_leave_the_other_layers_and_slots_alone():
    store = make_store(num_blocks=3, debug=True)  # debug: new storage is NaN, so untouched slots are visible
    k, v = kv(0, rows=1, q=2)
    store.write(0, torch.tensor([5, 11]), k, v)
    assert is_nan(keys_of(store, 0)).nonzero().squeeze(1).tolist() == [s for s in range(12) if s not in (5, 11)]
    assert is_nan(values_of(store, 0)).nonzero().squeeze(1).tolist() == [s for s in range(12) if s not in (5, 11)]
    assert bool(is_nan(keys_of(store, 1)).all()) and bool(is_nan(values_of(store, 1)).all())


def test_grow_keeps_content_and_adds_blocks_in_every_layer():
    store = make_store(num_blocks=2, debug=True)
    before = fill_all(store)
    store.grow(5)
    assert store.num_blocks == 5
    for idx in SPECS:
        assert tuple(store.keys[idx].shape)[:2] == (2, 20) and tuple(store.values[idx].shape)[:2] == (2, 20)
        assert torch.equal(keys_of(store, idx)[:, :8], before[idx][0])  # blocks 0, 1 exactly as they were
        assert torch.equal(values_of(store, idx)[:, :8], before[idx][1])
        assert bool(is_nan(keys_of(store, idx)[:, 8:]).all()) and bool(is_nan(values_of(store, idx)[:, 8:]).all())
    store.grow(5)  # to the same size: nothing changes
    assert torch.equal(keys_of(store, 0)[:, :8], before[0][0])
    with pytest.raises(AssertionError):  # storage never shrinks
        store.grow(4)


def test_a_layer_added_after_growth_gets_every_block():
    store = PageStore(B)
    store.add_layer(0, SPECS[0])
    store.grow(3)
    store.add_layer(1, SPECS[1])
    assert tuple(store.keys[1].shape) == (2, 12, 4) and tuple(store.values[1].shape) == (2, 12, 2)
    with pytest.raises(AssertionError, match="layer 1 already has storage"):
        store.add_layer(1, SPECS[1])


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    store = make_store(num_blocks=4)
    before = fill_all(store)
    store.copy_blocks([0, 1], [3, 2])  # block 0 -> 3, block 1 -> 2
    for idx in SPECS:
        for now, old in zip((keys_of(store, idx), values_of(store, idx)), before[idx]):
            assert torch.equal(now[:, 12:16], old[:, 0:4])  # block 3 is block 0
            assert torch.equal(now[:, 8:12], old[:, 4:8])  # block 2 is block 1
            assert torch.equal(now[:, :8], old[:, :8])  # the sources are untouched
    store.copy_blocks([], [])  # nothing to copy
    assert torch.equal(keys_of(store, 0)[:, 12:16], before[0][0][:, 0:4])


def test_poison_nan_fills_exactly_the_named_blocks_in_every_layer():
    store = make_store(num_blocks=3, debug=True)
    before = fill_all(store)
    assert not any(bool(t.isnan().any()) for t in store.tensors())
    store.poison([2, 0])
    for idx in SPECS:
        for now, old in zip((keys_of(store, idx), values_of(store, idx)), before[idx]):
            assert is_nan(now).nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
            assert torch.equal(now[:, 4:8], old[:, 4:8])  # block 1 keeps its K/V
    store.release([1])  # a block whose refcount reached 0 is poisoned the same way
    assert bool(is_nan(keys_of(store, 1)).all()) and bool(is_nan(values_of(store, 0)).all())


def test_poison_slots_nan_fills_exactly_the_named_slots():
    store = make_store(num_blocks=3, debug=True)
    before = fill_all(store)
    store.poison_slots([6, 7, 9])  # the tail of a block cropped to 2 tokens, and one slot of the next
    for idx in SPECS:
        for now, old in zip((keys_of(store, idx), values_of(store, idx)), before[idx]):
            assert is_nan(now).nonzero().squeeze(1).tolist() == [6, 7, 9]
            keep = [s for s in range(12) if s not in (6, 7, 9)]
            assert torch.equal(now[:, keep], old[:, keep])


def test_poisoning_is_off_outside_debug_mode():
    store = make_store(num_blocks=2, debug=False)
    before = fill_all(store)
    store.poison([0, 1])
    store.poison_slots([3])
    store.release([0])
    for idx in SPECS:
        assert torch.equal(keys_of(store, idx), before[idx][0]) and torch.equal(values_of(store, idx), before[idx][1])


def test_bytes_per_block_and_reserved_are_the_bytes_of_the_tensors():
    store = PageStore(B)
    assert store.bytes_per_block == 0 and store.bytes_reserved() == 0 == real_bytes(store)
    store.add_layer(0, SPECS[0])
    store.grow(3)
    assert store.bytes_per_block == 256  # 4 tokens * 2 heads * (3 + 5) channels * 4 B
    assert store.bytes_reserved() == 768 == real_bytes(store)
    store.add_layer(1, SPECS[1])
    assert store.block_bytes(SPECS[1]) == 96  # 4 tokens * 2 heads * (4 + 2) channels * 2 B
    assert store.bytes_per_block == 352
    assert store.bytes_reserved() == 1056 == real_bytes(store)
    store.grow(10)
    assert store.bytes_reserved() == 3520 == real_bytes(store)
    assert store.bytes_in_use(7) == 7 * 352
    # one block is the same slice of every tensor: per-tensor bytes over the block count add up to it
    per_block = sum(t.nbytes // store.num_blocks for d in (store.keys, store.values) for t in d.values())
    assert per_block == store.bytes_per_block
    assert SPECS[0].bytes_per_token == 64 and SPECS[1].bytes_per_token == 24


def test_grow_appends_a_segment_without_copying_and_reads_cross_segments_exactly():
    """Growth adds a segment per layer (the old storage is neither copied nor freed); a row in one segment reads
    as a view, a row across the boundary reads the same values as a copy; writes and gathers split per segment."""
    store = make_store(num_blocks=2)
    old_ptr = store.keys[0].segments[0].data_ptr()
    store.grow(5)
    assert store.segment_blocks == [2, 3] and [t.shape[1] for t in store.keys[0].segments] == [8, 12]
    assert store.keys[0].segments[0].data_ptr() == old_ptr  # not reallocated
    assert store.bytes_reserved() == real_bytes(store) == 5 * 352
    k, v = kv(0, rows=1, q=10)
    store.write(0, torch.arange(3, 13), k, v)  # slots 3..12: blocks 0, 1 (segment 0) and 2, 3 (segment 1)
    got_k, got_v = store.read_view(0, 3, 10)  # crosses the boundary at slot 8: a copy, same values
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    got_k, _ = store.read_view(0, 8, 5)  # wholly in segment 1: a view of it
    assert torch.equal(got_k, k[:, :, 5:]) and got_k.data_ptr() == store.keys[0].segments[1][:, 0:].data_ptr()
    slots = torch.tensor([[12, 3, 9], [4, 10, 5]])  # rows mixing both segments
    got_k, got_v = store.read_gather(0, slots)
    assert torch.equal(got_k, k[0][:, slots - 3].permute(1, 0, 2, 3))
    assert torch.equal(got_v, v[0][:, slots - 3].permute(1, 0, 2, 3))
    store.copy_blocks([0, 3], [4, 1])  # across segments both ways
    # compared as bits: block 0's slots 0-2 were never written, and uninitialized memory may hold NaN patterns
    bits = keys_of(store, 0).view(torch.int32)
    assert torch.equal(bits[:, 16:20], bits[:, 0:4])


def test_shrink_drops_only_whole_trailing_segments():
    store = make_store(num_blocks=2)
    store.grow(5)
    store.grow(6)
    assert store.segment_blocks == [2, 3, 1]
    assert store.shrink(4) == 5  # block 4 sits in the [2, 5) segment, which is kept; only [5, 6) goes
    assert store.segment_blocks == [2, 3] and store.bytes_reserved() == real_bytes(store) == 5 * 352
    assert store.shrink(2) == 2 and store.segment_blocks == [2]
    assert store.shrink(0) == 0 and store.segment_blocks == [] and real_bytes(store) == 0
    store.grow(1)  # usable again
    assert [t.shape[1] for t in store.keys[1].segments] == [4]


# -- prefix-cache files: a path that cannot be written says which (storage/prefix_file.py) -----------------------
@pytest.mark.parametrize("bad", ["", None, 3])
def test_writing_a_prefix_file_to_no_path_is_refused(bad):
    from hf_pagedkv.storage.prefix_file import write_prefix_file  # noqa: PLC0415
    with pytest.raises(ValueError, match="give the prefix-cache file"):
        write_prefix_file(bad, {}, {})


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_writing_a_prefix_file_over_a_device_or_a_pipe_is_refused_and_leaves_it(tmp_path):
    import os  # noqa: PLC0415
    import stat  # noqa: PLC0415

    from hf_pagedkv.storage.prefix_file import write_prefix_file  # noqa: PLC0415
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="is not a regular file"):
        write_prefix_file(fifo, {}, {})
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
    with pytest.raises(OSError, match="is not a regular file"):
        write_prefix_file(os.devnull, {}, {})
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # still the device


def test_writing_a_prefix_file_names_the_path_asked_for(tmp_path):
    from hf_pagedkv.storage.prefix_file import write_prefix_file  # noqa: PLC0415
    with pytest.raises(IsADirectoryError, match="is a directory"):
        write_prefix_file(tmp_path, {}, {})
    missing = tmp_path / "no" / "such" / "p.safetensors"
    with pytest.raises(FileNotFoundError, match="p.safetensors") as info:
        write_prefix_file(missing, {}, {})
    assert ".tmp" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    ok = tmp_path / "p.safetensors"
    assert write_prefix_file(ok, {}, {"x": torch.zeros(2)}) == ok.stat().st_size > 0


class FailAtAllocation(TorchFunctionMode):
    """The `n`-th storage allocation (`torch.full` / `torch.empty`) raises, as a device out of memory would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n  # allocations left before the one that fails

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.full, torch.empty):
            self.n -= 1
            if self.n == 0:
                raise RuntimeError("injected: out of memory")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_a_growth_failing_part_way_adds_no_segment_to_any_layer(quant):
    if quant is None:
        store = make_store(num_blocks=2, debug=True)
        tensors = [t for idx in SPECS for t in (store.keys[idx], store.values[idx])]
    else:
        store = QuantizedPageStore(B, QuantConfig.resolve(quant), debug=True)
        store.add_layer(0, SPECS[0])
        store.add_layer(1, LayerSpec(2, 4, 2, torch.float32, CPU))
        store.grow(2)
        tensors = [t for idx in (0, 1) for t in store.codes[idx] + store.scales[idx]]
    before = [t.materialize().clone() for t in tensors]
    with pytest.raises(RuntimeError, match="injected"), FailAtAllocation(3):  # the third tensor's new segment
        store.grow(5)
    assert store.num_blocks == 2 and store.segment_blocks == [2]
    assert [len(t.segments) for t in tensors] == [1] * len(tensors)  # no layer kept a segment of the failed growth
    for t, b in zip(tensors, before):  # the blocks there were, as they were (NaN where poisoned)
        torch.testing.assert_close(t.materialize(), b, rtol=0, atol=0, equal_nan=True)
    store.grow(5)  # the next growth adds one segment to every layer
    assert store.segment_blocks == [2, 3] and [len(t.segments) for t in tensors] == [2] * len(tensors)


def test_split_memo_keeps_every_live_index_of_a_packed_step_and_drops_dead_ones():
    """A packed step interleaves many caches layer by layer: each live write index is split once for every layer
    (no eviction among 40 live indices), and an index that dies takes its entry with it."""
    store = make_store(num_blocks=12)
    t = store.keys[0]
    indices = [torch.tensor([i, i + 1]) for i in range(40)]
    first = [store.split(t, idx) for idx in indices]
    again = [store.split(t, idx) for idx in indices]  # the next layer: all hits
    assert all(a is b for a, b in zip(first, again))
    assert len(store._splits) == 40
    del indices[:10], first, again
    assert len(store._splits) == 30
    store.grow(13)  # new segments: every split is recomputed
    assert len(store._splits) == 0
