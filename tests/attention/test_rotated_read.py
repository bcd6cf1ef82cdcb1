"""Rotated keys, 3-bit and fp8 formats read in place: equal to "de-rotate / de-quantize, then sdpa", and every
read counted by the path that served it (kernels, or a counted fallback to torch)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.attention import READ_COUNTS
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import code_attention
from hf_pagedkv.attention.rotated_read import rotate_code_read
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.codecs import RotatedCodec, make_codec
from tests.attention.test_paged_attention import PAGED_LOGIT_ATOL, QUANTIZED_LOGIT_ATOL, counted  # noqa: F401
from tests.conftest import VOCAB, tiny_model

NEW_FORMATS = ["k8v4r", "k4v4r", "k4v3r", "k3v3r", "k4ve4m3", "k4ve4m3r", "k4ve4m3b", "ke5m2v4", "k8v4v", "k4v4rv",
               "k3v3rv", "k4ve4m3rv"]


def generate(model, impl, quant, input_ids):
    """Greedy generation with per-step logits through a fresh PagedCache of 8-token blocks (3-bit codes pack 8)."""
    model.set_attn_implementation(impl)
    try:
        cache = PagedCache(config=model.config, quant=quant, block_size=8, debug=True)
        with torch.no_grad():
            out = model.generate(input_ids, **cache_kwargs(cache), do_sample=False, max_new_tokens=12,
                                 output_logits=True, return_dict_in_generate=True)
        cache.check_invariants()
        cache.release()
    finally:
        model.set_attn_implementation("sdpa")
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("quant", NEW_FORMATS)
def test_in_place_read_equals_sdpa_over_the_dequantized_keys(quant, counted):  # noqa: F811
    """Every attention call of "hf_pagedkv" (the torch read in tiles, and the C read where it applies) is within
    1e-5 of sdpa over the materialized (de-rotated, de-quantized) K/V of the same cache (`counted`), and the
    generation equals sdpa's."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 21), generator=torch.Generator().manual_seed(7))
    ref = generate(model, "sdpa", quant, ids)
    got = generate(model, "hf_pagedkv", quant, ids)
    assert counted, "no layer was read in place"
    assert torch.equal(ref[0], got[0])
    assert (ref[1] - got[1]).abs().max().item() <= QUANTIZED_LOGIT_ATOL


def _rotated_read(batch: int = 2, seed: int = 0, values: bool = False):
    """A `CodeRead` with rotated int4 keys (and rotated int4 values if `values`; 4 encoded 8-token blocks, 3 tail
    tokens, 1 sink token) and the K/V `[H, batch, 35, D]` that "de-rotate, then attend" sees (decoded K/V turned
    back, the tail and the sink)."""
    g = torch.Generator().manual_seed(seed)
    H, n, B, D = 2, 4, 8, 16
    kc, vc = RotatedCodec(make_codec("int4", "channel")), make_codec("int4", "token", D)
    vc = RotatedCodec(vc) if values else vc
    x = torch.randn(H, batch, n, B, D, generator=g) + 4 * torch.randn(H, 1, 1, 1, D, generator=g)
    y = torch.randn(H, batch, n, B, D, generator=g)
    (kcodes, kscales), (vcodes, vscales) = kc.encode(x), vc.encode(y)
    tail = [torch.randn(H, batch, 3, D, generator=g) for _ in range(2)]
    sink = [torch.randn(H, batch, 1, D, generator=g) for _ in range(2)]
    full = tuple(torch.cat((t, s), 2) for t, s in zip(tail, sink))
    read = CodeRead(0, 0, n * B + 3, B, (D, D), (kc, vc), (kcodes, vcodes), (kscales, vscales), full, 1)
    ref = []
    for codec, codes, scales, t, s in ((kc, kcodes, kscales, tail[0], sink[0]),
                                       (vc, vcodes, vscales, tail[1], sink[1])):
        dec = codec.decode(codes, scales, torch.empty(H, batch, n, B, D)).reshape(H, batch, n * B, D)
        dec[:, :, :1] = s
        ref.append(torch.cat((dec, t), 2))
    return read, ref[0], ref[1], kc.matrix(D, torch.float32, "cpu")


def test_rotated_query_equals_derotated_keys():
    """(q @ R) against the stored codes and the turned tail equals q against the de-rotated keys, in float64 terms
    within fp32 rounding; the codes are read as stored (the inner codec), never turned back."""
    read, k, v, r = _rotated_read()
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(1)) * 0.25
    want = torch.softmax(qh.double() @ k.double().transpose(-1, -2), -1) @ v.double()
    turned = rotate_code_read(read, r)
    assert turned.codecs[0] is read.codecs[0].inner and turned.codes is read.codes
    for tile in (8, 64):
        got = code_attention(qh @ r, turned, None, tile)
        assert (got.double() - want).abs().max().item() <= 1e-5, tile
    # without the turn, the scores are wrong: the test can fail
    wrong = code_attention(qh, turned, None, 64)
    assert (wrong.double() - want).abs().max().item() > 1e-2
    native = NativeCodeAttention()
    got = native(qh @ r, turned, None)
    if got is not None:  # the C read of the rotated codes (a compiler here)
        assert (got.double() - want).abs().max().item() <= 1e-5


