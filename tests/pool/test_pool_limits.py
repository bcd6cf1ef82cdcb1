"""Pool sizes that cannot work are refused up front, with the setting, the bytes and the alternative named, and
nothing allocated: a `num_blocks` whose bookkeeping or storage exceeds the machine, a `block_size` past
`MAX_BLOCK_SIZE`."""

import pytest
import torch

import hf_pagedkv.pool.layer_registry as layer_registry
import hf_pagedkv.pool.pool_settings as pool_settings
from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.config import MAX_BLOCK_SIZE
from tests.conftest import ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# one block of one tiny-Llama layer: 16 tokens x 2 KV heads x (16 + 16) dims x 4 bytes
LLAMA_BLOCK_BYTES = 16 * 2 * 32 * 4


def test_num_blocks_whose_bookkeeping_exceeds_the_ram_is_refused_at_construction():
    # 10**15 blocks need 128 * 10**15 bytes of bookkeeping: more than any machine, refused before any list is made
    with pytest.raises(ValueError, match=r"BlockPool\(num_blocks=1,000,000,000,000,000\): .* bookkeeping alone would "
                                         r"take 128,000,000,000,000,000 bytes of host memory .* max_memory='4GiB'"):
        BlockPool(num_blocks=10**15)
    with pytest.raises(ValueError, match=r"num_blocks=1,000,000,000,000,000"):
        PagedCache(num_blocks=10**15)


def test_num_blocks_bookkeeping_limit_follows_the_ram(monkeypatch):
    monkeypatch.setattr(pool_settings, "host_memory_bytes", lambda: 128 * 1000)
    with pytest.raises(ValueError, match=r"more than this machine has \(128,000 bytes\).*\(at most 1,000 fit the "
                                         r"bookkeeping"):
        BlockPool(num_blocks=1001)
    assert BlockPool(num_blocks=1000).num_blocks == 1000  # exactly at the limit: accepted
    monkeypatch.setattr(pool_settings, "host_memory_bytes", lambda: None)  # unknown RAM: not checked
    assert BlockPool(num_blocks=1001).num_blocks == 1001


def _fake_memory(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(layer_registry, "device_memory", lambda device: nbytes)


def test_fixed_pool_larger_than_the_device_is_refused_at_its_first_layer_with_a_config(monkeypatch):
    model = tiny_model("llama")  # 3 layers
    _fake_memory(monkeypatch, 10 * 2**20)  # 10 MiB: 3 layers x 1000 blocks x 4096 bytes = 12,288,000 do not fit
    pool = BlockPool(num_blocks=1000)
    cache = PagedCache(pool=pool, config=model.config)
    with pytest.raises(ValueError, match=r"BlockPool\(num_blocks=1,000\) preallocates every block \(16 tokens\) in "
                                         r"every layer: 3 layers x 1,000 blocks x 4,096 bytes = 12,288,000 bytes, "
                                         r"more than cpu has \(10,485,760 bytes in all\); nothing was allocated for "
                                         r"layer 0\. Give fewer blocks \(at most about 853 fit\), or .*max_memory="):
        model(ids(1, 4), past_key_values=cache)
    assert [len(g.store.specs) for g in pool.groups] == [0]  # no layer got storage
    assert pool.stats().blocks_in_use == 0 and pool.stats().bytes_reserved == 0
    pool.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
    # the count the message suggests fits
    fits = PagedCache(pool=BlockPool(num_blocks=853), config=model.config)
    model(ids(1, 4), past_key_values=fits)
    assert fits.pool.stats().bytes_reserved == 3 * 853 * LLAMA_BLOCK_BYTES
    fits.release()


def test_fixed_pool_larger_than_the_device_without_a_config_stops_at_the_layer_that_overflows(monkeypatch):
    model = tiny_model("llama")
    _fake_memory(monkeypatch, 10 * 2**20)  # two layers of 1000 blocks fit (8,192,000 bytes), the third does not
    pool = BlockPool(num_blocks=1000)
    cache = PagedCache(pool=pool)
    with pytest.raises(ValueError, match=r"layer 2's 1,000 blocks x 4,096 bytes, plus 8,192,000 bytes of the layers "
                                         r"already there = 12,288,000 bytes, more than cpu has .* nothing was "
                                         r"allocated for layer 2"):
        model(ids(1, 4), past_key_values=cache)
    assert sorted(pool.groups[0].store.specs) == [0, 1]
    pool.check_invariants()
    with pytest.raises(ValueError, match=r"nothing was allocated for layer 2"):  # a retry fails the same way
        model(ids(1, 1), past_key_values=cache)
    assert sorted(pool.groups[0].store.specs) == [0, 1]
    cache.release()
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()


@pytest.mark.parametrize("bad", [MAX_BLOCK_SIZE + 1, 10**9])
def test_block_size_beyond_the_maximum_is_refused_at_construction(bad):
    msg = rf"`block_size`={bad:,} is more than the largest block size, 65,536 tokens: .* leave it unset"
    with pytest.raises(ValueError, match=msg):
        BlockPool(block_size=bad)
    with pytest.raises(ValueError, match=msg):
        PagedCache(block_size=bad)


def test_largest_block_size_is_accepted():
    pool = BlockPool(block_size=MAX_BLOCK_SIZE, num_blocks=1)
    cache = PagedCache(pool=pool)
    k = torch.zeros(1, 1, 3, 2)
    cache.update(k, k, layer_idx=0)
    assert pool.stats().blocks_in_use == 1 and pool.stats().tokens_stored == 3
    cache.release()


def test_host_memory_beyond_the_ram_is_refused_at_construction(monkeypatch):
    monkeypatch.setattr(pool_settings, "host_memory_bytes", lambda: 8 * 2**30)
    with pytest.raises(ValueError, match=r"host_memory=1,099,511,627,776 bytes is more than this machine's memory "
                                         r"\(8,589,934,592 bytes\): the host tier .* lower host_memory\."):
        BlockPool(num_blocks=4, host_memory="1TiB")
    with pytest.raises(ValueError, match=rf"host_memory={10**30:,} bytes is more than this machine's memory"):
        PagedCache(host_memory=10**30)
    assert BlockPool(num_blocks=4, host_memory="8GiB").host.host_memory == 8 * 2**30  # all of it: accepted
