"""Bad input raises a clear exception, leaves the pool unchanged and leaks no block."""

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, CacheReleasedError, PagedCache, PoolExhaustedError
from tests.conftest import ids, tiny_model
from tests.fake_kv import kv, labels

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(pool: BlockPool):
    """Everything a failed call must leave as it was: stats, refcounts, the free set, every live table (per layer
    group)."""
    out = [pool.stats()]
    for group in pool.groups:
        alloc = group.allocator
        tables = [(list(r.blocks), r.num_tokens, r.num_dropped) for r in group.rows()]
        out.append(([alloc.refcount(b) for b in range(alloc.num_blocks)], alloc.free_blocks(), tables))
    return out


# -- settings -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "16"])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"`block_size` must be a positive int, got {bad!r}"):
        PagedCache(block_size=bad)
    with pytest.raises(ValueError, match=rf"`block_size` must be a positive int, got {bad!r}"):
        BlockPool(block_size=bad)


@pytest.mark.parametrize("bad", [0, -3, 1.5, False, "8"])
def test_num_blocks_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"`num_blocks` must be a positive int, got {bad!r}"):
        BlockPool(num_blocks=bad)
    with pytest.raises(ValueError, match=rf"`num_blocks` must be a positive int, got {bad!r}"):
        PagedCache(num_blocks=bad)


@pytest.mark.parametrize("bad, what", [("lots", "a size like"), ("4 parsecs", "a size like"), ("-1GB", "positive"),
                                       ("- 2 MiB", "positive"), (0, "positive"), (-5, "positive"), ("0MB", "positive"),
                                       (True, "a size like"), (4.5, "whole number"), ("0.5B", "whole number")])
def test_max_memory_must_be_a_size(bad, what):
    with pytest.raises(ValueError, match=f"`max_memory`.*{what}"):
        BlockPool(max_memory=bad)


def test_pool_size_settings_conflict():
    with pytest.raises(ValueError, match="`num_blocks` or `max_memory`, not both"):
        BlockPool(num_blocks=8, max_memory="1MiB")
    pool = BlockPool(block_size=8)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="set them on the BlockPool you pass"):
        PagedCache(pool=pool, num_blocks=4)
    with pytest.raises(ValueError, match="set them on the BlockPool you pass"):
        PagedCache(pool=pool, max_memory="1GiB")
    with pytest.raises(ValueError, match="block_size=4 differs from the pool's block_size=8"):
        PagedCache(pool=pool, block_size=4)
    with pytest.raises(ValueError, match="`pool` must be a hf_pagedkv.BlockPool, got dict"):
        PagedCache(pool={})
    assert snapshot(pool) == before
    PagedCache(pool=pool, block_size=8).release()  # the matching block size is fine


def test_max_memory_needs_the_number_of_layers():
    """`PagedCache(max_memory=...)` without `config` is refused when built, not at the first
    forward with an error naming a `pool` the user never made; a `BlockPool(max_memory=...)` passed without `config`
    still fails at the first update, before any block is taken."""
    with pytest.raises(ValueError, match=r"PagedCache\(config=model.config, max_memory='1MiB'\)"):
        PagedCache(max_memory="1MiB")
    cache = PagedCache(pool=BlockPool(max_memory="1MiB"))  # lazy: the layer count is unknown at the first update
    with pytest.raises(ValueError, match=r"PagedCache\(config=model.config, pool=pool\)"):
        cache.update(*kv(1, 0, 3, label=1), layer_idx=0)
    assert cache.pool.num_blocks == 0 and cache.pool.stats().blocks_in_use == 0
    cache.release()


def test_max_memory_below_one_block():
    model = tiny_model("llama")  # one block of 16 tokens is 12288 bytes
    cache = PagedCache(config=model.config, max_memory=12287)
    with pytest.raises(ValueError, match="less than one block"):
        model(ids(1, 4), past_key_values=cache)
    assert cache.pool.num_blocks == 0
    cache.release()


# -- a pool shared between different models ---------------------------------------------------------------------------
def _pool_with_one_llama_cache():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, debug=True)
    a = PagedCache(pool=pool, debug=True)
    x = ids(1, 9, seed=1)
    model(x, past_key_values=a)
    return model, pool, a, x


