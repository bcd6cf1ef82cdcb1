"""Padding costs nothing: whole blocks of left padding name the pool's one pad block (`set_padding`).

First a story with fake K/V (exact block ids, refcounts, fills), then the cache-wide operations on padded rows
(fork, beam reorder, crop into the padding, offload, compaction, publish), then `generate()` on tiny models against
`DynamicCache` (fp32: bit-identical tokens and logits) and against a quantized cache that stores its padding (the
same bits), greedy, beams and `num_return_sequences`, full attention and sliding windows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import SinkWindow
from hf_pagedkv.errors import InvariantError
from tests.adapter.test_equivalence import left_padded
from tests.conftest import tiny_model
from tests.fake_kv import kv

pytestmark = pytest.mark.usefixtures("one_thread")

B = 4


def padded_mask(padding: list[int], width: int) -> torch.Tensor:
    """A left-padding attention mask `[len(padding), width]`: row `r` starts with `padding[r]` zeros."""
    mask = torch.ones((len(padding), width), dtype=torch.long)
    for r, p in enumerate(padding):
        mask[r, :p] = 0
    return mask


def prefill(padding: list[int], width: int = 12, pool: BlockPool | None = None, **kwargs) -> PagedCache:
    cache = PagedCache(block_size=B, pool=pool, debug=True, **kwargs)
    cache.set_padding(padding_mask := padded_mask(padding, width))
    assert padding_mask.shape == (len(padding), width)
    cache.update(*kv(len(padding), 0, width, 1.0), 0)
    cache.check_invariants()
    return cache


# -- the story ---------------------------------------------------------------------------------------------------
def test_whole_blocks_of_left_padding_name_one_pad_block():
    # rows of 12 tokens: 9, 4 and 0 tokens of padding; B = 4
    cache = prefill([9, 4, 0])
    pool = cache.pool
    pad = pool.groups[0].pad_block
    # the pad block is reserved first (block 0); row 0's padding covers blocks 0-1 wholly, row 1's block 0; the
    # block of each row's first real token (row 0: tokens 8-11, with padding token 8) is stored normally
    assert pad == 0
    assert cache.block_tables() == [[0, 0, 1], [0, 2, 3], [4, 5, 6]]
    assert pool.groups[0].allocator.refcount(pad) == 3 + 1  # three table entries and the pool's own reference
    stats = pool.stats()
    assert stats.blocks_in_use == 7  # 6 blocks of the rows + the pad block, counted once
    assert stats.tokens_stored == 6 * B  # the pad block holds no token
    assert stats.bytes_in_use == 7 * stats.bytes_per_block
    assert cache.get_seq_length() == 12  # padding still counts, as with DynamicCache
    # reads: stored tokens as written, zeros where the pad block stands
    k, v = cache.layers[0].keys, cache.layers[0].values  # [3, 1, 12, 2]
    want_k, want_v = kv(3, 0, 12, 1.0)
    for r, p in enumerate([8, 4, 0]):  # positions before p are in the pad block
        assert torch.equal(k[r, :, p:], want_k[r, :, p:]) and torch.equal(v[r, :, p:], want_v[r, :, p:])
        assert not k[r, :, :p].any() and not v[r, :, :p].any()
    # a decode step writes every row normally
    cache.update(*kv(3, 12, 1, 1.0), 0)
    cache.check_invariants()
    assert [t[-1] for t in cache.block_tables()] == [7, 8, 9]
    assert pool.groups[0].allocator.refcount(pad) == 4
    cache.release()
    pool.check_invariants()
    # the pad block is never freed: it stays the pool's, with no table naming it
    assert pool.stats().blocks_in_use == 1 and pool.groups[0].allocator.refcount(pad) == 1


def test_the_pad_block_is_never_written_and_a_write_into_it_is_caught():
    cache = prefill([8, 0])
    pool = cache.pool
    pad = pool.groups[0].pad_block
    store = pool.groups[0].store
    assert not store.keys[0].index_select(1, store.block_slots([pad], torch.device("cpu"))).any()
    pool.groups[0].store.keys[0].index_fill_(1, torch.tensor([pad * B + 1]), 1.0)  # a stray write
    with pytest.raises(InvariantError, match="invariant 10"):
        pool.check_invariants()


def test_forks_and_beam_reorders_share_the_pad_block():
    cache = prefill([9, 4, 0])
    pool, pad = cache.pool, cache.pool.groups[0].pad_block
    other = cache.fork()
    assert pool.groups[0].allocator.refcount(pad) == 2 * 3 + 1
    cache.reorder_cache(torch.tensor([0, 0, 2]))  # row 1 (one pad entry) becomes a copy of row 0 (two)
    pool.check_invariants()
    assert cache.block_tables()[:2] == [[0, 0, 1]] * 2
    assert pool.groups[0].allocator.refcount(pad) == 3 + 4 + 1
    cache.batch_select_indices(torch.tensor([2]))
    other.release()
    pool.check_invariants()
    assert pool.groups[0].allocator.refcount(pad) == 1
    cache.release()


def test_crop_into_the_padding_copies_the_pad_block_before_a_write():
    cache = prefill([9, 0])
    pool, pad = cache.pool, cache.pool.groups[0].pad_block
    cache.crop(-6)  # 6 tokens left: row 0 ends inside its second pad block
    assert cache.block_tables() == [[0, 0], [2, 3]]
    cache.check_invariants()
    cache.update(*kv(2, 6, 3, 5.0), 0)  # real tokens at positions 6-8: the pad block is copied, then written
    cache.check_invariants()
    tables = cache.block_tables()
    assert tables[0][0] == pad and tables[0][1] != pad
    k = cache.layers[0].keys  # [2, 1, 9, 2]
    assert torch.equal(k[0, 0, 6:, 0], torch.full((3,), 5.0)) and not k[0, :, :6].any()
    assert pool.groups[0].allocator.refcount(pad) == 2
    cache.release()


def test_a_chunked_prefill_names_the_pad_block_only_in_a_leading_run():
    cache = PagedCache(block_size=B, debug=True)
    cache.set_padding(padded_mask([13, 0], 16))
    cache.update(*kv(2, 0, 6, 1.0), 0)  # tokens 0-5: block 0 is padding, block 1 (4-7) is only half written
    cache.check_invariants()
    cache.update(*kv(2, 6, 10, 1.0), 0)  # tokens 6-15: block 2 (8-11) is padding, but follows a stored block
    cache.check_invariants()
    pad = cache.pool.groups[0].pad_block
    assert cache.block_tables()[0][0] == pad and pad not in cache.block_tables()[0][1:]
    k = cache.layers[0].keys  # [2, 1, 16, 2]
    want, _ = kv(2, 0, 16, 1.0)
    assert torch.equal(k[:, :, 4:], want[:, :, 4:]) and torch.equal(k[1], want[1]) and not k[0, :, :4].any()
    cache.release()


def test_padding_expands_with_the_rows_generate_repeats():
    cache = PagedCache(block_size=B, debug=True)
    cache.set_padding(padded_mask([8, 0], 12))
    cache.update(*kv(4, 0, 12, 1.0), 0)  # num_return_sequences=2: rows 0, 0, 1, 1
    assert cache.block_tables() == [[0, 0, 1], [0, 0, 2], [3, 4, 5], [6, 7, 8]]
    cache.check_invariants()
    cache.release()


@pytest.mark.parametrize("mask, match", [
    (torch.ones(4), r"\[batch, seq_len\]"),
    (torch.tensor([[1, 0, 1]]), "left padding"),
    (torch.tensor([[0, 0, 0]]), "left padding"),
    (torch.tensor([[0, 2, 1]]), "0s and 1s"),
    (None, "attention_mask=None"),
    ("0011", "attention_mask='0011'"),
])
def test_bad_masks_are_refused(mask, match):
    cache = PagedCache(block_size=B)
    with pytest.raises(ValueError, match=match):
        cache.set_padding(mask)
    cache.update(*kv(1, 0, 3, 1.0), 0)
    with pytest.raises(ValueError, match="already holds"):
        cache.set_padding(torch.ones((1, 3)))
    cache.release()


def test_a_batch_that_is_not_the_masks_rows_is_refused_before_anything_changes():
    cache = PagedCache(block_size=B, debug=True)
    cache.set_padding(padded_mask([8, 0], 12))
    with pytest.raises(ValueError, match="batch of 3"):
        cache.update(*kv(3, 0, 12, 1.0), 0)
    assert cache.pool.stats().blocks_in_use == 0
    cache.release()


def test_padding_is_never_published():
    pool = BlockPool(block_size=B, prefix_caching=True, debug=True)
    model = tiny_model("llama")
    x, mask = left_padded([12, 4], seed=3)
    cache = PagedCache(pool=pool, config=model.config, debug=True)
    cache.set_padding(mask)
    with torch.no_grad():
        model(x, attention_mask=mask, **cache_kwargs(cache))
    assert cache.publish(x, model=model) == 12 // B  # row 0 (no padding): its full blocks
    # row 1 names the pad block and publishes nothing
    assert pool.groups[0].pad_block not in pool.groups[0].prefix_index
    pool.check_invariants()
    cache.release()


def test_offload_leaves_the_pad_block_on_the_device():
    pool = BlockPool(block_size=B, host_memory="1MiB", debug=True)
    cache = prefill([9, 0], pool=pool)
    before = cache.layers[0].keys.clone()
    pad = pool.groups[0].pad_block
    cache.offload()
    assert pool.groups[0].allocator.refcount(pad) == 1
    assert pool.host.stats().blocks_in_use == 1 + 3  # row 0's real block, row 1's three
    cache.prefetch()
    cache.check_invariants()
    assert cache.block_tables()[0][:2] == [pad, pad]
    assert torch.equal(cache.layers[0].keys, before)
    cache.release()


def test_compaction_moves_the_pad_block_with_its_name():
    pool = BlockPool(block_size=B, debug=True)
    filler = PagedCache(block_size=B, pool=pool)
    filler.update(*kv(1, 0, 4 * B, 9.0), 0)  # blocks 0-3
    cache = prefill([9], pool=pool)
    before = cache.layers[0].keys.clone()
    assert pool.groups[0].pad_block == 4 and cache.block_tables() == [[4, 4, 5]]
    filler.release()
    assert pool.compact(max_blocks=64) == 2  # 5 -> 0, then the pad block 4 -> 1
    pool.check_invariants()
    assert pool.groups[0].pad_block == 1 and cache.block_tables() == [[1, 1, 0]]
    assert torch.equal(cache.layers[0].keys, before)
    cache.release()


def test_retention_ignores_the_padding():
    cache = PagedCache(block_size=B, debug=True, retention=SinkWindow(sink_tokens=B, window=2 * B))
    cache.set_padding(padded_mask([8, 0], 12))
    cache.update(*kv(2, 0, 12, 1.0), 0)
    assert cache.pool.groups[0].pad_block is None and cache.pool.stats().blocks_in_use == 6
    cache.release()


# -- generate() ----------------------------------------------------------------------------------------------------
def _generate(model, x, mask, cache, seed, **kw):
    torch.manual_seed(seed)
    return model.generate(x, attention_mask=mask, **cache_kwargs(cache), return_dict_in_generate=True,
                          output_logits=True, max_new_tokens=8, **kw)


def _assert_bit_identical(out, ref):
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    if getattr(ref, "sequences_scores", None) is not None:
        assert torch.equal(out.sequences_scores, ref.sequences_scores)


MODES = {
    "greedy": {"do_sample": False},
    "beam3": {"do_sample": False, "num_beams": 3},
    "samples2": {"do_sample": True, "num_return_sequences": 2},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_generate_with_padding_is_bit_identical(arch, mode, quant):
    """fp: against DynamicCache; quantized: against the same quantized cache storing its padding. Tokens, logits
    and beam scores bit-identical; real tokens plus at most one block per row (and the pad block) stored."""
    model = tiny_model(arch)
    x, mask = left_padded([21, 13, 6], seed=12)  # padding 0, 8 and 15 tokens
    bs = B if quant is None else 8
    kw = MODES[mode]
    if quant is None:
        ref_cache = DynamicCache(config=model.config)
    else:
        ref_cache = PagedCache(block_size=bs, config=model.config, quant=quant, debug=True)
    ref = _generate(model, x, mask, ref_cache, 5, **kw)
    cache = PagedCache(block_size=bs, config=model.config, quant=quant, debug=True)
    cache.set_padding(mask)
    out = _generate(model, x, mask, cache, 5, **kw)
    _assert_bit_identical(out, ref)
    cache.check_invariants()
    n = cache.get_seq_length()
    assert n == x.shape[1] + len(out.logits) - 1
    pad = cache.pool.groups[0].pad_block
    assert pad is not None
    padding = (1 - mask).sum(1).repeat_interleave(cache.num_rows // x.shape[0]).tolist()
    for row, p in zip(cache.block_tables(), padding):  # full attention: whole blocks of padding name the pad block
        assert row[: p // bs] == [pad] * (p // bs) and pad not in row[p // bs:]
    if quant is not None:
        assert ref_cache.pool.stats().blocks_in_use > cache.pool.stats().blocks_in_use - 1
        ref_cache.release()
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().blocks_in_use == sum(g.pad_block is not None for g in cache.pool.groups)


def test_prefill_logits_are_bit_identical_and_padding_costs_at_most_a_block_per_row():
    model = tiny_model("llama")
    x, mask = left_padded([40, 23, 9, 33], seed=4)
    with torch.no_grad():
        ref = model(x, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config))).logits
        cache = PagedCache(block_size=B, config=model.config, debug=True)
        cache.set_padding(mask)
        out = model(x, attention_mask=mask, **cache_kwargs(cache)).logits
    assert torch.equal(out, ref)
    real = int(mask.sum())
    stats = cache.pool.stats()
    # real tokens in ceil(real / B) blocks per row at most, plus at most one (partly padded) block per row, plus the
    # pad block
    assert stats.blocks_in_use * B <= real + x.shape[0] * 2 * B + B
    assert stats.blocks_in_use == 1 + sum(-(-40 // B) - p // B for p in (1 - mask).sum(1).tolist())
    cache.release()


def test_eager_attention_real_positions_are_bit_identical():
    """Eager attention adds a finite minimum for masked positions, so a query row with every key masked (a padding
    token's) averages the values it cannot see: the pad block's zeros there, `DynamicCache`'s pad values. Only the
    logits at padding positions differ; every real position's, and `generate`, are bit-identical."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    model.config._attn_implementation = "eager"
    x, mask = left_padded([21, 13, 6], seed=12)
    ref = _generate(model, x, mask, DynamicCache(config=model.config), 0, do_sample=False)
    cache = PagedCache(block_size=B, config=model.config, debug=True)
    cache.set_padding(mask)
    _assert_bit_identical(_generate(model, x, mask, cache, 0, do_sample=False), ref)
    cache.release()
    with torch.no_grad():
        want = model(x, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config))).logits
        cache = PagedCache(block_size=B, config=model.config)
        cache.set_padding(mask)
        got = model(x, attention_mask=mask, **cache_kwargs(cache)).logits
    assert torch.equal(got[mask.bool()], want[mask.bool()])
    cache.release()


def test_a_mask_shorter_than_the_prompt_is_refused_and_nothing_is_stored():
    cache = PagedCache(block_size=B, debug=True)
    cache.set_padding(padded_mask([8, 0], 12))
    with pytest.raises(ValueError, match="attention_mask of 12 columns, but the prefill step has 16 tokens"):
        cache.update(*kv(2, 0, 16, 1.0), 0)
    assert cache.pool.stats().blocks_in_use == 0 and cache.get_seq_length() == 0
    cache.check_invariants()
    cache.set_padding(padded_mask([8, 0], 16))  # the right mask: the cache is still usable
    cache.update(*kv(2, 0, 16, 1.0), 0)
    assert cache.block_tables()[0][:2] == [cache.pool.groups[0].pad_block] * 2
    cache.release()


def test_a_mask_given_as_nested_lists_is_read_as_the_tensor():
    cache = PagedCache(block_size=B, debug=True)
    cache.set_padding(padded_mask([8, 0], 12).tolist())
    cache.update(*kv(2, 0, 12, 1.0), 0)
    assert cache.block_tables()[0][:2] == [cache.pool.groups[0].pad_block] * 2
    cache.check_invariants()
    cache.release()
