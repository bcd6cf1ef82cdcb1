"""The opt-in compiled quantized read (``"hf_pagedkv_compiled"``, `CompiledCodeAttention`): its formula against
"de-quantize, then attend" in float64, the compiled function against the eager read, the eager fallback, and
generation through a model."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import hf_pagedkv.attention.attention_function as attention_function
import hf_pagedkv.attention.compiled_read as compiled_read
from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.attention import COMPILED_ATTENTION_NAME
from hf_pagedkv.attention.compiled_read import CompiledCodeAttention, fused_code_read
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import code_attention
from hf_pagedkv.storage.code_read import CodeRead
from tests.attention.test_paged_attention import _code_read
from tests.conftest import VOCAB, tiny_model

PAIRS = [("int4", "int4"), ("int8", "int4"), ("int8", "int8")]
#: tests that compile with inductor: about 80 s on this 2-core machine (a few graphs of 10-20 s each), so they run
#: only when asked: ``HF_PAGEDKV_COMPILE_TESTS=1 pytest -m compile``
compiles = [pytest.mark.compile,
            pytest.mark.skipif(os.environ.get("HF_PAGEDKV_COMPILE_TESTS") != "1",
                               reason="compiles with inductor (about 80 s); HF_PAGEDKV_COMPILE_TESTS=1 runs it")]


def _compiles(fn):
    for mark in compiles:
        fn = mark(fn)
    return fn


def _args(read: CodeRead, bias):
    kc, vc = read.codecs
    return (read.codes[0], read.scales[0], read.codes[1], read.scales[1], read.full[0], read.full[1], bias,
            kc.bits, vc.bits, read.block_size, read.sink_end - read.lo)


def _bias(batch: int, rows: int, width: int) -> torch.Tensor:
    """An additive mask `[1, batch, rows, width]`: row 1 of the batch does not attend to columns 5 .. 9."""
    bias = torch.zeros(1, batch, rows, width)
    bias[:, 1, :, 5:10] = float("-inf")
    return bias


@pytest.mark.parametrize("key_codec,value_codec", PAIRS)
@pytest.mark.parametrize("offset", [0.0, 8.0])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_formula_within_fp32_of_decoding(key_codec, value_codec, offset, masked):
    """`fused_code_read`, run eagerly (no compile), equals "de-quantize, then softmax" in float64 on the same codes
    (keys decoded, the sink token in full precision, the mask's -inf columns dropped) within 1e-5."""
    read, k, v = _code_read(key_codec, value_codec, batch=2, offset=offset)
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(1)) * 0.25  # [H, batch, rows, D]
    bias = _bias(2, 3, read.end - read.lo) if masked else None
    s = qh.double() @ k.double().transpose(-1, -2)  # [H, batch, rows, 36]: token order
    if masked:
        s = s + bias.double()
    want = torch.softmax(s, -1) @ v.double()
    assert CompiledCodeAttention.supports(read)
    got = fused_code_read(qh, *_args(read, bias))
    assert got.shape == want.shape == (2, 2, 3, 16)
    assert (got.double() - want).abs().max().item() <= 1e-5
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5


def test_supports_only_int8_int4_reads_from_the_first_block():
    read, _, _ = _code_read("int4", "int8", batch=1, offset=0.0)
    assert CompiledCodeAttention.supports(read)
    assert not CompiledCodeAttention.supports(_code_read("ref-int4", "ref-int4", batch=1, offset=0.0)[0])
    assert not CompiledCodeAttention.supports(read._replace(lo=3))  # a sliding window's cut first block
    assert CompiledCodeAttention()(torch.zeros(2, 1, 3, 16), read._replace(lo=3), None) is None


def test_compile_error_falls_back_to_eager_once(monkeypatch, caplog):
    """A compile error is logged once and turns the compiled path off; `paged_attention` then reads eagerly."""
    calls = []

    def broken(fn, **kw):
        calls.append(kw)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_read.torch, "compile", broken)
    read, _, _ = _code_read("int4", "int4", batch=2, offset=0.0)
    qh = torch.randn(2, 2, 3, 16)
    reader = CompiledCodeAttention()
    with caplog.at_level(logging.WARNING, logger=compiled_read.__name__):
        assert reader(qh, read, None) is None
        assert reader(qh, read, None) is None
    assert reader.failed and calls == [{"dynamic": True}]  # tried once
    assert sum("torch.compile of the quantized read failed" in r.getMessage() for r in caplog.records) == 1


