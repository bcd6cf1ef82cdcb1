"""The ``"hf_pagedkv"`` attention reads a PagedCache's blocks in place: same outputs as `sdpa` over the materialized
K/V (fp32 rounding apart: the reduction order changes), same greedy tokens, and `sdpa` itself everywhere else.

The reference for every comparison is the same model with ``attn_implementation="sdpa"`` and the same kind of
PagedCache, which hands `sdpa` a gathered copy (fp) or a de-quantized copy (quantized pools): "de-quantize, then
sdpa". Block size 4 and tiles of 2 blocks make every read cross several tiles, a partial last block and (Gemma3's
window of 8) a first block half outside the window.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_pagedkv.attention.attention_function as attention_function
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.attention import ATTENTION_NAME, PagedView, paged_attention, paged_attention_forward
from tests.conftest import VOCAB, tiny_model

#: max |difference| allowed between the in-place read and sdpa over the materialized K/V, for one attention call on
#: the same cache and for the logits of a full-precision pool: the softmax and the products are summed tile by tile
#: instead of in one pass, so fp32 results differ in the last bits (measured below 5e-7 on these models, |logits| <
#: 1.1); 1e-5 is the issue's bound.
PAGED_LOGIT_ATOL = 1e-5
#: the same for the logits of a quantized pool after several steps: a block encoded from K/V that differ by 1e-7
#: (the earlier layers' rounding) can round one code the other way, a step of about absmax / 254 (int8) in one
#: element, which the later layers carry into the logits (measured up to 5.3e-5 here). Each attention call still
#: meets PAGED_LOGIT_ATOL on the same codes (checked in `counted`).
QUANTIZED_LOGIT_ATOL = 1e-3
QUANTS = [None, "k8v8", "k8v4", "k4v4"]


@pytest.fixture
def counted(monkeypatch):
    """Counts the layers read in place and checks each call against sdpa over the materialized K/V of the very same
    cache (both computed from the same codes): the torch read in small tiles (so a read spans several), and the C
    read the attention asked for first (``"hf_pagedkv"``'s `cpu_table_read`), which the call returns when it
    applies."""
    calls = []
    real = attention_function.paged_attention

    def spy(query, view, scale, mask, tile_tokens, native=None, **kwargs):
        calls.append(view.end - view.lo)
        k, v = view.materialize()
        module = torch.nn.Module()
        module.num_key_value_groups = query.shape[1] // k.shape[1]
        ref = sdpa_attention_forward(module, query, k, v, mask, scaling=scale)[0]
        out = real(query, view, scale, mask, tile_tokens=8, **kwargs)  # the torch read
        assert (out - ref).abs().max().item() <= PAGED_LOGIT_ATOL
        if native is not None:
            out = real(query, view, scale, mask, tile_tokens=tile_tokens, native=native, **kwargs)
            assert (out - ref).abs().max().item() <= PAGED_LOGIT_ATOL
        return out

    monkeypatch.setattr(attention_function, "paged_attention", spy)
    return calls


def run(model, impl, quant, input_ids, mask=None, **gen):
    """Greedy (or beam) generation with per-step logits, through a fresh PagedCache; checks its invariants."""
    model.set_attn_implementation(impl)
    try:
        cache = PagedCache(config=model.config, quant=quant, block_size=4, debug=True)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=mask, **cache_kwargs(cache), do_sample=False,
                                 max_new_tokens=10, output_logits=True, return_dict_in_generate=True, **gen)
        cache.check_invariants()
        cache.release()
    finally:
        model.set_attn_implementation("sdpa")
    return out.sequences, torch.stack(out.logits, 1)


def assert_close(ref, got, quant=None):
    assert torch.equal(ref[0], got[0]), "tokens differ"
    diff = (ref[1] - got[1]).abs().max().item()
    assert diff <= (PAGED_LOGIT_ATOL if quant is None else QUANTIZED_LOGIT_ATOL), diff


def test_registered_under_its_name_without_touching_sdpa():
    assert ATTENTION_NAME == "hf_pagedkv"
    assert ALL_ATTENTION_FUNCTIONS["hf_pagedkv"] is paged_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["hf_pagedkv"] is sdpa_mask
    model = tiny_model("llama")
    model.set_attn_implementation("hf_pagedkv")
    assert model.config._attn_implementation == "hf_pagedkv"
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_greedy_matches_sdpa_over_materialized_kv(name, quant, counted):
    model = tiny_model(name)
    x = torch.randint(3, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    ref = run(model, "sdpa", quant, x)
    assert not counted
    got = run(model, "hf_pagedkv", quant, x)
    assert_close(ref, got, quant)
    layers = model.config.num_hidden_layers
    # every layer of the 9 decode steps but the first step's first layer, which probes (no step confirmed before;
    # later steps begin confirmed: the cache has the model's config, which names "hf_pagedkv")
    assert len(counted) == 9 * layers - 1, counted
    if name == "gemma3":
        assert min(counted) == 8  # sliding layers read their window (7 cached + 1 new), full ones everything
        assert max(counted) == 21 + 9


@pytest.mark.parametrize("quant", [None, "k4v4"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_left_padded_batch(name, quant, counted):
    model = tiny_model(name)
    x = torch.randint(3, VOCAB, (3, 18), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[0, :5], mask[2, :11] = 0, 0  # left padding: 5 and 11 tokens
    x[mask == 0] = 0
    assert_close(run(model, "sdpa", quant, x, mask), run(model, "hf_pagedkv", quant, x, mask), quant)
    assert counted


@pytest.mark.parametrize("quant", [None, "k8v8"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_beam_search(name, quant, counted):
    model = tiny_model(name)
    x = torch.randint(3, VOCAB, (1, 15), generator=torch.Generator().manual_seed(3))
    ref = run(model, "sdpa", quant, x, num_beams=3, num_return_sequences=2)
    got = run(model, "hf_pagedkv", quant, x, num_beams=3, num_return_sequences=2)
    assert_close(ref, got, quant)
    assert counted


def decode_forks(model, impl, quant):
    """A prompt cached once, forked twice; each fork decodes its own tokens (shared blocks, copy-on-write)."""
    model.set_attn_implementation(impl)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(3, VOCAB, (1, 14), generator=g)
    logits = []
    with torch.no_grad():
        root = PagedCache(config=model.config, quant=quant, block_size=4, debug=True)
        model(x, **cache_kwargs(root))
        forks = [root.fork(), root.fork()]
        for i, cache in enumerate(forks):
            tok = torch.tensor([[5 + i]])
            for _ in range(6):
                out = model(tok, **cache_kwargs(cache)).logits
                logits.append(out)
                tok = out[:, -1:].argmax(-1)
            cache.check_invariants()
        for cache in [root, *forks]:
            cache.release()
        root.pool.check_invariants()
        assert root.pool.stats().blocks_in_use == 0
    model.set_attn_implementation("sdpa")
    return torch.cat(logits, 1)


@pytest.mark.parametrize("quant", [None, "k8v8", "k4v4"])
def test_forks_read_their_own_blocks(quant, counted):
    model = tiny_model("gemma3")
    ref, got = decode_forks(model, "sdpa", quant), decode_forks(model, "hf_pagedkv", quant)
    assert (ref - got).abs().max().item() <= (PAGED_LOGIT_ATOL if quant is None else QUANTIZED_LOGIT_ATOL)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert counted


def test_one_token_prompt(counted):
    """A one-token step whose later layers get one-token placeholders (no stride tells them from real keys)."""
    model = tiny_model("llama")
    x = torch.tensor([[7]])
    assert_close(run(model, "sdpa", None, x), run(model, "hf_pagedkv", None, x))
    assert counted


def test_other_caches_and_prefill_are_plain_sdpa(counted):
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    outs = []
    for impl in ("sdpa", "hf_pagedkv"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs.append(model.generate(x, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=6,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True))
    model.set_attn_implementation("sdpa")
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(torch.stack(outs[0].logits), torch.stack(outs[1].logits))  # the very same sdpa calls
    assert not counted


def test_switching_back_to_sdpa_mid_generation_gets_real_kv(counted):
    """A confirmation holds for one step: after `set_attn_implementation("sdpa")` no placeholder reaches sdpa."""
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    logits = {}
    for impls in (["sdpa"] * 6, ["hf_pagedkv"] * 3 + ["sdpa"] * 3):
        cache = PagedCache(config=model.config, block_size=4)
        steps = []
        with torch.no_grad():
            tok = x
            for impl in impls:
                model.set_attn_implementation(impl)
                out = model(tok, **cache_kwargs(cache)).logits[:, -1:]
                steps.append(out)
                tok = out.argmax(-1)
        model.set_attn_implementation("sdpa")
        cache.release()
        logits[impls[0]] = torch.cat(steps, 1)
    assert (logits["sdpa"] - logits["hf_pagedkv"]).abs().max().item() <= PAGED_LOGIT_ATOL
    layers = model.config.num_hidden_layers
    assert len(counted) == 2 * layers - 1  # steps 2 and 3 (step 1 is the prefill; step 2's first layer probes)


def test_placeholders_hold_no_history_and_fall_back_when_asked():
    """Unit level: a confirmed step's update returns zero-stride placeholders carrying the view; an unsupported
    call (dropout) materializes them and gives sdpa's result exactly."""
    cache = PagedCache(block_size=4)
    g = torch.Generator().manual_seed(7)
    kv = lambda q: (torch.randn(2, 2, q, 8, generator=g), torch.randn(2, 2, q, 8, generator=g))  # noqa: E731
    with torch.no_grad():
        cache.update(*kv(9), 0)
        cache.update(*kv(9), 1)
        k0, _ = cache.update(*kv(1), 0)  # a fresh step: materialized, tagged
        view = PagedView.of(k0)
        assert view is not None and not view.is_placeholder(k0)
        view.confirm()
        k1, v1 = cache.update(*kv(1), 1)  # the same step's next layer: a placeholder
        assert PagedView.of(k1) is not None and k1.stride(2) == 0 and k1.shape == (2, 2, 10, 8)
        real_k, real_v = PagedView.of(k1).materialize()
        assert real_k.shape == (2, 2, 10, 8) and real_k.abs().sum() > 0
        query = torch.randn(2, 4, 1, 8, generator=g)
        module = torch.nn.Module()
        module.num_key_value_groups = 2
        module.training = False
        ref = sdpa_attention_forward(module, query, real_k, real_v, None, scaling=0.3)[0]
        got = paged_attention_forward(module, query, k1, v1, None, scaling=0.3)[0]
        assert (ref - got).abs().max().item() <= 1e-6
        module.training = True  # dropout: not read in place, sdpa over the materialized K/V
        torch.manual_seed(0)
        ref = sdpa_attention_forward(module, query, real_k, real_v, None, dropout=0.5, scaling=0.3)[0]
        torch.manual_seed(0)
        got = paged_attention_forward(module, query, k1, v1, None, dropout=0.5, scaling=0.3)[0]
        assert torch.equal(ref, got)
    cache.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", [None, "k4v4"])
def test_cuda_reads_in_place_as_sdpa_does(quant, counted):
    """The same contract on CUDA tensors (the torch path is device-correct; the CPU run above is the reference)."""
    import copy

    model = copy.deepcopy(tiny_model("gemma3")).cuda()
    x = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(8)).cuda()
    assert_close(run(model, "sdpa", quant, x), run(model, "hf_pagedkv", quant, x), quant)
    assert counted


