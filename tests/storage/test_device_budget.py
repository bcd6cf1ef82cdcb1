"""`max_memory` across devices (`device_map`): each layer's blocks on its own device, each device's share checked.

No second device is needed: the sizing functions take the devices' memory as a function, and a real `PagedCache`
spreads its layers over ``cpu`` and ``meta`` (a device that allocates no memory) as `device_map` spreads them
over GPUs. `tests/integration/test_device_map.py` runs the same on two CUDA devices where there are two.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.pool import layer_registry
from hf_pagedkv.storage.device_budget import blocks_for_budget, check_device_share, device_shares
from hf_pagedkv.storage.page_store import LayerSpec

GB = 10**9
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
B = 16


def spec(device: torch.device, heads: int = 8) -> LayerSpec:
    return LayerSpec(num_kv_heads=heads, key_dim=128, value_dim=128, dtype=torch.float16, device=device)


def block_bytes(s: LayerSpec) -> int:
    return s.bytes_per_token * B  # 8 heads x 256 x 2 B x 16 tokens = 65,536 bytes


def memory_of(sizes: dict):
    return lambda device: sizes.get(device)


def test_device_shares_count_each_layer_on_its_own_device():
    specs = [spec(CUDA0), spec(CUDA1), spec(CUDA1), spec(CUDA1, heads=4)]
    assert block_bytes(specs[0]) == 65_536
    assert device_shares(specs, block_bytes, 10) == {CUDA0: 655_360, CUDA1: 10 * (65_536 * 2 + 32_768)}
    assert device_shares([], block_bytes, 10) == {}


def test_budget_may_exceed_one_device_when_the_layers_are_spread(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    sizes = memory_of({CUDA0: 80 * GB, CUDA1: 80 * GB})
    # 150 GB over two 80 GB devices: more than one device has (a check against layer 0's device alone would refuse
    # it); the pool is sized over both: 150e9 // (65,536 x 3 layers) blocks
    assert blocks_for_budget(150 * GB, spec(CUDA0), 3, block_bytes, sizes) == 150 * GB // (65_536 * 3) == 762_939
    with pytest.raises(ValueError, match=r"max_memory=170000000000 bytes is more than the 2 cuda devices have "
                                         r"together \(160000000000 bytes in all\)"):
        blocks_for_budget(170 * GB, spec(CUDA0), 3, block_bytes, sizes)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"max_memory=90000000000 bytes is more than cuda:0 has \(80000000000 bytes"):
        blocks_for_budget(90 * GB, spec(CUDA0), 3, block_bytes, sizes)


def test_a_device_holding_too_many_layers_is_refused_with_its_share():
    sizes = memory_of({CUDA0: 80 * GB, CUDA1: 80 * GB})
    n = 150 * GB // (65_536 * 3)  # 762,939 blocks: 50 GB per layer
    layers = [spec(CUDA0), spec(CUDA1), spec(CUDA1)]
    check_device_share(0, layers[0], [], block_bytes, n, 150 * GB, sizes)  # 50 GB on cuda:0
    check_device_share(1, layers[1], layers[:1], block_bytes, n, 150 * GB, sizes)  # 50 GB on cuda:1
    with pytest.raises(ValueError) as e:  # 100 GB on cuda:1
        check_device_share(2, layers[2], layers[:2], block_bytes, n, 150 * GB, sizes)
    msg = str(e.value)
    assert f"would hold {2 * n * 65_536} bytes on cuda:1 once layer 2 is stored there (2 layers x {n} blocks)" in msg
    assert "more than cuda:1 has (80000000000 bytes in all)" in msg
    assert "budget of all layers on all devices together" in msg and "device_map" in msg
    # a device whose memory is unknown is not checked
    check_device_share(2, layers[2], layers[:2], block_bytes, n, 150 * GB, memory_of({}))


def test_paged_cache_stores_each_layer_on_its_device_and_checks_its_share(monkeypatch):
    """Layer 0 on the CPU, layers 1 and 2 on `meta`: the pool holds each layer's blocks where its K/V are."""
    cfg = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                      vocab_size=96)  # head_dim 16
    per_layer_block = 2 * (16 + 16) * 4 * 4  # heads x (key_dim + value_dim) x fp32 x 4 tokens = 1024 bytes
    budget = 100 * per_layer_block * 3  # 100 blocks of all 3 layers
    devices = [torch.device("cpu"), torch.device("meta"), torch.device("meta")]
    k = torch.randn(2, 2, 5, 16)

    # meta has room for exactly its share, 100 blocks x 2 layers (the CPU, layer 0's device type, for the whole
    # budget, as the fail-fast check of blocks_for_budget wants)
    monkeypatch.setattr(layer_registry, "device_memory", memory_of({devices[0]: budget, devices[1]: 200 * per_layer_block}))
    cache = PagedCache(config=cfg, block_size=4, max_memory=budget, debug=True)
    for i, d in enumerate(devices):
        keys, values = cache.update(k.to(d), k.to(d), i)
        assert keys.device == values.device == d and keys.shape == (2, 2, 5, 16)
    pool = cache.pool
    assert pool.num_blocks == 100
    assert {i: t.device for i, t in pool.groups[0].store.keys.items()} == dict(enumerate(devices))
    assert {i: t.device for i, t in pool.groups[0].store.values.items()} == dict(enumerate(devices))
    assert device_shares(pool.groups[0].store.specs.values(), pool.groups[0].store.block_bytes, pool.num_blocks) == {
        devices[0]: 100 * per_layer_block, devices[1]: 200 * per_layer_block}
    assert torch.equal(cache.update(k[:, :, :1], k[:, :, :1], 0)[0][:, :, :5], k)  # the CPU layer reads back exact
    cache.release()

    # one block less on meta: layer 2 is refused before its storage exists, layers 0 and 1 are untouched
    monkeypatch.setattr(layer_registry, "device_memory", memory_of({devices[0]: budget,
                                                                devices[1]: 200 * per_layer_block - 1}))
    cache = PagedCache(config=cfg, block_size=4, max_memory=budget)
    cache.update(k, k, 0)
    cache.update(k.to("meta"), k.to("meta"), 1)
    with pytest.raises(ValueError, match=r"would hold 204800 bytes on meta once layer 2 is stored there \(2 layers x "
                                         r"100 blocks\), more than meta has \(204799 bytes in all\)"):
        cache.update(k.to("meta"), k.to("meta"), 2)
    assert sorted(cache.pool.groups[0].store.specs) == [0, 1] and cache.pool.num_blocks == 100
    cache.release()


def test_max_memory_on_one_device_is_refused_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(layer_registry, "device_memory", memory_of({torch.device("cpu"): 10**6}))
    pool = BlockPool(block_size=4, max_memory=10**6 + 1)
    cache = PagedCache(pool=pool, config=LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, hidden_size=64, vocab_size=96))
    with pytest.raises(ValueError, match=r"max_memory=1000001 bytes is more than cpu has \(1000000 bytes in all\)"):
        cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    assert pool.num_blocks == 0 and not pool.groups[0].store.specs
    cache.release()
