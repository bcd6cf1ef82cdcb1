"""`BlockStorage`: one implementation of segments, growth, copies, exports and poison for both page stores."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv.storage.block_storage import BlockStorage, BlockTensor
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor

B = 4  # tokens per block


def make(debug: bool = False) -> tuple[BlockStorage, SegmentedTensor, SegmentedTensor]:
    """Layer 0 with one slot-addressed tensor (a full-precision store's keys: `[2, blocks * B, 3]`) and one
    block-addressed tensor (a quantized store's codes: `[2, blocks, 5]` uint8)."""
    storage = BlockStorage(debug)
    keys = SegmentedTensor(2, 3, torch.float32, torch.device("cpu"))
    codes = SegmentedTensor(2, 5, torch.uint8, torch.device("cpu"))
    storage.add_layer(0, (BlockTensor("keys", keys, (B, 3), 0.0, float("nan")),
                          BlockTensor("codes", codes, (5,), 0, 0xFF)))
    return storage, keys, codes


def test_grow_adds_one_segment_of_whole_blocks_to_every_tensor_and_shrink_drops_whole_ones():
    storage, keys, codes = make()
    storage.grow(2)
    storage.grow(5)  # a second segment of 3 blocks
    assert storage.segment_blocks == [2, 3] and storage.num_blocks == 5
    assert [s.shape[1] for s in keys.segments] == [2 * B, 3 * B] and [s.shape[1] for s in codes.segments] == [2, 3]
    assert storage.shrink(3) == 5  # block 3 and 4 lie in a segment that starts at 2: kept
    assert storage.shrink(2) == 2 and storage.segment_blocks == [2] and (keys.length, codes.length) == (2 * B, 2)


def test_new_storage_holds_the_fill_or_in_debug_mode_the_poison():
    storage, keys, codes = make()
    storage.grow(1)
    assert bool(keys.materialize().eq(0).all()) and bool(codes.materialize().eq(0).all())
    storage.debug = True
    storage.grow(2)
    assert bool(keys.segments[1].isnan().all()) and bool(codes.segments[1].eq(0xFF).all())


def test_export_then_import_moves_whole_blocks_in_the_shape_of_one_block_per_head():
    storage, keys, codes = make()
    storage.grow(4)
    keys.index_copy_(1, torch.arange(4 * B), torch.arange(2 * 4 * B * 3, dtype=torch.float32).view(2, 4 * B, 3))
    codes.index_copy_(1, torch.arange(4), torch.arange(40, dtype=torch.uint8).view(2, 4, 5))
    export = storage.export_blocks([3, 1])
    assert list(export) == ["0.keys", "0.codes"]
    assert export["0.keys"].shape == (2, 2, B, 3) and export["0.codes"].shape == (2, 2, 5)
    assert torch.equal(export["0.codes"][:, 0], codes.materialize()[:, 3])
    assert torch.equal(export["0.keys"][:, 1], keys.materialize()[:, B: 2 * B])
    assert storage.export_shapes(2) == {"0.keys": ((2, 2, B, 3), torch.float32), "0.codes": ((2, 2, 5), torch.uint8)}
    storage.import_blocks([0, 2], export)  # block 3 -> 0, block 1 -> 2
    assert torch.equal(codes.materialize()[:, 0], codes.materialize()[:, 3])
    assert torch.equal(keys.materialize()[:, 2 * B: 3 * B], keys.materialize()[:, B: 2 * B])


def test_an_import_of_the_wrong_shape_names_it_and_writes_nothing():
    storage, keys, codes = make()
    storage.grow(2)
    before = (keys.materialize().clone(), codes.materialize().clone())
    export = storage.export_blocks([0])
    export["0.codes"] = export["0.codes"][:, :, :4]
    with pytest.raises(ValueError, match=r"'0.codes' is torch.uint8 \(2, 1, 4\), this store needs torch.uint8"):
        storage.import_blocks([1], {"0.keys": torch.ones(2, 1, B, 3), "0.codes": export["0.codes"]})
    assert torch.equal(keys.materialize(), before[0]) and torch.equal(codes.materialize(), before[1])


def test_copy_fill_poison_and_written_layers_touch_exactly_the_named_blocks():
    storage, keys, codes = make()
    storage.grow(3)
    codes.index_fill_(1, torch.tensor([0]), 7)
    storage.copy_blocks([0], [2])
    assert codes.materialize()[:, :, 0].tolist() == [[7, 0, 7], [7, 0, 7]]
    assert storage.written_layers([1]) == [] and storage.written_layers([2]) == [0]
    storage.poison([2])  # outside debug mode: nothing
    assert codes.materialize()[:, 2, 0].tolist() == [7, 7]
    storage.debug = True
    storage.poison([2])
    assert codes.materialize()[:, :, 0].tolist() == [[7, 0, 255], [7, 0, 255]]
    assert bool(keys.materialize()[:, 2 * B:].isnan().all()) and not bool(keys.materialize()[:, : 2 * B].isnan().any())
    storage.fill_blocks([2], 0)
    assert storage.written_layers([2]) == []


def test_a_growth_failing_part_way_leaves_every_tensor_as_it_was(monkeypatch):
    storage, keys, codes = make()
    storage.grow(2)

    def fail(n, fill=None):
        raise torch.OutOfMemoryError("no memory for the codes")

    monkeypatch.setattr(codes, "append_segment", fail)  # the keys get their segment, the codes fail
    with pytest.raises(torch.OutOfMemoryError):
        storage.grow(4)
    assert storage.segment_blocks == [2] and len(keys.segments) == len(codes.segments) == 1
