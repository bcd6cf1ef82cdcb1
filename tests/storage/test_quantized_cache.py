"""PagedCache on quantized blocks: storage accounting, encode-once, sharing, beams, forks, crop, errors, drift."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_pagedkv.config
from hf_pagedkv import BlockPool, PagedCache, QuantConfig, cache_kwargs
from hf_pagedkv.storage.codecs import make_codec
from tests.conftest import ids, tiny_model
from tests.eval_helpers import DATA_DIR

PRESETS = ["v8", "k8v8", "k8v4", "k4v4", "k4v2", "k2v2"]
BACKENDS = ["torch", "reference", "bitsandbytes"]
# relative error of layer-0 K/V (which do not depend on earlier layers' drift) per bit width, at most
REL_ERR = {None: 0.0, 8: 0.01, 4: 0.12, 2: 0.5}


_WIDE: list = []


def wide_llama():
    """A tiny llama with head_dim 64 (bitsandbytes needs quantization groups of at least 32 elements)."""
    if not _WIDE:
        torch.manual_seed(4321)
        config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64, pad_token_id=0)
        _WIDE.append(LlamaForCausalLM(config).eval())
    return _WIDE[0]


def feed(model, cache, x: torch.Tensor, prefill: int) -> None:
    """Prefill `x[:, :prefill]`, then feed the rest one token at a time (teacher forcing) through `cache`."""
    with torch.no_grad():
        if prefill:
            model(x[:, :prefill], **cache_kwargs(cache))
        for t in range(prefill, x.shape[1]):
            model(x[:, t: t + 1], **cache_kwargs(cache))


def reference_kv(model, x: torch.Tensor, prefill: int):
    """DynamicCache fed the same way (same shapes per step, so layer-0 K/V are bit-identical before quantization)."""
    cache = DynamicCache()
    feed(model, cache, x, prefill)
    return cache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_quant_config_presets_and_validation(caplog, monkeypatch):
    monkeypatch.setattr("hf_pagedkv.config._warned", set())  # the warning is once per process: not yet, whatever ran
    assert QuantConfig.preset("k8v4") == QuantConfig(key_bits=8, value_bits=4)
    assert QuantConfig.preset("v8") == QuantConfig(value_bits=8)
    assert QuantConfig.preset("fp").is_quantized is False and QuantConfig.resolve(None).name == "fp"
    assert [QuantConfig.preset(p).name for p in PRESETS] == PRESETS
    with pytest.raises(ValueError, match="key_bits.*got 5"):
        QuantConfig(key_bits=5)
    with pytest.raises(ValueError, match="Unknown quantization preset 'k5v5'"):
        QuantConfig.preset("k5v5")
    with pytest.raises(ValueError, match="backend"):
        QuantConfig(key_bits=8, backend="cuda")
    with pytest.raises(ValueError, match="bitsandbytes.*2"):
        QuantConfig(key_bits=2, value_bits=2, backend="bitsandbytes")
    with pytest.raises(ValueError, match="`quant` must be"):
        PagedCache(quant=8)
    # the warning is logged once per process: forget earlier ones (any test that built a k4v8 cache before this one)
    monkeypatch.setattr(hf_pagedkv.config, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="hf_pagedkv.config"):
        QuantConfig.preset("k4v8")
        QuantConfig.preset("k4v8")  # warns once
    warnings = [r for r in caplog.records if "fewer bits than values" in r.getMessage()]
    assert len(warnings) == 1 and "quantize values first" in warnings[0].getMessage()


def test_pool_owns_the_quant_setting():
    pool = BlockPool(quant="k8v4")
    assert pool.block_size == 32 and pool.quant.name == "k8v4"
    assert PagedCache(pool=pool).pool.quant == pool.quant  # None: the pool's
    assert PagedCache(pool=pool, quant=QuantConfig(key_bits=8, value_bits=4)).pool is pool
    with pytest.raises(ValueError, match="quant=k4v4 .* differs from the pool's quant=k8v4"):
        PagedCache(pool=pool, quant="k4v4")
    with pytest.raises(ValueError, match="differs from the pool's quant=fp"):
        PagedCache(pool=BlockPool(), quant="k8v8")
    assert BlockPool().block_size == 16 and not BlockPool(quant="fp").groups[0].store.is_quantized


def test_fp_preset_is_the_exact_path():
    model = tiny_model("llama")
    x = ids(2, 19)
    ref = model.generate(x, **cache_kwargs(DynamicCache()), max_new_tokens=10, do_sample=False)
    with PagedCache(block_size=4, quant="fp", debug=True) as cache:
        assert not cache.pool.groups[0].store.is_quantized
        assert torch.equal(model.generate(x, **cache_kwargs(cache), max_new_tokens=10, do_sample=False), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_matrix_presets_and_codecs(preset, backend):
    """Every preset on every codec backend: layer-0 K/V within the bit width's error, exact length, no leaks."""
    model, block, group = tiny_model("llama"), 8, 8  # head_dim 16
    if backend == "bitsandbytes":
        pytest.importorskip("bitsandbytes")
        if 2 in (QuantConfig.preset(preset).key_bits, QuantConfig.preset(preset).value_bits):
            pytest.skip("bitsandbytes has no 2-bit codec")
        model, block, group = wide_llama(), 32, 32  # bitsandbytes groups have >= 32 elements
    quant = QuantConfig.preset(preset, backend=backend, value_group_size=group)
    x = ids(2, 75, seed=1)
    ref = reference_kv(model, x, prefill=40)
    with PagedCache(block_size=block, quant=quant, debug=True) as cache:
        feed(model, cache, x, prefill=40)
        k, v = cache.layers[0].keys, cache.layers[0].values
        assert k.shape == v.shape == ref.layers[0].keys.shape and k.shape[2] == 75
        for got, want, bits in ((k, ref.layers[0].keys, quant.key_bits), (v, ref.layers[0].values, quant.value_bits)):
            err = rel(got, want)
            assert err <= REL_ERR[bits], (bits, err)
            if bits is not None:
                assert err > REL_ERR[bits] / 100, "quantization had no effect"
        n_full = 75 // block
        assert torch.equal(k[:, :, n_full * block:], ref.layers[0].keys[:, :, n_full * block:])  # residual: exact
        cache.pool.check_invariants()
    assert cache.pool.stats().blocks_in_use == 0 and cache.pool.stats().bytes_in_use == 0