def run_cache(model, impl, make_cache, input_ids, **gen):
    """`run` with a cache built by `make_cache()` (retention policies, other block sizes)."""
    model.set_attn_implementation(impl)
    try:
        cache = make_cache()
        with torch.no_grad():
            out = model.generate(input_ids, **cache_kwargs(cache), do_sample=False, max_new_tokens=12,
                                 output_logits=True, return_dict_in_generate=True, **gen)
        cache.check_invariants()
        cache.release()
    finally:
        model.set_attn_implementation("sdpa")
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("quant", [None, "k8v4", "k4v4"])
def test_sink_window_retention(quant, counted):
    """A retention policy evicts middle blocks before steps: the in-place read follows the evicted tables."""
    from hf_pagedkv.retention import SinkWindow

    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (2, 19), generator=torch.Generator().manual_seed(9))

    def make():
        return PagedCache(config=model.config, quant=quant, block_size=4, debug=True,
                          retention=SinkWindow(sink_tokens=4, window=8))

    assert_close(run_cache(model, "sdpa", make, x), run_cache(model, "hf_pagedkv", make, x), quant)
    assert counted


@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_sliding_window_left_padded_long_prompt(quant, counted):
    """Gemma3's window of 8 over a 29-token prompt in 4-token blocks, rows left-padded differently: the window's
    first block is cut, the full layers read every block (as strided views of the rows' runs, or codes)."""
    model = tiny_model("gemma3")
    x = torch.randint(3, VOCAB, (2, 29), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(x)
    mask[0, :7] = 0
    x[mask == 0] = 0
    assert_close(run(model, "sdpa", quant, x, mask), run(model, "hf_pagedkv", quant, x, mask), quant)
    assert counted


@pytest.mark.parametrize("quant", ["k8v4", "k4v4", "k4v4rv"])
def test_beams_and_left_padding_quantized(quant, counted):
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (2, 15), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(x)
    mask[1, :6] = 0
    x[mask == 0] = 0
    ref = run(model, "sdpa", quant, x, mask, num_beams=3, num_return_sequences=2)
    assert_close(ref, run(model, "hf_pagedkv", quant, x, mask, num_beams=3, num_return_sequences=2), quant)
    assert counted


def test_fp_parts_views_and_gathers_cover_the_read_once():
    """Rows prefilled together lie a fixed number of blocks apart: their prefix is one strided view of the pool
    (no copy); the blocks of later decode steps, interleaved across rows, are gathered. (A fixed pool too small for
    rows with room to grow after them (`BlockPool.allocate_rows`), so the decode blocks do interleave.)"""
    cache = PagedCache(pool=BlockPool(block_size=4, num_blocks=30))
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for q in (22, 1, 1, 1):  # a 22-token prompt (5 full blocks + 2 tokens), then 3 decode steps
            k = torch.randn(3, 2, q, 8, generator=g)
            for layer in (0, 1):
                cache.update(k, k + 1, layer)
        k = torch.randn(3, 2, 1, 8, generator=g)
        key0, _ = cache.update(k, k + 1, 0)
        view = PagedView.of(key0)
        parts = view.fp_parts(tile_tokens=8)
        ref_k, ref_v = view.materialize()  # [batch, H, 26, 8]
    cols = torch.cat([c for _, _, c in parts])
    assert sorted(cols.tolist()) == list(range(26))  # every token once
    pool = cache.pool.groups[0].store.keys[0].segments[0]
    shared = [k for k, _, _ in parts if k.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()]
    assert shared and shared[0].shape == (2, 3, 24, 8)  # the prompt's 6 blocks of every row: a view of the pool
    for k, v, c in parts:  # each part holds exactly the tokens its columns name
        assert torch.equal(k.transpose(0, 1), ref_k[:, :, c]) and torch.equal(v.transpose(0, 1), ref_v[:, :, c])
    query = torch.randn(3, 4, 1, 8, generator=g)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    want = sdpa_attention_forward(module, query, ref_k, ref_v, None, scaling=0.3)[0]
    got = paged_attention(query, view, 0.3, None, tile_tokens=8)
    assert (want - got).abs().max().item() <= 1e-6
    cache.release()



@pytest.mark.parametrize("name,axis", [("int8", "channel"), ("int8", "token"), ("int4", "channel"), ("int4", "token"),
                                       ("int2", "token"), ("identity", "channel")])
def test_codec_affine_parts_rebuild_decode(name, axis):
    """`unpack` and `affine` (what the attention folds into its products) rebuild `decode` exactly up to the last
    rounding: ``decode == unpack * scale + zero`` per group."""
    from hf_pagedkv.storage.codecs import make_codec

    codec = make_codec(name, axis, group_size=4)
    x = torch.randn(3, 5, 8, 8, generator=torch.Generator().manual_seed(13))  # [heads, blocks, block_size, dim]
    codes, scales = codec.encode(x)
    want = codec.decode(codes, scales, torch.empty_like(x))
    values = codec.unpack(codes, torch.empty_like(x))
    scale, zero = codec.affine(scales, x.dtype)
    if scale is None:
        assert torch.equal(values, want)
        return
    assert torch.equal(values, values.round()) and values.abs().max() <= 255  # integer codes
    g, _ = codec.grouped(values)
    got = g * codec.stats_view(scale, 8, 8) + (0 if zero is None else codec.stats_view(zero, 8, 8))
    assert (got.reshape(x.shape) - want).abs().max().item() <= 1e-6


def _code_read(key_codec: str, value_codec: str, batch: int, offset: float, seed: int = 0, n: int = 4, B: int = 8,
               D: int = 16, tail_len: int = 3, fit: str = "minmax"):
    """A `CodeRead` of random K/V (`n` encoded `B`-token blocks, `tail_len` tail tokens, 1 sink token, 2 heads of
    `D` channels) and its reference K/V `[2, batch, n * B + tail_len, D]` as "de-quantize, then attend" sees them:
    decoded codes, the tail, the sink in fp32 (`fit`: the integer codecs' range fit, `make_codec`)."""
    from hf_pagedkv.storage.code_read import CodeRead
    from hf_pagedkv.storage.codecs import make_codec

    g = torch.Generator().manual_seed(seed)
    H = 2
    kc, vc = make_codec(key_codec, "channel", fit=fit), make_codec(value_codec, "token", group_size=D, fit=fit)
    # keys with per-channel offsets `offset` times their spread (outlier channels: zeros large against the range)
    x = torch.randn(H, batch, n, B, D, generator=g) + offset * torch.randn(H, 1, 1, 1, D, generator=g)
    y = torch.randn(H, batch, n, B, D, generator=g)
    (kcodes, kscales), (vcodes, vscales) = kc.encode(x), vc.encode(y)
    tail = [torch.randn(H, batch, tail_len, D, generator=g) for _ in range(2)]
    sink = [torch.randn(H, batch, 1, D, generator=g) for _ in range(2)]
    full = tuple(torch.cat((t, s), 2) for t, s in zip(tail, sink))  # [H, batch, tail | sink, D]
    read = CodeRead(0, 0, n * B + tail_len, B, (D, D), (kc, vc), (kcodes, vcodes), (kscales, vscales), full, 1)
    ref = []
    for codec, codes, scales, t, s in ((kc, kcodes, kscales, tail[0], sink[0]),
                                       (vc, vcodes, vscales, tail[1], sink[1])):
        dec = codec.decode(codes, scales, torch.empty(H, batch, n, B, D)).reshape(H, batch, n * B, D)
        dec[:, :, :1] = s  # the sink token replaces its codes
        ref.append(torch.cat((dec, t), 2))
    return read, ref[0], ref[1]


@pytest.mark.parametrize("key_codec,value_codec", [("int4", "int4"), ("int8", "int4"), ("int8", "int8"),
                                                   ("ref-int4", "ref-int4")])
@pytest.mark.parametrize("offset", [0.0, 8.0])
@pytest.mark.parametrize("fit", ["minmax", "mse"])
def test_code_attention_within_fp32_of_decoding(key_codec, value_codec, offset, fit):
    """`code_attention` (keys decoded per tile, value scales folded into the probabilities) equals "de-quantize,
    then softmax" on the same codes: the reference is computed in float64 from the decoded fp32 K/V, and both the
    in-place read and fp32 `sdpa` on the decoded K/V must lie within 1e-5 of it (fp32 rounding of sums over 16
    channels and 35 tokens: ~1e-6 measured; the offset makes the keys' zeros 8x their spread). Codes of either
    range fit (`fit="mse"` clips: the same format, other parameters)."""
    from hf_pagedkv.attention.paged_attention import code_attention

    read, k, v = _code_read(key_codec, value_codec, batch=2, offset=offset, fit=fit)
    if fit == "mse" and value_codec == "int4":  # the search moved some 4-bit ranges: these codes are not min/max's
        assert not torch.equal(read.scales[1], _code_read(key_codec, value_codec, 2, offset)[0].scales[1])
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(1)) * 0.25  # [H, batch, rows, D]
    want = torch.softmax(qh.double() @ k.double().transpose(-1, -2), -1) @ v.double()  # [H, batch, rows, D]
    for tile in (8, 16, 64):  # several tiles, a tile that ends mid-read, one tile
        got = code_attention(qh, read, None, tile)
        assert (got.double() - want).abs().max().item() <= 1e-5, tile
    sdpa = torch.nn.functional.scaled_dot_product_attention(qh, k, v, scale=1.0)
    assert (sdpa.double() - want).abs().max().item() <= 1e-5