def _continues_exactly(model, cache: PagedCache, x: torch.Tensor) -> None:
    """The cache (holding `x`) still gives DynamicCache's next-token logits."""
    ref = DynamicCache()
    model(x, past_key_values=ref)
    nxt = ids(x.shape[0], 1, seed=99)
    want = model(nxt, past_key_values=ref).logits
    got = model(nxt, past_key_values=cache).logits
    assert torch.equal(got, want)


def test_pool_shared_with_a_model_of_other_layer_shapes():
    model, pool, a, x = _pool_with_one_llama_cache()
    before = snapshot(pool)
    b = PagedCache(pool=pool)
    # GPT-2 has 4 KV heads, the tiny Llama 2: refused at its first layer, before any block is taken.
    with pytest.raises(ValueError, match=r"layer 0 as \[num_kv_heads=2.*got \[num_kv_heads=4.*separate BlockPool"):
        tiny_model("gpt2")(x, past_key_values=b)
    pool.check_invariants()
    b.release()
    assert snapshot(pool) == before
    _continues_exactly(model, a, x)
    a.release()
    assert pool.stats().blocks_in_use == 0


def test_pool_shared_with_a_model_of_another_dtype():
    model, pool, a, x = _pool_with_one_llama_cache()
    before = snapshot(pool)
    double = copy.deepcopy(model).to(torch.float64)
    b = PagedCache(pool=pool)
    with pytest.raises(ValueError, match=r"holds layer 0 as .*float32.* but got .*float64"):
        double(x, past_key_values=b)
    pool.check_invariants()
    b.release()
    assert snapshot(pool) == before
    _continues_exactly(model, a, x)
    a.release()
    assert pool.stats().blocks_in_use == 0


def test_shape_mismatch_in_a_later_layer_is_refused_and_released_cleanly():
    pool = BlockPool(block_size=4, debug=True)
    a = PagedCache(pool=pool, debug=True)
    for layer in range(2):
        a.update(*kv(1, 0, 6, label=1), layer_idx=layer)
    before = snapshot(pool)
    b = PagedCache(pool=pool, debug=True)
    b.update(*kv(1, 0, 6, label=2), layer_idx=0)  # layer 0 matches the pool
    k, v = kv(1, 0, 6, label=2)
    with pytest.raises(ValueError, match="holds layer 1 as"):
        b.update(k.expand(1, 3, 6, 2), v.expand(1, 3, 6, 2), layer_idx=1)  # 3 KV heads instead of 1
    pool.check_invariants()
    # The interrupted step is not silently continued ...
    with pytest.raises(RuntimeError, match="interrupted a forward step"):
        b.update(*kv(1, 6, 1, label=3), layer_idx=1)
    # ... and releasing the cache gives the pool back exactly as it was.
    b.release()
    assert snapshot(pool) == before
    assert labels(a) == [[1] * 6]
    a.release()
    assert pool.stats().blocks_in_use == 0


def test_update_shapes_and_dtype_are_checked():
    cache = PagedCache(block_size=4)
    k, v = kv(1, 0, 3, label=1)
    with pytest.raises(ValueError, match="equal first three dims"):
        cache.update(k, v[:, :, :2], layer_idx=0)
    with pytest.raises(ValueError, match=r"\[batch, num_kv_heads, seq_len, head_dim\]"):
        cache.update(k[0], v[0], layer_idx=0)
    cache.update(k, v, layer_idx=0)
    before = snapshot(cache.pool)
    with pytest.raises(ValueError, match="Layer 0 was created for"):
        cache.update(*(t.double() for t in kv(1, 3, 1, label=2)), layer_idx=0)
    assert snapshot(cache.pool) == before
    cache.release()


# -- a fixed pool that is full ---------------------------------------------------------------------------------------
def test_full_pool_at_prefill_changes_nothing():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=6, debug=True)
    a = PagedCache(pool=pool, debug=True)
    model(ids(1, 9, seed=1), past_key_values=a)  # 3 blocks
    before = snapshot(pool)
    b = PagedCache(pool=pool, debug=True)
    with pytest.raises(PoolExhaustedError) as err:
        model.generate(ids(1, 14, seed=2), past_key_values=b, max_new_tokens=3)  # needs 4 blocks, 3 free
    msg = str(err.value)
    assert "4 blocks needed, 3 free of 6" in msg and "num_blocks" in msg and "max_memory" in msg
    stats, (refcounts, free, _) = snapshot(pool)
    assert (stats.blocks_in_use, stats.blocks_free, stats.tokens_stored) == (3, 3, 9)
    assert (refcounts, free) == before[1][:2]
    pool.check_invariants()
    b.release()
    assert snapshot(pool) == before
    a.release()
    assert pool.stats().blocks_in_use == 0 and pool.stats().blocks_free == 6