def test_bytes_in_use_counts_codes_scales_and_partial_blocks():
    model = tiny_model("llama")  # 3 layers, 2 KV heads, head_dim 16
    with PagedCache(block_size=8, quant=QuantConfig(key_bits=8, value_bits=4, value_group_size=8)) as cache:
        feed(model, cache, ids(1, 20), prefill=20)  # 2 encoded blocks + 4 tokens in an open block
        stats = cache.pool.stats()
        per_head_block = (8 * 16 + 16 * 2) + (8 * 16 // 2 + 2 * (8 * 16 // 8) * 2)  # int8 keys + int4 values
        encoded = 3 * 2 * per_head_block
        fp_block = 3 * 2 * 8 * 16 * 2 * 4  # keys + values, fp32
        sink = fp_block // 8  # the first token, kept in full precision (QuantConfig.sink_tokens=1)
        assert stats.bytes_per_block == encoded
        assert stats.bytes_in_use == 3 * encoded + fp_block + sink
        with torch.no_grad():
            for t in range(4):  # fill the open block: it is encoded, no full-precision block is left
                model(ids(1, 1, seed=t), **cache_kwargs(cache))
        # the block encoded by this step keeps its stage until the next step starts: it is still held
        assert cache.pool.groups[0].store.staging.num_used == 1
        assert cache.pool.stats().bytes_in_use == 3 * encoded + fp_block + sink
        with torch.no_grad():
            model(ids(1, 1, seed=9), **cache_kwargs(cache))  # that stage returns; the new open block takes one
        assert cache.pool.groups[0].store.staging.num_used == 1
        assert cache.pool.stats().bytes_in_use == 4 * encoded + fp_block + sink
        assert cache.pool.groups[0].store.staging.num_stages <= 2  # sized by sequences, not by the pool


@pytest.mark.parametrize("sink", [0, 1, 4])
def test_sink_tokens_stay_exact_and_cost_their_bytes(sink):
    """The first `sink_tokens` tokens read back bit-identical to DynamicCache; the next one is quantized. Each
    costs one full-precision token per sequence; releasing the cache returns every sink stage."""
    model = tiny_model("llama")  # 3 layers, 2 KV heads, head_dim 16
    x = ids(1, 21, seed=3)
    ref = reference_kv(model, x, prefill=19)
    with PagedCache(block_size=8, quant=QuantConfig.preset("k4v4", sink_tokens=sink)) as cache:
        feed(model, cache, x, prefill=19)
        for got, want in zip(cache.layers, ref.layers):
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                assert torch.equal(a[:, :, :sink], b[:, :, :sink])
                assert not torch.equal(a[:, :, sink], b[:, :, sink])  # quantized
        encoded_and_open = 3 * cache.pool.stats().bytes_per_block + 3 * 2 * 8 * 16 * 2 * 4  # 3 blocks, 1 staged
        assert cache.pool.stats().bytes_in_use == encoded_and_open + sink * 3 * 2 * 16 * 2 * 4
        assert cache.pool.groups[0].store.sinks.num_used == (1 if sink else 0)
        cache.pool.check_invariants()
    assert cache.pool.groups[0].store.sinks.num_used == 0 and cache.pool.stats().bytes_in_use == 0


def test_sink_is_shared_copied_on_write_and_rewritten_after_crop():
    """A fork shares block 0 and its sink; the first write into the shared partial block copies both; a crop into
    the sink and new tokens rewrite it. Each cache's first tokens stay exact against DynamicCache on its own tokens,
    fed in the same steps (a crop included): bit-identity holds only for the same step shapes."""
    model = tiny_model("llama")
    x, y = ids(1, 9, seed=4), ids(1, 3, seed=5)
    a = PagedCache(block_size=8, quant=QuantConfig.preset("k8v4", sink_tokens=4), debug=True)
    feed(model, a, x[:, :3], prefill=3)  # 3 tokens: block 0 open, sink partly written
    b = a.fork()
    assert a.pool.groups[0].store.sinks.num_used == 1  # shared with the fork
    feed(model, a, x[:, 3:], prefill=0)  # a fills block 0 (copy-on-write: its own block 0 and sink) and goes on
    feed(model, b, y, prefill=0)
    assert a.pool.groups[0].store.sinks.num_used == 2
    for cache, tokens in ((a, x), (b, torch.cat([x[:, :3], y], 1))):
        ref = reference_kv(model, tokens, prefill=3)
        for got, want in zip(cache.layers, ref.layers):
            assert torch.equal(got.keys[:, :, :4], want.keys[:, :, :4])
            assert torch.equal(got.values[:, :, :4], want.values[:, :, :4])
    a.crop(-7)  # 9 -> 2 tokens, into the sink; new tokens at positions 2.. rewrite it
    z = ids(1, 7, seed=6)
    feed(model, a, z, prefill=0)
    # The reference crops too: tokens 0, 1 came from a 3-token prefill, which a fresh 2-token prefill matches only
    # to the last bits (reassociated sums, CPU-dependent), and every later layer and token inherits that.
    ref = reference_kv(model, x, prefill=3)
    ref.crop(-7)
    feed(model, ref, z, prefill=0)
    for got, want in zip(a.layers, ref.layers):
        assert torch.equal(got.keys[:, :, :4], want.keys[:, :, :4])
    a.pool.check_invariants()
    a.release()
    b.release()
    assert a.pool.groups[0].store.sinks.num_used == 0 and a.pool.stats().bytes_in_use == 0
    a.pool.check_invariants()


def test_sink_tokens_are_validated():
    with pytest.raises(ValueError, match="sink_tokens"):
        QuantConfig(key_bits=8, sink_tokens=-1)
    with pytest.raises(ValueError, match="sink_tokens=9 exceeds the block size 8"):
        PagedCache(block_size=8, quant=QuantConfig(key_bits=8, sink_tokens=9))
    with pytest.raises(ValueError, match="block_size=6 must be a multiple of 4"):  # at construction, not forward
        PagedCache(block_size=6, quant="k4v2")


def test_each_block_is_encoded_once(monkeypatch):
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, quant="k4v4", debug=True)
    encoded = []
    codec = cache.pool.groups[0].store.key_codec
    original = codec.encode

    def spy(x):
        encoded.append(x.shape[1])  # blocks per call
        return original(x)

    monkeypatch.setattr(codec, "encode", spy)
    feed(model, cache, ids(1, 23), prefill=10)  # 10 tokens = 2 blocks + 2; then 13 single tokens
    layers = 3
    assert sum(encoded) == layers * (23 // 4)  # every full block once per layer, never again
    assert encoded[:layers] == [2] * layers  # the prefill encodes its 2 full blocks at once
    cache.release()


def test_beam_reorder_dequantized_kv_follows_source_beam():
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, quant="k8v4", debug=True)
    feed(model, cache, ids(3, 14, seed=2), prefill=9)  # 3 encoded blocks + 2 staged tokens per row
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    cache.pool.check_invariants()
    for (k0, v0), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys, k0[beam_idx]) and torch.equal(layer.values, v0[beam_idx])
    # the next step writes into the shared open block: copy-on-write keeps every beam's history intact
    feed(model, cache, ids(3, 1, seed=5), prefill=0)
    for (k0, v0), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys[:, :, :14], k0[beam_idx]) and torch.equal(layer.values[:, :, :14], v0[beam_idx])
    # two more tokens fill block 3: it is encoded once, the earlier blocks stay bit-identical
    feed(model, cache, ids(3, 2, seed=6), prefill=0)
    for (k0, v0), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys[:, :, :12], k0[beam_idx, :, :12])
        assert rel(layer.keys[:, :, 12:14], k0[beam_idx, :, 12:14]) < REL_ERR[8]
    cache.pool.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_beam_search_generate_on_quantized_blocks():
    model = tiny_model("qwen2")
    x = ids(2, 13, seed=4)
    pool = BlockPool(block_size=4, quant="k8v8", debug=True)
    with PagedCache(pool=pool, debug=True) as cache:
        out = model.generate(x, **cache_kwargs(cache), num_beams=3, max_new_tokens=9, do_sample=False)
        assert out.shape == (2, 13 + 9)
        assert cache.num_rows == 6
        assert pool.stats().blocks_in_use < 6 * -(-cache.get_seq_length() // 4)  # beams share their history
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()


def test_fork_shares_encoded_blocks_and_copies_on_write():
    model = tiny_model("llama")
    a = PagedCache(block_size=4, quant="k4v4", debug=True)
    feed(model, a, ids(1, 10), prefill=10)
    used = a.pool.stats().blocks_in_use
    b = a.fork()
    assert a.pool.stats().blocks_in_use == used  # nothing copied
    ka = a.layers[1].keys.clone()
    assert torch.equal(b.layers[1].keys, ka)
    feed(model, b, ids(1, 5, seed=9), prefill=0)  # writes into the shared open block first, and fills it
    assert torch.equal(a.layers[1].keys, ka)  # the original is untouched (its block 2 is still open)
    assert torch.equal(b.layers[1].keys[:, :, :8], ka[:, :, :8])  # shared encoded blocks
    assert rel(b.layers[1].keys[:, :, 8:10], ka[:, :, 8:10]) < REL_ERR[4]  # b's copy of block 2, now encoded
    assert a.pool.stats().blocks_in_use == used + 2  # b's copy of block 2, and its new block 3
    a.release()
    b.release()
    assert a.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("new_len", [9, 8, 7, 2])
def test_crop_across_the_quantized_fp_border(new_len):
    """10 tokens at block size 4 = blocks [enc | enc | open 2]. Cropping into the open block (9), to the border (8),
    into an encoded block (7) or the first (2) keeps the length exact and the kept K/V unchanged."""
    model = tiny_model("llama")
    x = ids(1, 13, seed=6)
    cache = PagedCache(block_size=4, quant="k8v4", debug=True)
    feed(model, cache, x[:, :10], prefill=6)
    keys = [layer.keys.clone() for layer in cache.layers]
    cache.crop(new_len - 10)
    assert cache.get_seq_length() == new_len
    for k, layer in zip(keys, cache.layers):
        assert torch.equal(layer.keys, k[:, :, :new_len])
    cache.pool.check_invariants()
    # continue: a crop into an encoded block reopens it; it is encoded again once full
    feed(model, cache, x[:, new_len:13], prefill=0)
    assert cache.get_seq_length() == 13
    ref = reference_kv(model, x, prefill=6)
    k0 = cache.layers[0].keys
    assert torch.equal(k0[:, :, : new_len // 4 * 4], keys[0][:, :, : new_len // 4 * 4])  # untouched blocks
    assert rel(k0, ref.layers[0].keys) < 2 * REL_ERR[8]
    cache.pool.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0 and cache.pool.groups[0].store.staging.num_used == 0


def test_same_prompt_twenty_times_with_sharing_is_identical():
    model = tiny_model("llama")
    prompt = ids(1, 27, seed=8)
    base = PagedCache(block_size=4, quant="k4v4", debug=True)
    with torch.no_grad():
        model(prompt[:, :-1], **cache_kwargs(base))
    outputs = []
    for _ in range(20):
        with base.fork() as cache:
            outputs.append(model.generate(prompt, **cache_kwargs(cache), max_new_tokens=8, do_sample=False))
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    # and as one batch: the num_return_sequences rows share the prompt blocks, as on the full-precision path
    used = {}
    for quant in ("fp", "k4v4"):
        with PagedCache(block_size=4, quant=quant, debug=True) as cache:
            out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=8, do_sample=True, top_k=1,
                                 num_return_sequences=20)  # top_k=1: sampling that is greedy, so rows stay equal
            assert all(torch.equal(row, out[0]) for row in out)
            used[quant] = cache.pool.stats().blocks_in_use
    assert used["k4v4"] == used["fp"] < 20 * -(-34 // 4)
    base.release()
    assert base.pool.stats().blocks_in_use == 0


def test_rows_equal_in_layer_0_but_not_later_are_unshared_mid_step():
    """Forked rows that write identical K/V in layer 0 are stored once, then split when layer 1 differs, in the
    middle of a step that completes a block (whose first tokens are still staged). Each row must read exactly what
    a cache holding only that row reads."""
    g = torch.Generator().manual_seed(0)

    def kv(batch, q):
        return [torch.randn(batch, 2, q, 16, generator=g) for _ in range(4)]  # k0, v0, k1, v1

    def step(cache, t):
        k0, v0, k1, v1 = t
        cache.update(k0, v0, 0)
        cache.update(k1, v1, 1)

    prefill, nxt = kv(1, 6), kv(2, 3)  # 6 tokens: block 0 encoded, block 1 open with 2; then 3 more per row
    nxt[0][1], nxt[1][1] = nxt[0][0], nxt[1][0]  # rows equal in layer 0 only
    cache = PagedCache(block_size=4, quant="k8v4", debug=True)
    step(cache, prefill)
    cache.batch_repeat_interleave(2)
    step(cache, nxt)
    cache.pool.check_invariants()
    for r in range(2):
        alone = PagedCache(block_size=4, quant="k8v4", debug=True)
        step(alone, prefill)
        step(alone, [t[r: r + 1] for t in nxt])
        for layer in range(2):
            assert torch.equal(cache.layers[layer].keys[r], alone.layers[layer].keys[0]), (r, layer)
            assert torch.equal(cache.layers[layer].values[r], alone.layers[layer].values[0]), (r, layer)
        alone.release()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0 and cache.pool.groups[0].store.staging.num_used == 0


def test_nan_input_raises_and_leaks_nothing():
    cache = PagedCache(block_size=4, quant="k8v8", debug=True)
    k = torch.randn(1, 2, 6, 16)
    cache.update(k, k.clone(), 0)
    bad = torch.randn(1, 2, 3, 16)
    bad[0, 1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="key_states of layer 0.*NaN or inf"):
        cache.update(bad, torch.randn(1, 2, 3, 16), 0)
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0
    cache.pool.check_invariants()


def test_value_group_must_divide_head_dim():
    cache = PagedCache(quant=QuantConfig(key_bits=8, value_bits=4, value_group_size=12))
    with pytest.raises(ValueError, match="value_group_size=12 does not divide head_dim=16"):
        cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)


def test_debug_mode_poisons_freed_blocks():
    model = tiny_model("llama")
    cache = PagedCache(block_size=4, quant="k4v4", debug=True)
    feed(model, cache, ids(1, 10), prefill=10)
    blocks = cache.block_tables()[0]
    store = cache.pool.groups[0].store
    stage = store.states.stage_of[blocks[-1]]
    cache.release()
    for layer in store.specs:
        codes, scales = store.codes[layer][0].materialize(), store.scales[layer][0].materialize()
        assert bool((codes[:, blocks] == 0xFF).all()) and bool(scales[:, blocks].isnan().all())
        out = torch.empty(2, len(blocks), 4, 16)
        assert bool(make_codec("int4", "channel").decode(codes[:, blocks], scales[:, blocks], out).isnan().all())
        assert bool(store.staging.block(store.staging.keys, layer, stage).isnan().all())


@pytest.mark.model
def test_value_only_drifts_less_than_key_only(smollm):
    """Values tolerate quantization better than keys (the reason for the preset ladder): on the real model, at the
    same bits, V-only quantization must drift less than K-only. If not, the value path has a bug."""
    model, tokenizer = smollm
    text = (DATA_DIR / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:40_000]
    x = tokenizer(text, return_tensors="pt").input_ids[:, 1000:1000 + 320]
    logps = {}
    for name in ("fp", "k2v16", "k16v2"):
        cache = PagedCache(quant=name)
        with torch.no_grad():
            model(x[:, :256], **cache_kwargs(cache))
            logps[name] = torch.cat([model(x[:, t: t + 1], **cache_kwargs(cache)).logits[:, -1]
                                     for t in range(256, 320)]).log_softmax(-1)
        cache.release()

    def kl(name):
        return float((logps["fp"].exp() * (logps["fp"] - logps[name])).sum(-1).mean())

    assert kl("k16v2") < kl("k2v16"), (kl("k16v2"), kl("k2v16"))
    assert kl("k16v2") > 1e-4  # it did quantize


def test_gathered_blocks_across_segments_split_once_per_step_and_follow_changed_ids(monkeypatch):
    """Blocks gathered from a pool grown into several segments decode as each block read alone; every half and
    layer reading the same ids reuses one segment split, and ids that change (a table rewritten in place, as
    compaction does) are split again, never read through a stale split."""
    from hf_pagedkv.storage.segmented_tensor import SegmentedTensor

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                         vocab_size=96)
    pool = BlockPool(quant="k8v4")
    caches = []
    for seed in range(10):  # each prefill of 96 tokens encodes 3 blocks; the pool grows a segment at a time
        cache = PagedCache(pool=pool, config=config)
        g = torch.Generator().manual_seed(seed)
        for layer in range(2):
            k = torch.randn(1, 2, 96, 16, generator=g)
            cache.update(k, -k, layer)
        caches.append(cache)
    store = pool.groups[0].store
    reader = store.reader
    assert len(store.segment_blocks) >= 2
    blocks = [b for cache in caches for b in cache.block_tables()[0]]
    bounds = torch.tensor(store.storage.segment_blocks).cumsum(0).tolist()
    picked = [blocks[0], blocks[-1], blocks[len(blocks) // 2]]  # from the first and the last segments
    assert picked[0] < bounds[0] <= picked[1]

    def alone(layer, half, ids):
        return torch.cat([reader.decode_blocks(layer, half, torch.tensor([b]), torch.empty(2, 1, 32, 16), base=b)
                          for b in ids], 1)  # [num_kv_heads, len(ids), 32, 16]

    splits = []
    real_split = SegmentedTensor.split
    monkeypatch.setattr(SegmentedTensor, "split", lambda self, *a, **k: splits.append(1) or real_split(self, *a, **k))
    ids = torch.tensor(picked)
    for layer in range(2):
        for half in range(2):  # (`alone` reads views: it splits nothing)
            out = reader.decode_blocks(layer, half, ids, torch.empty(2, 3, 32, 16))
            assert torch.equal(out, alone(layer, half, picked))
    assert len(splits) == 1  # one split for both halves of both layers
    ids[0] = blocks[1]  # the same tensor, rewritten in place
    out = reader.decode_blocks(1, 1, ids, torch.empty(2, 3, 32, 16))
    assert len(splits) == 2 and torch.equal(out, alone(1, 1, [blocks[1]] + picked[1:]))
    for cache in caches:
        cache.release()