def test_rotated_values_output_turned_back_equals_derotated_values():
    """Rotated values read as stored (`rotate_code_read` with the value rotation: the tail and sink values turned),
    the output turned back once by R.T, equal softmax(q k) @ (de-rotated values) within fp32 rounding, by the torch
    read in tiles and by the C read; without the turn back the output is wrong (the test can fail)."""
    read, k, v, r = _rotated_read(values=True)
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(2)) * 0.25
    want = torch.softmax(qh.double() @ k.double().transpose(-1, -2), -1) @ v.double()  # [H, batch, 3, D]
    turned = rotate_code_read(read, r, r)
    assert turned.codecs[1] is read.codecs[1].inner and turned.codes is read.codes
    torch.testing.assert_close(turned.full[1], read.full[1] @ r)  # tail and sink values in the codes' basis
    for tile in (8, 64):
        got = code_attention(qh @ r, turned, None, tile) @ r.T
        assert (got.double() - want).abs().max().item() <= 1e-5, tile
    stored = code_attention(qh @ r, turned, None, 64)  # not turned back: the rotated basis
    assert (stored.double() - want).abs().max().item() > 1e-2
    got = NativeCodeAttention()(qh @ r, turned, None)
    if got is not None:  # the C read of rotated int4 keys and values (a compiler here)
        assert ((got @ r.T).double() - want).abs().max().item() <= 1e-5
    keys_only = rotate_code_read(read, r)  # only the keys turned: the values' codec stays the rotated one
    assert keys_only.codecs[1] is read.codecs[1] and keys_only.full[1] is read.full[1]


def test_read_counts_name_the_path_and_every_fallback(caplog):
    """Rotated keys, 3-bit codes and fp8 codes with per-group scales are read by the C kernel (where it builds) as
    often as int4 codes are: no fallback, each path serving the reads it serves for k4v4; fp8 with one scale per
    block is a counted fallback to the torch read, logged once per format."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 21), generator=torch.Generator().manual_seed(8))
    c_builds = NativeCodeAttention().load() is not None
    path = "kernel-table" if c_builds else "torch-codes"
    names = {"k4v4": "int4/int4", "k4v4r": "int4+rot/int4", "k3v3r": "int3+rot/int3", "k4v3r": "int4+rot/int3",
             "k4ve4m3": "int4/fp8-e4m3", "k4ve4m3r": "int4+rot/fp8-e4m3", "ke5m2v4": "fp8-e5m2/int4"}
    paths = {}
    for quant, fmt in names.items():
        READ_COUNTS.reset()
        generate(model, "hf_pagedkv", quant, ids)
        snap = READ_COUNTS.snapshot()
        assert not snap["fallbacks"], (quant, snap)
        assert snap["served"].get(f"{path} {fmt}", 0) > 0, (quant, snap)
        paths[quant] = {k.replace(fmt, "F"): n for k, n in snap["served"].items()}
        assert paths[quant] == paths["k4v4"], (quant, paths)
    READ_COUNTS.reset()
    generate(model, "hf_pagedkv", "k4v4rv", ids)  # rotated values: the same kernels, the output turned back
    snap = READ_COUNTS.snapshot()
    assert not snap["fallbacks"], snap
    assert snap["served"].get(f"{path} int4+rot/int4+rot", 0) > 0, snap
    READ_COUNTS.reset()
    with caplog.at_level(logging.WARNING, logger="hf_pagedkv.attention.read_counts"):
        generate(model, "hf_pagedkv", "k4ve4m3b", ids)
    snap = READ_COUNTS.snapshot()
    fmt = "int4/fp8-e4m3-block"
    if c_builds:
        (reason, n), = snap["fallbacks"].items()
        assert reason == f"{fmt}: fp8 codes with one scale per block (fp8_scales='block') have no per-group form " \
                         "the C kernel reads" and n > 0
        assert n == snap["served"][f"torch-codes {fmt}"]
        assert sum(fmt in r.getMessage() for r in caplog.records) == 1  # logged once, counted always
    assert f"kernel-table {fmt}" not in snap["served"]
    READ_COUNTS.reset()
    assert READ_COUNTS.snapshot() == {"served": {}, "fallbacks": {}}