def test_full_pool_mid_decode_keeps_the_last_complete_step():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=4, debug=True)
    cache = PagedCache(pool=pool, debug=True, config=model.config)
    x = ids(1, 10, seed=5)
    # 10 prompt tokens + 6 decoded fit in 4 blocks; the forward of token 16 needs a 5th block.
    with pytest.raises(PoolExhaustedError, match="1 block needed, 0 free of 4"):
        model.generate(x, past_key_values=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    pool.check_invariants()
    assert cache.get_seq_length() == 16 and cache.block_tables() == [[0, 1, 2, 3]]
    # The cache holds exactly what DynamicCache holds after the same 16 tokens.
    ref = DynamicCache(config=model.config)
    model.generate(x, past_key_values=ref, max_new_tokens=7, min_new_tokens=7, do_sample=False)
    for layer in range(3):
        assert torch.equal(cache.layers[layer].keys, ref.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, ref.layers[layer].values)
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_full_pool_after_expanding_rows_changes_nothing():
    """A step that first expands 1 row into 3 (generate with num_return_sequences on a pre-filled cache) and then
    finds the pool full must leave the cache and the pool as before: 1 row, refcounts 1."""
    pool = BlockPool(block_size=4, num_blocks=3)
    cache = PagedCache(pool=pool)
    cache.update(*kv(1, 0, 6, label=1), layer_idx=0)
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match="5 blocks needed, 1 free of 3"):
        cache.update(*kv(3, 6, 3, label=5), layer_idx=0)  # 3 rows x 1 new block + 2 copies-on-write
    pool.check_invariants()
    assert cache.num_rows == 1 and snapshot(pool) == before
    # The caller can go on with the batch it had.
    cache.update(*kv(1, 6, 1, label=7), layer_idx=0)
    assert labels(cache) == [[1] * 6 + [7]]
    cache.release()


# -- a released cache ----------------------------------------------------------------------------------------------
def test_released_cache_refuses_use():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, debug=True)
    other = PagedCache(pool=pool, debug=True)
    model(ids(1, 6, seed=1), past_key_values=other)
    with PagedCache(pool=pool, debug=True) as cache:
        model.generate(ids(2, 7), past_key_values=cache, max_new_tokens=3, do_sample=False)
        assert pool.stats().blocks_in_use == 2 + 2 * 3
    # Leaving the `with` block released it.
    before = snapshot(pool)
    assert before[0].blocks_in_use == 2
    with pytest.raises(CacheReleasedError, match="was released"):
        model.generate(ids(2, 7), past_key_values=cache, max_new_tokens=3)
    with pytest.raises(CacheReleasedError):
        cache.update(*kv(1, 0, 1, label=1), layer_idx=0)
    with pytest.raises(CacheReleasedError):
        cache.fork()
    with pytest.raises(CacheReleasedError):
        cache.reorder_cache(torch.tensor([0, 0]))
    with pytest.raises(CacheReleasedError):
        cache.batch_repeat_interleave(2)
    cache.release()  # idempotent
    assert snapshot(pool) == before
    pool.check_invariants()
    other.release()
    assert pool.stats().blocks_in_use == 0