@_compiles
def test_compiled_equals_eager_across_growing_reads():
    """The compiled function (one process-wide graph per batch class and mask) equals the eager read within 1e-5
    as the read grows block by block, with and without a mask, batch 1 and 2; reads that the graphs held serve
    are not let compile again."""
    torch._dynamo.reset()
    reader = CompiledCodeAttention()
    g = torch.Generator().manual_seed(3)
    for batch in (1, 2):
        full, _, _ = _code_read("int4", "int8", batch=batch, offset=4.0)
        for n in (2, 3, 4):  # encoded blocks: 16, 24, 32 tokens (+ 3 tail tokens)
            read = full._replace(codes=tuple(c[:, :, :n].contiguous() for c in full.codes),
                                 scales=tuple(s[:, :, :n].contiguous() for s in full.scales), end=n * 8 + 3)
            qh = torch.randn(2, batch, 3, 16, generator=g) * 0.25
            for bias in (None, _bias(batch, 3, read.end) if batch > 1 else None):
                got = reader(qh, read, bias)
                assert got is not None and not reader.failed
                assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5
    # the same reads again run the graphs held, without the config patches of a call that may compile
    compiled = reader.compile_calls
    assert 1 <= compiled <= 6  # at most one per batch class, mask and read shape seen above
    for batch in (1, 2):
        full, _, _ = _code_read("int4", "int8", batch=batch, offset=4.0)
        read = full._replace(codes=tuple(c[:, :, :3].contiguous() for c in full.codes),
                             scales=tuple(s[:, :, :3].contiguous() for s in full.scales), end=3 * 8 + 3)
        qh = torch.randn(2, batch, 3, 16, generator=g) * 0.25
        assert (reader(qh, read, None) - code_attention(qh, read, None, 2048)).abs().max().item() <= 1e-5
    assert reader.compile_calls == compiled


@_compiles
@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_generation_matches_the_eager_read(quant, monkeypatch):
    """Greedy generation through ``"hf_pagedkv_compiled"``, its C read turned off so that the `torch.compile`d one
    serves, gives the tokens of ``"hf_pagedkv"`` and logits within 1e-4 (the same codes are written: the first
    layer of each step is `sdpa` in both)."""
    off = NativeCodeAttention()
    off.failed = True  # as on a machine without a C compiler: both C reads decline
    monkeypatch.setattr(attention_function, "NATIVE_READ", off)
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    out = {}
    for impl in ("hf_pagedkv", COMPILED_ATTENTION_NAME):
        model.set_attn_implementation(impl)
        try:
            cache = PagedCache(config=model.config, quant=quant, block_size=8)
            with torch.no_grad():
                res = model.generate(ids, **cache_kwargs(cache), do_sample=False, max_new_tokens=6,
                                     output_logits=True, return_dict_in_generate=True)
            cache.release()
        finally:
            model.set_attn_implementation("sdpa")
        out[impl] = res.sequences, torch.stack(res.logits, 1)
    (ids_e, logits_e), (ids_c, logits_c) = out.values()
    assert torch.equal(ids_e, ids_c)
    assert (logits_e - logits_c).abs().max().item() <= 1e-4
    reader = attention_function.COMPILED_READ  # the process-wide reader "hf_pagedkv_compiled" uses
    assert reader.compile_calls and not reader.failed  # it compiled and ran


def test_fused_formula_gives_zero_to_a_row_masked_everywhere():
    """A query row that attends to nothing (a padding position) gets 0 from `fused_code_read`, as `sdpa` and the
    eager read give; the other rows the eager read's result within 1e-5."""
    read, _, _ = _code_read("int4", "int8", batch=2, offset=0.0)
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(2)) * 0.25
    bias = _bias(2, 3, read.end - read.lo)
    bias[:, 0, 2] = float("-inf")
    got = fused_code_read(qh, *_args(read, bias))
    assert torch.equal(got[:, 0, 2], torch.zeros(2, 16))
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5


def test_half_precision_queries_read_eagerly_without_a_compile():
    """bf16 and fp16 queries (a half-precision model over a quantized pool): None, before any compile (the formula
    decodes into fp32, and compiling it for half precision fails with torch's traceback), and the reader stays
    on for fp32 reads."""
    read, _, _ = _code_read("int4", "int8", batch=2, offset=0.0)
    reader = CompiledCodeAttention()
    for dtype in (torch.bfloat16, torch.float16):
        assert reader(torch.zeros(2, 2, 3, 16, dtype=dtype), read, None) is None
    assert not reader.failed and not reader.compile_calls