@pytest.mark.parametrize("quant", ["k8v8", "k4v4"])
@pytest.mark.parametrize("impl", [ATTENTION_NAME, "hf_pagedkv_compiled"])
def test_left_padding_set_on_a_quantized_cache(quant, impl, monkeypatch):
    """`set_padding`: a row's whole blocks of padding name the shared pad block, which has no full-precision sink
    stage, while the unpadded row's first block has one. Each row's sink token is read as its own stage says (full
    precision, or its codes), as the materialized read does: every in-place call, the eager read and the table
    reads of ``"hf_pagedkv_compiled"`` alike, within 1e-5 of sdpa over the materialized K/V of the same cache, and
    the greedy tokens of `sdpa` (a sink read from the codes would put the logits 7.5e-2 apart)."""
    calls = []
    real = attention_function.paged_attention

    def spy(query, view, scale, mask, tile_tokens, **engines):
        out = real(query, view, scale, mask, tile_tokens=tile_tokens, **engines)
        k, v = view.materialize()
        module = torch.nn.Module()
        module.num_key_value_groups = query.shape[1] // k.shape[1]
        ref = sdpa_attention_forward(module, query, k, v, mask, scaling=scale)[0]
        calls.append((out - ref).abs().max().item())
        return out

    monkeypatch.setattr(attention_function, "paged_attention", spy)
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(21))
    mask = torch.ones_like(x)
    mask[0, :9] = 0  # two whole blocks of padding in row 0
    out = {}
    for name in ("sdpa", impl):
        def make_cache():
            cache = PagedCache(config=model.config, quant=quant, block_size=4, debug=True)
            cache.set_padding(mask)
            return cache
        out[name] = run_cache(model, name, make_cache, x, attention_mask=mask)
    assert torch.equal(out["sdpa"][0], out[impl][0])
    assert calls and max(calls) <= PAGED_LOGIT_ATOL, max(calls)


