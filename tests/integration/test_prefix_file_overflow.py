"""Loading a prefix-cache file with more blocks than the device tier can take: the rest goes to the host tier, and a
hit on those blocks is exact."""

import pytest
import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, cache_kwargs
from tests.conftest import ids, tiny_model
from tests.integration.test_prefix_file import FRESH_TOL, QUANTS, block_size, max_diff, quantized_reference, serve
from tests.prefix_utils import GEN, fresh_generate, tiny_single_thread  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("quant", QUANTS)
def test_overflow_goes_to_the_host_tier_and_a_hit_on_it_is_exact(tmp_path, arch, quant):
    model, B = tiny_model(arch), block_size(quant)
    system = ids(1, 6 * B, seed=1)  # a 6-block system prompt
    path = tmp_path / "prefix.safetensors"
    saved_pool = serve(model, quant, torch.cat([system, ids(1, 3, seed=2)], 1))
    saved_pool.save_prefix_cache(path)
    n_full = len(saved_pool.groups[0].prefix_index.published())  # the full-attention group's blocks in the file
    assert n_full == 6 + (3 + GEN["max_new_tokens"]) // B  # the system blocks + those of its suffix and new tokens

    pool = BlockPool(block_size=B, num_blocks=16, prefix_caching=True, host_memory="1MiB", quant=quant, debug=True)
    hog = PagedCache(pool=pool, config=model.config)
    with torch.no_grad():
        model(ids(1, 13 * B, seed=3), **cache_kwargs(hog))  # 13 of the 16 full-attention blocks
    pool.check_invariants()
    pool.load_prefix_cache(path, model=model)
    pool.check_invariants()
    assert pool.last_loaded_blocks == sum(len(g.prefix_index.published()) for g in saved_pool.groups)  # none dropped
    full_tier = pool.host.tiers[0][0]
    # the 3 free device blocks take the 3 shortest prefixes, the host tier the others
    assert (pool.groups[0].allocator.num_idle_blocks, full_tier.num_cached_blocks) == (3, n_full - 3)
    st = pool.stats()
    if quant is None and arch == "llama":  # loaded, not demoted: bytes, no block moved
        assert (st.blocks_to_host, st.bytes_to_host) == (0, (n_full - 3) * st.bytes_per_block)
    hog.release()
    pool.check_invariants()

    y = torch.cat([system, ids(1, 5, seed=4)], 1)  # hits the 6 system blocks: 3 on the device, 3 on the host
    out = hf_pagedkv.generate(model, y, pool=pool, **GEN)
    pool.check_invariants()
    assert pool.stats().hit_tokens == 6 * B
    assert pool.host.stats().blocks_promoted >= 3
    ref = fresh_generate(model, y) if quant is None else quantized_reference(model, quant, y, 6 * B)
    assert torch.equal(ref.sequences, out.sequences)
    assert max_diff(ref, out) <= FRESH_TOL
    assert pool.stats().blocks_in_use == 0


def test_overflow_without_room_in_the_host_tier_loads_nothing(tmp_path):
    model, B = tiny_model("llama"), 4
    path = tmp_path / "prefix.safetensors"
    serve(model, None, ids(1, 6 * B + 1, seed=1)).save_prefix_cache(path)  # 25 + 6 new tokens: 7 blocks
    for host_memory, match in ((None, "a host tier"), (2 * 3072, "host tier room for 2")):
        pool = BlockPool(block_size=B, num_blocks=4, prefix_caching=True, host_memory=host_memory, debug=True)
        with pytest.raises(PoolExhaustedError, match=match):
            pool.load_prefix_cache(path, model=model)
        pool.check_invariants()
        st = pool.stats()
        assert (st.blocks_cached, st.blocks_in_use, st.host_blocks_cached, st.bytes_to_host) == (0, 0, 0, 0)
    # with room for the 3 the device cannot take (a block is 3 KiB), all 7 are loaded
    pool = BlockPool(block_size=B, num_blocks=4, prefix_caching=True, host_memory=3 * 3072, debug=True)
    pool.load_prefix_cache(path, model=model)
    pool.check_invariants()
    assert pool.last_loaded_blocks == 7 and (pool.stats().blocks_cached, pool.stats().host_blocks_cached) == (4, 3)