RELEASED_CACHE_CALLS = {
    "forward": lambda cache, model: model(ids(1, 5), past_key_values=cache),
    "generate": lambda cache, model: model.generate(ids(1, 5), past_key_values=cache, max_new_tokens=2),
    "update": lambda cache, model: cache.update(*kv(1, 0, 3, label=1), layer_idx=0),
    "fork": lambda cache, model: cache.fork(),
    "deepcopy": lambda cache, model: copy.deepcopy(cache),
    "copy": lambda cache, model: copy.copy(cache),
    "crop": lambda cache, model: cache.crop(-1),
    "crop(0)": lambda cache, model: cache.crop(0),
    "reorder_cache": lambda cache, model: cache.reorder_cache(torch.tensor([0, 0])),
    "reorder_cache(identity)": lambda cache, model: cache.reorder_cache(torch.tensor([], dtype=torch.long)),
    "batch_select_indices": lambda cache, model: cache.batch_select_indices(torch.tensor([0])),
    "batch_repeat_interleave": lambda cache, model: cache.batch_repeat_interleave(2),
    "set_padding": lambda cache, model: cache.set_padding(torch.ones(1, 5, dtype=torch.long)),
    "publish": lambda cache, model: cache.publish([[3, 4, 5, 6]], model=model),
    "offload": lambda cache, model: cache.offload(),
    "prefetch": lambda cache, model: cache.prefetch(),
    "get_seq_length": lambda cache, model: cache.get_seq_length(),
}


@pytest.mark.parametrize("call", list(RELEASED_CACHE_CALLS))
@pytest.mark.parametrize("built", ["lazy", "config", "retention", "quant"])
def test_cache_released_before_its_first_use_refuses_every_entry_point(call, built):
    """A cache released before it ever stored a token raises CacheReleasedError at each entry point, whether its
    layers are built lazily at the first update (no config) or up front; the pool stays empty and usable."""
    from hf_pagedkv.retention import SinkWindow

    model = tiny_model("llama")
    pool = BlockPool(block_size=4, debug=True, quant="k8v4" if built == "quant" else None,
                     prefix_caching=True)
    kwargs = {"lazy": {}, "config": {"config": model.config},
              "retention": {"retention": SinkWindow(sink_tokens=4, window=8)}, "quant": {}}[built]
    cache = PagedCache(pool=pool, debug=True, **kwargs)
    cache.release()
    with pytest.raises(CacheReleasedError, match="was released"):
        RELEASED_CACHE_CALLS[call](cache, model)
    # what a released cache still answers: it holds nothing
    assert cache.block_tables() == [] and "released" in repr(cache)
    cache.reset()  # a no-op: it stays released
    cache.release()  # idempotent
    with pytest.raises(CacheReleasedError):
        cache.update(*kv(1, 0, 3, label=1), layer_idx=0)
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()
    with PagedCache(pool=pool, **kwargs) as fresh:  # the pool serves the next cache
        model(ids(1, 5), past_key_values=fresh)
        assert fresh.get_seq_length() == 5
    assert pool.stats().blocks_in_use == 0


# -- cache operations with bad arguments -------------------------------------------------------------------------------
def test_crop_with_a_positive_value():
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(1, 0, 6, label=1), layer_idx=0)
    before = snapshot(cache.pool)
    with pytest.raises(ValueError, match=r"crop\(3\): pass a negative number"):
        cache.crop(3)
    assert snapshot(cache.pool) == before and cache.get_seq_length() == 6
    cache.crop(0)  # a no-op, as in DynamicCache
    assert snapshot(cache.pool) == before
    cache.release()


@pytest.mark.parametrize("bad", ["3", 2.0, None, True])
def test_crop_with_a_value_that_is_not_an_int(bad):
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(1, 0, 6, label=1), layer_idx=0)
    before = snapshot(cache.pool)
    with pytest.raises(ValueError, match=r"crop\(.*\): pass an int"):
        cache.crop(bad)
    assert snapshot(cache.pool) == before and cache.get_seq_length() == 6
    cache.release()


