"""`SegmentedTensor` against one plain tensor: every operation, indices over several segments, splits reused."""

import pytest
import torch

from hf_pagedkv.storage.segmented_tensor import SegmentedTensor


def make(lengths, d0=2, d2=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = SegmentedTensor(d0, d2, torch.float32, torch.device("cpu"))
    for n in lengths:
        t.append_segment(n)
    plain = torch.randn(d0, sum(lengths), d2, generator=g)
    t.index_copy_(1, torch.arange(sum(lengths)), plain)
    return t, plain


@pytest.mark.parametrize("lengths", [[12], [4, 8], [8, 4, 12]])
@pytest.mark.parametrize("seed", range(4))
def test_reads_and_writes_equal_a_plain_tensor(lengths, seed):
    t, plain = make(lengths, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    n = sum(lengths)
    idx = torch.randint(0, n, (9,), generator=g)
    assert torch.equal(t.materialize(), plain)
    assert torch.equal(t.index_select(1, idx), plain.index_select(1, idx))
    out = torch.empty(2, 9, 3)
    assert t.index_select(1, idx, out=out) is out and torch.equal(out, plain.index_select(1, idx))
    chunks = torch.randint(0, n // 4, (5,), generator=g)  # every segment length is a multiple of 4
    want = plain.view(2, n // 4, 12).index_select(1, chunks)
    assert torch.equal(t.index_select_chunks(chunks, 4), want)
    for start, length in ((0, n), (3, 6), (n - 5, 5)):
        assert torch.equal(t.narrow(1, start, length), plain.narrow(1, start, length))
    dst = torch.randperm(n, generator=g)[:7]  # distinct slots, spread over the segments
    src = torch.randn(2, 7, 3, generator=g)
    t.index_copy_(1, dst, src)
    plain.index_copy_(1, dst, src)
    t.index_fill_(1, dst[:3], -1.0)
    plain.index_fill_(1, dst[:3], -1.0)
    assert torch.equal(t.materialize(), plain)


def test_a_split_names_the_majority_segment_and_is_reused_by_tensors_with_the_same_segments():
    a, plain_a = make([4, 8, 4], seed=1)
    b, plain_b = make([4, 8, 4], seed=2)
    idx = torch.tensor([5, 6, 7, 1, 12, 9])  # segment 1 holds 4 of them, segment 0 one, segment 2 one
    split = a.split(idx)
    assert split.base == 1 and not split.single
    assert sorted(s for s, _, _ in split.parts) == [0, 1, 2] and sorted(s for s, _, _ in split.patches) == [0, 2]
    assert torch.equal(b.index_select(1, idx, split=split), plain_b.index_select(1, idx))  # b's values, a's split
    in_one = a.split(torch.tensor([4, 11, 8]))
    assert in_one.single and in_one.base == 1 and in_one.base_local.tolist() == [0, 7, 4]
    with pytest.raises(AssertionError, match="chunk size"):
        a.index_select_chunks(torch.tensor([1]), 4, split=a.split(torch.tensor([1]), 2))


def _two_segment_store():
    """A page store grown into segments of 2 and 3 blocks, every slot of every layer filled with random K/V."""
    from tests.storage.test_page_store import make_store  # noqa: PLC0415  (the page-store helpers)
    store = make_store(num_blocks=2)
    store.grow(5)
    for d in (store.keys, store.values):
        for t in d.values():
            t.index_copy_(1, torch.arange(t.length), torch.randn(t.shape).to(t.dtype))
    return store


def test_page_store_splits_a_step_index_once_for_all_layers_and_forgets_it_when_segments_change():
    store = _two_segment_store()
    blocks = torch.tensor([[0, 3], [2, 1]])  # both rows cross the segment boundary
    calls = []
    real_split = type(store.keys[0]).split

    def counting(self, index, size=1):
        calls.append(size)
        return real_split(self, index, size)

    type(store.keys[0]).split = counting
    try:
        k0, _ = store.read_blocks(0, blocks, 0, 8)
        k1, _ = store.read_blocks(1, blocks, 0, 8)
        assert len(calls) == 1  # one split, two layers
        store.grow(7)  # a new segment: the memo is dropped, the same tensor is split again
        store.read_blocks(0, blocks, 0, 8)
        assert len(calls) == 2
    finally:
        type(store.keys[0]).split = real_split
    for layer, got in ((0, k0), (1, k1)):
        whole = store.keys[layer].materialize()  # [heads, slots, dim]
        slots = (blocks[:, :, None] * store.block_size + torch.arange(store.block_size)).reshape(2, -1)
        assert torch.equal(got, whole[:, slots].transpose(0, 1))


@pytest.mark.parametrize("lengths", [[12], [4, 8], [8, 4, 12]])
@pytest.mark.parametrize("size", [1, 4])
def test_gather_rows_is_a_contiguous_batch_major_gather_equal_to_a_plain_tensor(lengths, size):
    t, plain = make(lengths, d0=3, d2=2, seed=len(lengths) + size)
    n = sum(lengths) // size  # chunks (every segment length is a multiple of 4)
    g = torch.Generator().manual_seed(size)
    index = torch.randint(0, n, (5, 3), generator=g)  # [batch, chunks per row]: spread over every segment
    chunks = plain.view(3, n, size, 2)  # [d0, chunks, size, d2]
    want = chunks[:, index].permute(1, 0, 2, 3, 4).reshape(5, 3, 3 * size, 2)  # [batch, d0, 3 * size, d2]
    plan = t.row_gather(index, size)
    got = t.gather_rows(plan)
    assert got.is_contiguous() and torch.equal(got, want)
    assert len(plan.patches) == len({s for s in torch.bucketize(index.reshape(-1) * size, torch.tensor(
        t.starts[1:]), right=True).tolist()} - {plan.base})  # one patch per other segment touched
    other, plain_other = make(lengths, d0=3, d2=5, seed=9)  # same segments and d0, another d2: the plan is reused
    want_other = plain_other.view(3, n, size, 5)[:, index].permute(1, 0, 2, 3, 4).reshape(5, 3, 3 * size, 5)
    assert torch.equal(other.gather_rows(plan), want_other)


def test_page_store_reads_exactly_the_tokens_asked_contiguous_and_plans_the_gather_once_per_step():
    store = _two_segment_store()
    B = store.block_size
    blocks = torch.tensor([[0, 3, 4], [2, 1, 0], [4, 4, 4]])  # rows across the segment boundary, one repeating
    built = []
    real = type(store.keys[0]).row_gather

    def counting(self, index, size, split=None):
        built.append(size)
        return real(self, index, size, split)

    type(store.keys[0]).row_gather = counting
    try:
        for offset, length in ((0, 3 * B), (1, 2 * B), (B - 1, B + 2)):
            built.clear()
            for layer in store.specs:
                k, v = store.read_blocks(layer, blocks, offset, length)
                pos = torch.arange(offset, offset + length)
                slots = blocks[:, pos // B] * B + pos % B  # [batch, length]
                for got, t in ((k, store.keys[layer]), (v, store.values[layer])):
                    assert got.shape == (3, t.d0, length, t.d2) and got.is_contiguous()  # DynamicCache's layout
                    assert torch.equal(got, t.materialize()[:, slots].transpose(0, 1))
            assert built == [1]  # one plan for every layer, keys and values
    finally:
        type(store.keys[0]).row_gather = real
