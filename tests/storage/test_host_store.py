"""`HostStore`: whole blocks in host memory, read back exactly; on CUDA from pinned memory on a copy stream of its own,
with an event the compute stream waits on; `select_blocks` picks blocks out of an export."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.storage.host_store import HostStore, select_blocks
from tests.conftest import ids, tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (pinned host memory, a copy stream and its event); none here")


def export(n: int, with_sinks: bool = False, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A block export of `n` blocks of two layers (full precision; with sink parts on blocks 0 and 2)."""
    g = torch.Generator().manual_seed(n)
    out = {f"{i}.{kind}": torch.randn(2, n, 4, 8, generator=g).to(device)  # [heads, n, block_size, dim]
           for i in (0, 1) for kind in ("keys", "values")}
    if with_sinks:
        out["sink_rows"] = torch.tensor([0, 2])
        out.update({f"{i}.sink_keys": torch.randn(2, 2, 1, 8, generator=g).to(device) for i in (0, 1)})
    return out


def test_write_then_read_is_exact_and_select_picks_blocks():
    store = HostStore(8, pin_memory=False)
    blocks = export(4, with_sinks=True)
    store.write([5, 1, 6, 2], blocks)
    back = store.read([6, 5])  # export positions 2 and 0
    want = select_blocks(blocks, [2, 0])
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name
    assert want["sink_rows"].tolist() == [0, 1] and torch.equal(want["0.sink_keys"][:, 0], blocks["0.sink_keys"][:, 1])
    assert select_blocks(blocks, [1, 3])["sink_rows"].tolist() == []  # neither has a sink
    assert store.last_copy_event is None  # CPU reads are synchronous
    with pytest.raises(ValueError, match="layout"):
        store.write([0], export(1))  # without the sink part the first write had


@pytest.mark.gpu
@CUDA
def test_cuda_read_copies_on_its_stream_and_the_compute_stream_waits():
    device = torch.device("cuda", 0)
    store = HostStore(64, pin_memory=True)
    blocks = export(32, device="cuda")
    store.write(list(range(32)), blocks)
    assert all(t.is_pinned() for t in store.tensors.values())
    back = store.read(list(range(31, -1, -1)), device)
    event = store.last_copy_event
    assert event is not None and store.copy_stream(device) != torch.cuda.current_stream(device)
    # read on the compute stream at once, without synchronizing: it waits on the event, so it sees the copies
    for name, t in blocks.items():
        assert t.device == back[name].device == device
        assert torch.equal(back[name], t.flip(1)), name
    torch.cuda.synchronize(device)
    assert event.query()


@pytest.mark.gpu
@CUDA
def test_cuda_prefix_hit_from_the_host_tier_is_exact():
    model = tiny_model("llama").to("cuda")
    try:
        pool = BlockPool(block_size=4, num_blocks=8, prefix_caching=True, host_memory="1MiB", debug=True)
        x = ids(1, 16, seed=1).cuda()
        with torch.no_grad():
            a = PagedCache.from_prefix(pool, x, model=model)
            model(x, **cache_kwargs(a))
            want = [t[:, :, :16].clone() for layer in a.layers for t in (layer.keys, layer.values)]
            a.offload()
            assert pool.host.tiers[0][1].pin_memory
            a.prefetch()  # copied back on the copy stream; the next read waits on its event
            got = [t[:, :, :16] for layer in a.layers for t in (layer.keys, layer.values)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert pool.host.tiers[0][1].last_copy_event is not None
        a.release()
        pool.check_invariants()
    finally:
        model.to("cpu")


class FailAtEmpty(TorchFunctionMode):
    """The `n`-th `torch.empty` of a storage shape raises, as a failed host (pinned) allocation would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n  # allocations left before the one that fails

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.empty and args and isinstance(args[0], tuple) and len(args[0]) > 1:
            self.n -= 1
            if self.n == 0:
                raise RuntimeError("injected: host allocation failed")
        return func(*args, **(kwargs or {}))


def test_a_first_allocation_failing_part_way_keeps_no_layout_and_the_next_write_allocates():
    store = HostStore(8, pin_memory=False)
    blocks = export(3, with_sinks=True)
    with pytest.raises(RuntimeError, match="injected"), FailAtEmpty(2):  # the second of four tensors fails
        store.write([3, 4, 5], blocks)
    assert (store.tensors, store.parts, store.bytes_reserved) == ({}, {}, 0)  # nothing half made
    assert store.check(export(0, with_sinks=True)) == []
    store.write([3, 4, 5], blocks)  # the next write allocates the whole layout
    for name, t in blocks.items():
        assert torch.equal(store.read([3, 4, 5])[name], t), name
    assert store.check(export(0, with_sinks=True)) == []


def test_check_names_a_partial_or_foreign_layout():
    store = HostStore(8, pin_memory=False)
    store.write([0], export(1))
    assert store.check(export(0)) == []
    del store.tensors["1.values"]  # a layout missing a layer's values
    assert store.check(export(0)) == ["the host store's layout is broken: the export names ['1.values'] are not in "
                                      "the layout, its [] are not in the export"]
    store = HostStore(8, pin_memory=False)
    store.write([0], export(1))
    store.tensors["0.keys"] = store.tensors["0.keys"][:, :4]  # a tensor of 4 host blocks in a store of 8
    problems = store.check(export(0))
    assert len(problems) == 1 and "'0.keys' is torch.float32 (2, 0, 4, 8) for 0 blocks" in problems[0]
    with pytest.raises(ValueError, match="'0.keys'"):
        store.write([1], export(1))