@pytest.mark.parametrize("bad", ["x", 3, {"num_hidden_layers": 2}])
def test_config_must_be_a_transformers_config(bad):
    with pytest.raises(ValueError, match="`config` must be the model's transformers config"):
        PagedCache(config=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_debug_must_be_a_bool_with_or_without_a_pool(bad):
    pool = BlockPool(block_size=4)
    with pytest.raises(ValueError, match="`debug` must be True or False"):
        PagedCache(pool=pool, debug=bad)
    with pytest.raises(ValueError, match="`debug` must be True or False"):
        PagedCache(debug=bad)
    assert not pool.debug and pool.stats().blocks_in_use == 0


def test_reorder_with_out_of_range_rows():
    cache = PagedCache(block_size=4, debug=True)
    cache.update(*kv(2, 0, 6, label=1), layer_idx=0)
    before = snapshot(cache.pool)
    with pytest.raises(ValueError, match="out of range for a cache of 2 rows"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="out of range"):
        cache.batch_select_indices(torch.tensor([-1]))
    assert snapshot(cache.pool) == before
    assert labels(cache) == [[1] * 6, [2] * 6]
    cache.release()


@pytest.mark.parametrize("idx", [[0], [0, 1, 1], [2, 2, 0, 1], []])
def test_reorder_to_another_number_of_rows_keeps_refcounts(idx):
    """`reorder_cache` with an index of another length (DynamicCache allows it) on rows sharing their leading blocks
    (identical prompts): rows and refcounts follow the index exactly, and releasing frees everything."""
    model = tiny_model("llama")
    x = ids(1, 10, seed=2).repeat(3, 1)  # identical rows: shared blocks
    cache = PagedCache(block_size=4, debug=True)
    ref = DynamicCache()
    model(x, past_key_values=cache), model(x, past_key_values=ref)
    cache.reorder_cache(torch.tensor(idx, dtype=torch.long))
    ref.reorder_cache(torch.tensor(idx, dtype=torch.long))
    cache.pool.check_invariants()
    assert len(cache.rows.first_group) == len(idx)
    if idx:
        assert torch.equal(cache.layers[1].keys, ref.layers[1].keys)
        y = ids(len(idx), 1, seed=3)
        torch.testing.assert_close(model(y, past_key_values=cache).logits, model(y, past_key_values=ref).logits,
                                   rtol=0, atol=1e-6)
        cache.pool.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0
    cache.pool.check_invariants()


def test_batch_mismatch():
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, debug=True)
    ref = DynamicCache()
    x = ids(2, 6, seed=3)
    model(x, past_key_values=cache), model(x, past_key_values=ref)
    before = snapshot(cache.pool)
    # 3 is neither the 2 rows held nor a multiple of them.
    with pytest.raises(ValueError, match="holds 2 rows of 6 tokens but got a batch of 3"):
        model(ids(3, 1), past_key_values=cache)
    assert snapshot(cache.pool) == before
    cache.pool.check_invariants()
    # The cache goes on with its own batch, exactly.
    nxt = ids(2, 1, seed=4)
    assert torch.equal(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=ref).logits)
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_max_memory_beyond_the_device_is_refused_before_allocating():
    cfg = tiny_model("llama").config
    pool = BlockPool(max_memory="10TB")
    cache = PagedCache(pool=pool, config=cfg)
    k = torch.zeros(1, cfg.num_key_value_heads, 3, cfg.head_dim)
    with pytest.raises(ValueError, match=r"max_memory=10000000000000 bytes is more than cpu has .* Lower max_memory"):
        cache.update(k, k, 0)
    assert pool.num_blocks == 0 and pool.stats().blocks_in_use == 0
    cache.release()


def test_odd_row_operations_and_layer_indices_are_refused_with_the_cache_unchanged():
    """From a fresh-user trial: negative repeats, float beam indices, a layer index past the config's layers,
    and a crop after release() get clear errors (DynamicCache raises for the first three too)."""
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, config=model.config, debug=True)
    model(ids(2, 9, seed=3), past_key_values=cache)
    before = (cache.block_tables(), cache.get_seq_length(), cache.pool.stats())
    with pytest.raises(ValueError, match="repeats must be a non-negative int, got -1"):
        cache.batch_repeat_interleave(-1)
    with pytest.raises(ValueError, match="beam_idx must hold integer row indices"):
        cache.reorder_cache(torch.tensor([0.0, 1.0]))
    k = torch.zeros(2, 2, 1, 16)
    with pytest.raises(IndexError, match="layer_idx=99 is out of range: this PagedCache was built for 3 layers"):
        cache.update(k, k, 99)
    with pytest.raises(IndexError, match="layer_idx=-1 is out of range"):
        cache.update(k, k, -1)
    assert (cache.block_tables(), cache.get_seq_length(), cache.pool.stats()) == before and len(cache.layers) == 3
    cache.pool.check_invariants()
    cache.release()
    with pytest.raises(CacheReleasedError):
        cache.crop(-1)
    assert cache.pool.stats().blocks_in_use == 0
