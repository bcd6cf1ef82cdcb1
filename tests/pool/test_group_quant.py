"""`BlockPool(quant=...)` per kind of layer group (`GroupQuant`): what it accepts, what it refuses, and the block
size it picks."""

import pytest

from hf_pagedkv import BlockPool, PagedCache, QuantConfig
from hf_pagedkv.pool.group_quant import GroupQuant


def test_a_dict_gives_each_kind_its_format_and_a_left_out_kind_is_full_precision():
    pool = BlockPool(quant={"sliding": None, "full": "k4v4"})
    assert pool.quant == GroupQuant(sliding=QuantConfig(), full=QuantConfig(key_bits=4, value_bits=4))
    assert pool.quant.name == "sliding=fp,full=k4v4" and pool.quant.is_quantized
    assert pool.block_size == 32  # one block size for the pool: a quantized group's default
    assert pool.groups[0].is_quantized  # group 0 is full attention
    assert BlockPool(quant={"full": "k8v4"}).quant == GroupQuant(QuantConfig(), QuantConfig.preset("k8v4"))
    assert BlockPool(quant={"sliding": "k8v8"}).quant.for_window(4096) == QuantConfig.preset("k8v8")


def test_a_dict_of_one_format_is_that_format():
    assert BlockPool(quant={"sliding": "k8v4", "full": QuantConfig(8, 4)}).quant == QuantConfig.preset("k8v4")
    pool = BlockPool(quant={"sliding": "fp", "full": None})
    assert pool.quant == QuantConfig() and pool.block_size == 16  # all full precision: the fp default


@pytest.mark.parametrize("quant, match", [
    ({"slidng": None, "full": "k4v4"}, "unknown layer-group key 'slidng'; the keys are 'sliding', 'full'"),
    ({"layers": {0: "k8v8"}}, "per-layer formats \\('layers'\\) are not supported .* keys 'sliding', 'full'"),
    ({"full": "k5v5"}, r"quant\['full'\]='k5v5': give None .*Unknown quantization preset"),
    ({"sliding": 4}, r"quant\['sliding'\]=4: give None"),
    ({"full": ["k4v4"]}, r"quant\['full'\]=\['k4v4'\]"),
    ([("full", "k4v4")], "`quant` must be None, a preset name"),
])
def test_bad_input_names_the_key_and_what_is_accepted(quant, match):
    with pytest.raises(ValueError, match=match):
        BlockPool(quant=quant)
    with pytest.raises(ValueError, match=match):
        PagedCache(quant=quant)


def test_paged_cache_forwards_it_and_refuses_another_pools_formats():
    cache = PagedCache(quant={"full": "k4v4"})
    assert cache.pool.quant == GroupQuant(QuantConfig(), QuantConfig.preset("k4v4")) and cache.block_size == 32
    assert PagedCache(pool=cache.pool, quant={"sliding": "fp", "full": "k4v4"}).pool is cache.pool
    with pytest.raises(ValueError, match="differs from the pool's quant=sliding=fp,full=k4v4"):
        PagedCache(pool=cache.pool, quant="k4v4")
    with pytest.raises(ValueError, match="differs from the pool's quant=k4v4"):
        PagedCache(pool=BlockPool(quant="k4v4"), quant={"full": "k4v4"})