def test_without_the_config_every_step_probes_with_its_first_layer(counted):
    """A cache built without `config=` cannot see the model's attention: each decode step's first layer reads a
    normal copy (the probe), the others in place; the tokens and logits of `sdpa`."""
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(8))
    out = {}
    for impl in ("sdpa", "hf_pagedkv"):
        model.set_attn_implementation(impl)
        try:
            cache = PagedCache(block_size=4)
            with torch.no_grad():
                res = model.generate(x, **cache_kwargs(cache), do_sample=False, max_new_tokens=5,
                                     output_logits=True, return_dict_in_generate=True)
            cache.check_invariants()
            cache.release()
        finally:
            model.set_attn_implementation("sdpa")
        out[impl] = res.sequences, torch.stack(res.logits, 1)
    assert_close(out["sdpa"], out["hf_pagedkv"])
    assert len(counted) == 4 * (model.config.num_hidden_layers - 1)  # 4 decode steps, each but its first layer


def test_a_placeholder_that_reaches_another_attention_raises():
    """The cache was built with model A's config, which names "hf_pagedkv"; a copy of A with its own config set to
    `sdpa` then runs a step on the cache. That step begins confirmed (A's config), so `sdpa` gets placeholder K/V:
    the next layer's update raises instead of letting the step's output go out wrong, and the cache stops
    confirming early (a new step probes again)."""
    import copy

    model = tiny_model("llama")
    other = copy.deepcopy(model)
    x = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(9))
    model.set_attn_implementation("hf_pagedkv")
    try:
        cache = PagedCache(config=model.config, block_size=4)
        with torch.no_grad():
            tok = model(x, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)  # confirmed by its first layer
            with pytest.raises(RuntimeError, match="its attention did not read them"):
                other(tok, **cache_kwargs(cache))
        cache.release()
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("impl", ["hf_pagedkv", "hf_pagedkv_compiled"])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("quant,block_size", [(None, 16), (None, 4), ("k8v8", 4), ("k4v4", 4)])
def test_padding_rows_of_a_short_prompt_read_in_place(impl, name, quant, block_size):
    """A left-padded batch whose 12-token prompt is short enough to be read in place (at most `MAX_QUERY_TOKENS`):
    the query rows of the padding positions attend to nothing. Every read gives them 0, as `sdpa` does (NaN there
    would reach the row's real tokens through the next layers' K/V), so the logits
    stay finite and the tokens are `DynamicCache`'s (full precision: logits within 1e-5) or those of `sdpa` over the
    same quantized cache."""
    model = tiny_model(name)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    if quant is None:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            res = model.generate(ids, attention_mask=mask, **cache_kwargs(DynamicCache()), do_sample=False,
                                 max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
        ref = res.sequences, torch.stack(res.logits, 1)
    else:
        ref = run_padded(model, "sdpa", quant, ids, mask, block_size)
    got = run_padded(model, impl, quant, ids, mask, block_size)
    assert torch.isfinite(got[1]).all()
    assert_close(ref, got, quant)


def run_padded(model, impl, quant, ids, mask, block_size):
    """`run` of 4 new tokens with an attention mask and a block size."""
    model.set_attn_implementation(impl)
    try:
        cache = PagedCache(config=model.config, quant=quant, block_size=block_size)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), do_sample=False, max_new_tokens=4,
                                 output_logits=True, return_dict_in_generate=True)
        cache.check_invariants()
        cache.release()
    finally:
        model.set_attn_implementation("sdpa")
    return out.sequences, torch.stack(out.logits, 1)


def test_a_one_layer_model_never_begins_a_step_confirmed():
    """With one layer the claim check would come only at the next step, after the wrong step's output: such a
    cache keeps probing with its first (only) layer, so a copy of the model set to `sdpa` on a cache built with the
    original's config (which names "hf_pagedkv") still gets real K/V: the logits of `DynamicCache`."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    other = copy.deepcopy(model)
    model.set_attn_implementation("hf_pagedkv")
    x, nxt = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(12)), torch.tensor([[5]])
    cache, ref = PagedCache(config=model.config, block_size=4), DynamicCache()
    with torch.no_grad():
        for step in (x, nxt, nxt):
            model(step, **cache_kwargs(cache))
            other(step, **cache_kwargs(ref))
        got, want = (m(nxt, **cache_kwargs(c)).logits for m, c in ((other, cache), (other, ref)))
    assert (got - want).abs().max().item() <= PAGED_LOGIT_ATOL
    cache.release()
    model.set_attn_implementation("sdpa")
