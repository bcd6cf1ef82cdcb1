"""The quantized read in C (`NativeCodeAttention`, the first read of ``"hf_pagedkv_compiled"``): its result against
"de-quantize, then attend" in float64 and against the eager read, the reads it refuses, no compiler, and generation
through a model."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

import hf_pagedkv.attention.attention_function as attention_function
import hf_pagedkv.attention.native_read as native_read
from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.attention import COMPILED_ATTENTION_NAME
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import code_attention, paged_attention
from tests.attention.test_compiled_read import PAIRS, _bias
from tests.attention.test_paged_attention import _code_read
from tests.conftest import VOCAB, tiny_model

READER = NativeCodeAttention()
needs_compiler = pytest.mark.skipif(READER.load() is None, reason="no C compiler here: the native read is off")
#: key and value codecs the C read takes beyond `PAIRS` (the `torch.compile`d read's): 3-bit and 2-bit codes, fp8
#: with per-group scales (per channel for keys, per token for values)
NATIVE_PAIRS = PAIRS + [("int3", "int3"), ("int4", "int3"), ("int3", "int8"), ("int2", "int2"),
                        ("int4", "fp8-e4m3"), ("int8", "fp8-e5m2"), ("fp8-e5m2", "int4"), ("fp8-e4m3", "fp8-e4m3")]


@needs_compiler
@pytest.mark.parametrize("key_codec,value_codec", NATIVE_PAIRS)
@pytest.mark.parametrize("offset", [0.0, 8.0])
@pytest.mark.parametrize("mask", [None, "rows", "broadcast"])
@pytest.mark.parametrize("fit", ["minmax", "mse"])
def test_native_read_within_fp32_of_decoding(key_codec, value_codec, offset, mask, fit):
    """The C read equals "de-quantize, then softmax" in float64 on the same codes (keys decoded, the sink token in
    full precision, the mask's -inf columns dropped) within 1e-5, and the eager read within 1e-5; with a mask per
    query row and one shared by the rows (`[1, batch, 1, width]`); codes of either range fit (`make_codec`)."""
    read, k, v = _code_read(key_codec, value_codec, batch=2, offset=offset, fit=fit)
    qh = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(1)) * 0.25  # [H, batch, rows, D]
    bias = None if mask is None else _bias(2, 3 if mask == "rows" else 1, read.end - read.lo)
    if mask == "rows":  # each query row its own mask: row r of batch row 0 does not attend to column 20 + r
        for r in range(3):
            bias[:, 0, r, 20 + r] = float("-inf")
    s = qh.double() @ k.double().transpose(-1, -2)  # [H, batch, rows, 36]: token order
    if bias is not None:
        s = s + bias.double()
    want = torch.softmax(s, -1) @ v.double()
    got = READER(qh, read, bias)
    assert got is not None and got.shape == want.shape == (2, 2, 3, 16)
    assert (got.double() - want).abs().max().item() <= 1e-5
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5


def _codes_as_values(name: str, block_size: int, dim: int, g: torch.Generator):
    """Value codes of `name` for one block of one head, `[1, 1, 1, code_size]` bytes, unit scales and zero minimums
    `[1, 1, 1, scale_size]`, and the codes' values `[block_size, dim]` as the codec reads them (`unpack`). fp8: every
    finite byte once (the rest 0); the integer codecs: random codes."""
    from hf_pagedkv.storage.codecs import make_codec

    codec = make_codec(name, "token", group_size=dim)
    if name.startswith("fp8"):
        codes = torch.arange(256, dtype=torch.uint8)
        finite = torch.isfinite(codes.view(codec.dtype).float())
        codes = torch.where(finite, codes, torch.zeros_like(codes))
        assert block_size * dim == 256 and int(finite.sum()) >= 248
        scales = torch.ones(block_size, dtype=torch.float16)
    elif name == "int8":
        codes = torch.randint(-127, 128, (block_size * dim,), generator=g, dtype=torch.int8).view(torch.uint8)
        scales = torch.ones(block_size, dtype=torch.float16)
    else:
        q = torch.randint(0, 2**codec.bits, (block_size, dim), generator=g, dtype=torch.int32)
        codes = codec.pack(q).flatten()
        scales = torch.cat((torch.ones(block_size), torch.zeros(block_size))).half()  # [scales | minimums]
    values = codec.unpack(codes, torch.empty(block_size, dim))  # [block_size, dim]
    return codec, codes.view(1, 1, 1, -1), scales.view(1, 1, 1, -1), values


@needs_compiler
@pytest.mark.parametrize("name", ["fp8-e4m3", "fp8-e5m2", "int8", "int4", "int3", "int2"])
def test_native_read_decodes_every_code_exactly(name):
    """Each code's value as the codec reads it, bit for bit: one block of 16 tokens x 16 channels as values (unit
    scales, zero minimums), each query row attending to one token only (a mask of -inf elsewhere): row `t` of the
    output is token `t`'s codes decoded (its probability exactly 1, the others exactly 0). For fp8 the block holds
    every finite byte (subnormals, both zeros, the largest magnitudes)."""
    from hf_pagedkv.storage.code_read import CodeRead
    from hf_pagedkv.storage.codecs import make_codec

    bs = D = 16
    g = torch.Generator().manual_seed(21)
    vcodec, vcodes, vscales, values = _codes_as_values(name, bs, D, g)
    kcodec = make_codec("int8", "channel")
    kcodes, kscales = kcodec.encode(torch.randn(1, 1, 1, bs, D, generator=g))
    full = torch.zeros(1, 1, 0, D)
    read = CodeRead(0, 0, bs, bs, (D, D), (kcodec, vcodec), (kcodes, vcodes), (kscales, vscales), (full, full), 0)
    bias = torch.full((1, 1, bs, bs), float("-inf"))
    bias[0, 0].fill_diagonal_(0.0)  # query row t attends to token t only
    got = READER(torch.randn(1, 1, bs, D, generator=g), read, bias)
    assert got is not None and torch.equal(got[0, 0], values)
    assert values.abs().max().item() > 0


@needs_compiler
@pytest.mark.parametrize("name", ["int3", "int2"])
@pytest.mark.parametrize("block_size,dim", [(8, 64), (32, 80), (8, 144), (16, 48)])
def test_native_read_decodes_bit_planes_exactly_at_every_width(name, block_size, dim):
    """3-bit and 2-bit value codes over two blocks at head dims read 64 codes a step (64, 144 = 2 x 64 + 16), a step
    and a rest (80) and in vectors only (48), with one and with several row groups per block (8, 16, 32 tokens): each
    query row attending to one token only, row `t` of the output is token `t`'s codes as the codec decodes them, bit
    for bit, across the block boundary."""
    from hf_pagedkv.storage.code_read import CodeRead
    from hf_pagedkv.storage.codecs import make_codec

    g = torch.Generator().manual_seed(22)
    n, bs, D = 2, block_size, dim
    vcodec, kcodec = make_codec(name, "token", group_size=D), make_codec("int8", "channel")
    q = torch.randint(0, 2**vcodec.bits, (n, bs, D), generator=g, dtype=torch.int32)
    vcodes = vcodec.pack(q).reshape(1, 1, n, -1)
    assert vcodes.shape[-1] == bs * D * vcodec.bits // 8
    values = vcodec.unpack(vcodes, torch.empty(1, 1, n, bs, D)).reshape(n * bs, D)
    assert torch.equal(values, q.reshape(n * bs, D).float())
    vscales = torch.cat((torch.ones(n, bs), torch.zeros(n, bs)), 1).half().view(1, 1, n, 2 * bs)
    kcodes, kscales = kcodec.encode(torch.randn(1, 1, n, bs, D, generator=g))
    full = torch.zeros(1, 1, 0, D)
    read = CodeRead(0, 0, n * bs, bs, (D, D), (kcodec, vcodec), (kcodes, vcodes), (kscales, vscales), (full, full), 0)
    bias = torch.full((1, 1, n * bs, n * bs), float("-inf"))
    bias[0, 0].fill_diagonal_(0.0)  # query row t attends to token t only
    got = READER(torch.randn(1, 1, n * bs, D, generator=g), read, bias)
    assert got is not None and torch.equal(got[0, 0], values)


@needs_compiler
@pytest.mark.parametrize("names", [("int3", "int3"), ("int4", "int3"), ("int2", "int2")])
@pytest.mark.parametrize("dim", [64, 80])
def test_native_read_of_bit_planes_at_wide_heads_within_fp32_of_decoding(names, dim):
    """3-bit and 2-bit keys and values at head dims read 64 codes a step (64) and a step and a rest (80): three
    32-token blocks, an odd 5-token tail and one sink token, keys with outlier channels, a mask: "de-quantize, then
    softmax" in float64 within 1e-5."""
    g = torch.Generator().manual_seed(23)
    H, batch, D = 2, 2, dim
    read, *ref = _code_read(*names, batch=batch, offset=8.0, seed=23, n=3, B=32, D=D, tail_len=5)
    ref = [r.double() for r in ref]
    qh = torch.randn(H, batch, 3, D, generator=g) * 0.1
    bias = torch.zeros(1, batch, 3, read.end)
    bias[:, 1, :, :40] = float("-inf")  # left padding of batch row 1, past the first block boundary
    want = torch.softmax(qh.double() @ ref[0].transpose(-1, -2) + bias.double(), -1) @ ref[1]
    got = READER(qh, read, bias)
    assert got is not None and got.shape == want.shape == (H, batch, 3, D)
    assert (got.double() - want).abs().max().item() <= 1e-5


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_native_read_of_strided_codes_on_threads(threads):
    """Codes and scales as views of larger arrays (a pool's consecutive blocks: strided along the blocks), a batch
    of 3 split over OpenMP threads: the eager read's result within 1e-5."""
    full, _, _ = _code_read("int4", "int8", batch=3, offset=4.0, seed=2)
    read = full._replace(codes=tuple(c[:, :, :3] for c in full.codes),
                         scales=tuple(s[:, :, :3] for s in full.scales), end=3 * 8 + 3)
    assert not read.codes[0].is_contiguous()
    qh = torch.randn(2, 3, 3, 16, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = READER(qh, read, None)
    finally:
        torch.set_num_threads(before)
    assert got is not None
    assert (got - code_attention(qh, read, None, 2048)).abs().max().item() <= 1e-5


def test_refuses_what_it_does_not_compute():
    """Other codecs (the reference codec, fp8 with one scale per block), a sliding window's cut first block, head
    dims not a multiple of 16, fp64 queries, shapes that disagree with the read (the C side trusts them) and masks
    of another width: None, the caller reads eagerly."""
    read, _, _ = _code_read("int4", "int8", batch=2, offset=0.0)
    qh = torch.zeros(2, 2, 3, 16)
    assert NativeCodeAttention.supports(qh, read, None)
    assert NativeCodeAttention.supports(qh, read, _bias(2, 3, read.end))
    refused = [
        (qh, _code_read("ref-int4", "ref-int4", batch=2, offset=0.0)[0], None),
        (qh, _code_read("int4", "fp8-e4m3-block", batch=2, offset=0.0)[0], None),  # one scale per block
        (qh, _code_read("fp8-e5m2-block", "int4", batch=2, offset=0.0)[0], None),
        (qh, read._replace(lo=3), None),
        (qh.double(), read, None),
        (torch.zeros(2, 2, 3, 8), read._replace(dims=(8, 8)), None),
        (torch.zeros(2, 3, 3, 16), read, None),  # a batch the read does not have
        (qh, read._replace(end=read.end + 1), None),  # one token more than the tail holds
        (qh, read, _bias(2, 3, read.end + 1)),
        (qh, read, _bias(2, 2, read.end)),
    ]
    for q, r, b in refused:
        assert not NativeCodeAttention.supports(q, r, b)
        assert NativeCodeAttention()(q, r, b) is None


def test_unread_codecs_name_why():
    """`unread_codecs`: None for the codecs the C read takes; else the reason a fallback is counted under."""
    from hf_pagedkv.storage.codecs import RotatedCodec, make_codec

    for k, v in [("int8", "int8"), ("int4", "int3"), ("int3", "fp8-e5m2"), ("fp8-e4m3", "int2")]:
        assert native_read.unread_codecs((make_codec(k, "channel"), make_codec(v, "token")), (64, 64)) is None
    int4k, int4v = make_codec("int4", "channel"), make_codec("int4", "token")
    cases = [((int4k, make_codec("fp8-e4m3-block", "token")), (64, 64), "one scale per block"),
             ((make_codec("ref-int4", "channel"), int4v), (64, 64), "reads int8/int4/int3/int2 codes"),
             ((RotatedCodec(int4k), int4v), (64, 64), "reads int8/int4/int3/int2 codes"),  # turned: inner codec
             ((int4k, make_codec("int4", "token", group_size=32)), (64, 64), "one group per head"),
             ((int4k, make_codec("int4", "channel")), (64, 64), "values per token"),
             ((int4k, int4v), (64, 32), "head dims equal")]
    for codecs, dims, why in cases:
        assert why in native_read.unread_codecs(codecs, dims)


@pytest.mark.parametrize("names", [("int4", "int4"), ("int3", "fp8-e4m3")])
def test_no_compiler_turns_it_off_once(names, monkeypatch, tmp_path, caplog):
    """Without a C compiler (and no library built before) the read logs one warning and stays off; the
    ``"hf_pagedkv_compiled"`` read then goes on to its other engines."""
    monkeypatch.setenv("HF_PAGEDKV_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native_read.shutil, "which", lambda name: None)
    read, _, _ = _code_read(*names, batch=2, offset=0.0)
    qh = torch.randn(2, 2, 3, 16)
    reader = NativeCodeAttention()
    with caplog.at_level(logging.WARNING, logger=native_read.__name__):
        assert reader(qh, read, None) is None
        assert reader(qh, read, None) is None
    assert reader.failed and not list(tmp_path.iterdir())
    assert sum("native quantized read is off" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    """A compiler that fails: `build` raises with its output, and leaves no file behind."""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        native_read.build(tmp_path / "x.so")
    assert not list(tmp_path.iterdir())


class _Recording(NativeCodeAttention):
    """The C reads, recording which one served each quantized read: "table" (`read_view`), "view" (`__call__`),
    and for each table read whether it turned the query in C (`turned`: rotated keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.turned: list[bool] = []

    def read_table(self, qh, table, bias, rotation=None):
        out = super().read_table(qh, table, bias, rotation)
        self.turned.append(rotation is not None)
        return out

    def read_view(self, qh, view, bias):
        out = super().read_view(qh, view, bias)
        if out is not None:
            self.reads.append("table")
        return out

    def __call__(self, qh, read, bias):
        out = super().__call__(qh, read, bias)
        self.reads.append("view" if out is not None else "none")
        return out


@needs_compiler
@pytest.mark.parametrize("quant", ["k8v4", "k4v4", "k8v8", "k3v3r", "k4ve4m3"])
def test_generation_matches_the_eager_read(quant, monkeypatch):
    """Greedy generation through ``"hf_pagedkv_compiled"``, its quantized reads all in C (the `torch.compile`d
    engine made to fail if reached), gives the tokens of ``"hf_pagedkv"`` and logits within 1e-4 (the same codes
    are written; the first decode step's first layer is `sdpa` in both); a batch of 2 with left padding."""
    calls = []
    monkeypatch.setattr(attention_function, "COMPILED_READ", lambda *a: calls.append(a))
    native = _Recording()
    monkeypatch.setattr(attention_function, "NATIVE_READ", native)
    generate_eager_and_compiled(quant, block_size=8)
    # every quantized read was a C one, through the block table (4 layers, batch 2: one segment, staged tails)
    assert native.reads and native.reads.count("table") == len(native.reads) and not calls


def greedy(model, impl: str, make_cache, ids: torch.Tensor, mask: torch.Tensor | None = None) -> tuple:
    """Greedy generation of 6 tokens through the attention `impl` with the cache `make_cache()` (a `PagedCache`'s
    invariants checked, then released): `(sequences, logits [batch, 6, vocab])`."""
    model.set_attn_implementation(impl)
    try:
        cache = make_cache()
        with torch.no_grad():
            res = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), do_sample=False, max_new_tokens=6,
                                 output_logits=True, return_dict_in_generate=True)
        if isinstance(cache, PagedCache):
            cache.check_invariants()
            cache.release()
    finally:
        model.set_attn_implementation("sdpa")
    return res.sequences, torch.stack(res.logits, 1)


def generate_eager_and_compiled(quant: str, block_size: int) -> None:
    """Greedy generation on a tiny Llama, a batch of 2 with left padding, through ``"hf_pagedkv"`` and then
    ``"hf_pagedkv_compiled"``: the same tokens, logits within 1e-4 (the same codes are written; the first decode
    step's first layer is `sdpa` in both)."""
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    make = lambda: PagedCache(config=model.config, quant=quant, block_size=block_size)  # noqa: E731
    (ids_e, logits_e), (ids_c, logits_c) = (greedy(model, impl, make, ids, mask)
                                            for impl in ("hf_pagedkv", COMPILED_ATTENTION_NAME))
    assert torch.equal(ids_e, ids_c)
    assert (logits_e - logits_c).abs().max().item() <= 1e-4


@needs_compiler
@pytest.mark.parametrize("names", [("int8", "int8"), ("int8", "int4"), ("int4", "int4"), ("int3", "int3"),
                                   ("int4", "fp8-e4m3"), ("int4", "fp8-e5m2")])
def test_native_read_at_model_sizes(names):
    """SmolLM2's sizes (3 key/value heads, 3 query rows each, head_dim 64) in 32-token blocks, 2,048 encoded tokens,
    a 5-token tail and 4 sink tokens, batch 2 with a mask: the eager read's result within 1e-5."""
    from hf_pagedkv.storage.code_read import CodeRead
    from hf_pagedkv.storage.codecs import make_codec

    g = torch.Generator().manual_seed(6)
    H, batch, n, bs, D = 3, 2, 64, 32, 64
    kc, vc = make_codec(names[0], "channel"), make_codec(names[1], "token", group_size=D)
    (kcodes, kscales), (vcodes, vscales) = (c.encode(torch.randn(H, batch, n, bs, D, generator=g)) for c in (kc, vc))
    full = tuple(torch.randn(H, batch, 9, D, generator=g) for _ in range(2))  # 5 tail, then 4 sink tokens
    read = CodeRead(0, 0, n * bs + 5, bs, (D, D), (kc, vc), (kcodes, vcodes), (kscales, vscales), full, 4)
    qh = torch.randn(H, batch, 3, D, generator=g) * 0.3
    bias = torch.zeros(1, batch, 3, read.end)
    bias[:, 1, :, :100] = float("-inf")  # left padding of batch row 1
    got = READER(qh, read, bias)
    assert got is not None
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5


def test_a_corrupted_library_is_built_again(monkeypatch, tmp_path):
    """A cached library that does not load (garbage bytes where the file was) is built again and then used."""
    monkeypatch.setenv("HF_PAGEDKV_NATIVE_DIR", str(tmp_path))
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    path = native_read.library_path()
    path.write_bytes(b"not a shared library")
    reader = NativeCodeAttention()
    assert reader.load() is not None and not reader.failed
    assert path.read_bytes() != b"not a shared library"


@needs_compiler
@pytest.mark.parametrize("quant,block_size", [("k8v8", 4), ("k8v4", 4), ("k4v4", 4), ("k3v3r", 8), ("k4v3", 8),
                                              ("k4ve4m3", 4), ("ke5m2ve5m2", 4), ("k2v2", 4)])
@pytest.mark.parametrize("prompt", [22, 24])
def test_table_read_equals_the_gathered_read(quant, block_size, prompt):
    """The C read through block ids (`read_table`: the pool's codes, each row's staged partial block, the step's
    token and the sink token where they lie) on 3 rows whose decode blocks interleave in a fixed pool gives the C
    read of the gathered `CodeRead` bit for bit (the same sums in the same order), and the eager read within 1e-5;
    a 22-token prompt leaves a staged partial block, 24 none before the step's token in 4-token blocks (3-bit codes
    pack 8 tokens: 8-token blocks, 4 staged)."""
    from hf_pagedkv import BlockPool, QuantConfig
    from hf_pagedkv.attention import PagedView

    cache = PagedCache(pool=BlockPool(block_size=block_size, num_blocks=40, quant=QuantConfig.preset(quant)))
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for q in (prompt,) + (1,) * 12:
            k = torch.randn(3, 2, q, 16, generator=g)
            for layer in (0, 1):
                cache.update(k, k + 1, layer)
        k = torch.randn(3, 2, 1, 16, generator=g)
        view = PagedView.of(cache.update(k, k * 0.5, 0)[0])
    table, read = view.code_table(), view.code_read()
    assert table is not None and read is not None
    ids = table.ids
    assert ids.shape == (3, (prompt + 12) // block_size) and (ids[:, 1:] - ids[:, :-1] != 1).any()  # out of order
    assert table.rest == (prompt + 12) % block_size and table.new is not None and table.sink_end == 1
    qh = torch.randn(2, 3, 2, 16, generator=g) * 0.3  # [H, batch, rows, D]
    bias = _bias(3, 2, table.end - table.lo)
    bias[:, 1, :, 5] = float("-inf")
    got = READER.read_table(qh, table, bias)
    assert got is not None and torch.equal(got, READER(qh, read, bias))
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5
    cache.check_invariants()
    cache.release()


@needs_compiler
@pytest.mark.parametrize("quant", ["k3v3r", "k4v3r", "k4v4rv"])
def test_rotated_keys_read_with_the_query_turned_in_c(quant):
    """Rotated keys read through block ids (`read_view`) from the query in the model's basis: the C side turns the
    query rows for the codes and scores the full-precision keys (a staged partial block, the step's token, the sink
    token) as they lie, none turned (`code_table(turn_keys=False)`); within 1e-5 of the read of the query turned by
    torch over the table whose keys were turned, and of the eager read of that query. The values as stored (turned
    for `rv`)."""
    from hf_pagedkv import BlockPool, QuantConfig
    from hf_pagedkv.attention import PagedView

    cache = PagedCache(pool=BlockPool(block_size=8, num_blocks=40, quant=QuantConfig.preset(quant)))
    g = torch.Generator().manual_seed(24)
    with torch.no_grad():
        for q in (19, 1, 1, 1):  # 22 tokens: two encoded blocks, 6 staged
            k = torch.randn(3, 2, q, 16, generator=g)
            cache.update(k, k * 0.5 + 1, 0)
        view = PagedView.of(cache.update(torch.randn(3, 2, 1, 16, generator=g), torch.randn(3, 2, 1, 16), 0)[0])
    rotation = view.key_rotation()
    turned, kept = view.code_table(), view.code_table(turn_keys=False)
    assert rotation is not None and turned.rest == 6 and turned.sink_end == 1
    assert kept.codecs == turned.codecs and not kept.codecs[0].name.endswith("rot")
    for part in ("staged", "new", "sinks"):
        t, k = getattr(turned, part), getattr(kept, part)
        assert torch.allclose(k[0] @ rotation, t[0], atol=1e-5) and not torch.allclose(k[0], t[0], atol=1e-2)
        assert torch.equal(k[1], t[1])  # values: turned (rv) or not alike
    qh = torch.randn(2, 3, 2, 16, generator=g) * 0.3  # [H, batch, rows, D]: the query in the model's basis
    qr = qh @ rotation
    bias = _bias(3, 2, turned.end - turned.lo)
    got = READER.read_view(qh, view, bias)
    assert got is not None and torch.equal(got, READER.read_table(qh, kept, bias, rotation))
    assert (got - READER.read_table(qr, turned, bias)).abs().max().item() <= 1e-5
    assert (got - code_attention(qr, view.code_read(), bias, 2048)).abs().max().item() <= 1e-5
    assert (got - READER.read_table(qh, turned, bias)).abs().max().item() > 1e-3  # (the turn matters)
    cache.check_invariants()
    cache.release()


@needs_compiler
def test_table_read_of_a_grown_pool():
    """A growable pool that grew into several storage segments while a row was written: `read_table` finds each
    block id's segment, and gives the gathered read bit for bit."""
    from hf_pagedkv import BlockPool, QuantConfig
    from hf_pagedkv.attention import PagedView

    cache = PagedCache(pool=BlockPool(block_size=4, quant=QuantConfig.preset("k4v4")))
    g = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for q in (30, 70, 1):
            k = torch.randn(2, 2, q, 16, generator=g)
            view = PagedView.of(cache.update(k, k - 1, 0)[0])
    table, read = view.code_table(), view.code_read()
    assert len(table.codes[0].segments) > 1 and table.num_encoded == 25
    qh = torch.randn(2, 2, 2, 16, generator=g) * 0.3
    got = READER.read_table(qh, table, None)
    assert got is not None and torch.equal(got, READER(qh, read, None))
    cache.check_invariants()
    cache.release()


@needs_compiler
def test_table_read_declines_a_window_start():
    """A sliding window's read starts inside a block: `code_table` is None, and ``"hf_pagedkv_compiled"`` reads
    the gathered way; greedy tokens of the eager ``"hf_pagedkv"`` on a sliding-window model (Gemma 3, window 8)."""
    model = tiny_model("gemma3")
    ids = torch.randint(1, VOCAB, (1, 21), generator=torch.Generator().manual_seed(15))
    tokens, tables = {}, []
    real = NativeCodeAttention.read_view
    for impl in ("hf_pagedkv", COMPILED_ATTENTION_NAME):
        model.set_attn_implementation(impl)
        try:
            c = PagedCache(config=model.config, quant="k8v8", block_size=4)
            with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
                mp.setattr(NativeCodeAttention, "read_view",
                           lambda self, qh, view, bias: tables.append((view.lo, view.code_table())) or real(
                               self, qh, view, bias))
                tokens[impl] = model.generate(ids, **cache_kwargs(c), do_sample=False, max_new_tokens=5)
            c.check_invariants()
            c.release()
        finally:
            model.set_attn_implementation("sdpa")
    assert torch.equal(*tokens.values())
    windowed = [t for lo, t in tables if lo % 4]
    assert windowed and all(t is None for t in windowed)
    assert any(t is not None for lo, t in tables if lo == 0)  # the full-attention layers follow the table


@needs_compiler
def test_pool_description_follows_the_pool_between_reads():
    """`read_table` keeps each pool's C description (`_pool_segments`) across calls: after the pool grows a storage
    segment, and for a new cache's pool, the same reader reads every block where it now lies (the gathered read bit
    for bit); the entries hold the pools weakly."""
    import gc
    import weakref

    from hf_pagedkv import BlockPool, QuantConfig
    from hf_pagedkv.attention import PagedView

    reader = NativeCodeAttention()
    g = torch.Generator().manual_seed(21)
    for _ in range(2):  # the second cache's pool may reuse the first's addresses and ids
        cache = PagedCache(pool=BlockPool(block_size=4, quant=QuantConfig.preset("k8v4")))
        with torch.no_grad():
            for q in (9, 1, 70, 1):  # one segment at the first read, several at the second
                k = torch.randn(2, 2, q, 16, generator=g)
                view = PagedView.of(cache.update(k, k - 1, 0)[0])
                if q == 1:
                    table, read = view.code_table(), view.code_read()
                    qh = torch.randn(2, 2, 2, 16, generator=g) * 0.3
                    got = reader.read_table(qh, table, None)
                    assert got is not None and torch.equal(got, reader(qh, read, None))
        assert len(table.codes[0].segments) > 1
        pool = weakref.ref(table.codes[0])
        cache.release()
        del cache, view, table, read
        gc.collect()
        assert pool() is None  # the reader's entry did not keep the released pool alive


def test_views_of_a_step_share_one_layout_and_a_mid_step_unshare_gets_its_own():
    """The layers of a step read the same blocks: their `CodeTable`s share the step's `CodeLayout` (one block-id
    tensor). When duplicate rows (num_return_sequences) differ in a later layer, the row gets its own blocks in
    the middle of the step: that layer's table is the store's fresh one, not the memo of the tables before."""
    from hf_pagedkv import BlockPool, QuantConfig
    from hf_pagedkv.attention import PagedView
    from hf_pagedkv.storage.read_request import ReadRequest

    cache = PagedCache(pool=BlockPool(block_size=4, num_blocks=64, quant=QuantConfig.preset("k4v4")))
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        k = torch.randn(1, 2, 9, 16, generator=g)  # then 10, 11: a staged partial block in each step
        for layer in (0, 1, 2):
            cache.update(k, k + 1, layer)
        k = torch.randn(1, 2, 1, 16, generator=g)
        tables = [PagedView.of(cache.update(k, k + 1, layer)[0]).code_table() for layer in (0, 1)]
        assert tables[0].ids is tables[1].ids and tables[0].stage is tables[1].stage
        cache.update(k, k + 1, 2)
        k = torch.randn(1, 2, 1, 16, generator=g).expand(2, 2, 1, 16).contiguous()  # two identical rows
        first = PagedView.of(cache.update(k, k + 1, 0)[0]).code_table()
        k = k.clone()
        k[1] += 1  # row 1 differs from layer 1 on: unshared mid-step
        view = PagedView.of(cache.update(k, k + 1, 1)[0])
        table = view.code_table()
        fresh = cache.pool.groups[0].store.code_table(1, ReadRequest(view.table, view.lo, view.end, 4, None,
                                                                     view.new))
        assert not torch.equal(first.stage, fresh.stage)
        assert torch.equal(table.ids, fresh.ids) and torch.equal(table.stage, fresh.stage)
        cache.update(k, k + 1, 2)
    cache.check_invariants()
    cache.release()


# -- full-precision pools ---------------------------------------------------------------------------------------------

def _fp_view(batch: int, prompt: int, steps: int, seed: int, lo: int = 0, num_blocks: int | None = 200):
    """A fp32 `PagedCache` (blocks of 4 tokens) whose `batch` rows took a `prompt` and `steps` decode steps in two
    layers (rows > 1: their decode blocks interleave), then one more token in layer 0: that step's `PagedView`
    read from token `lo` on, and the keys and values the cache returned (`[batch, 2, end, 16]`)."""
    from hf_pagedkv import BlockPool
    from hf_pagedkv.attention import PagedView

    cache = PagedCache(pool=BlockPool(block_size=4, num_blocks=num_blocks))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in (prompt,) + (1,) * steps:
            k = torch.randn(batch, 2, q, 16, generator=g)
            for layer in (0, 1):
                cache.update(k, k * 2 + 1, layer)
        k = torch.randn(batch, 2, 1, 16, generator=g)
        keys, values = cache.update(k, k - 1, 0)
    v = PagedView.of(keys)
    view = PagedView(v.store, v.layer_idx, v.table, lo, v.end, v.base, v.new, v.materialize, v.confirm)
    return cache, view, keys, values


def _pool_tensors(view) -> list:
    """The layer's pool storage, keys' segments then values'."""
    store = view.store
    return [*store.keys[view.layer_idx].segments, *store.values[view.layer_idx].segments]


def _attend64(qh, keys, values, lo, bias):
    """`sdpa` in float64 over the returned K/V from token `lo` on: `[H, batch, rows, 16]`."""
    k, v = (t[:, :, lo:].transpose(0, 1).double() for t in (keys, values))
    return torch.nn.functional.scaled_dot_product_attention(
        qh.double(), k, v, attn_mask=None if bias is None else bias.double(), scale=1.0)


@needs_compiler
@pytest.mark.parametrize("batch,prompt,steps", [(1, 37, 3), (3, 22, 12), (2, 16, 0)])
@pytest.mark.parametrize("lo", [0, 3, 8])
@pytest.mark.parametrize("mask", [None, "rows", "broadcast"])
def test_fp_table_read_within_fp32_of_sdpa(batch, prompt, steps, lo, mask):
    """The C read of a fp32 pool through block ids (`read_fp_view`): one row in consecutive blocks, 3 rows whose
    decode blocks interleave, a read from inside a block (a sliding window: `lo` 3) and from a block boundary (8),
    a prompt that ends on a block boundary; `sdpa` in float64 over the K/V the cache returned within 1e-5, and
    the eager in-place read (`paged_attention`) within 1e-5; a mask per query row and one shared by the rows."""
    cache, view, keys, values = _fp_view(batch, prompt, steps, seed=batch + lo, lo=lo)
    g = torch.Generator().manual_seed(31)
    qh = torch.randn(2, batch, 3, 16, generator=g) * 0.5  # [H, batch, rows, D]
    bias = None if mask is None else torch.zeros(1, batch, 3 if mask == "rows" else 1, view.end - lo)
    if bias is not None:
        bias[:, -1, :, :4] = float("-inf")  # the last row does not attend to columns 0 .. 3 (left padding)
    if mask == "rows":
        bias[:, 0, 1, 2] = float("-inf")  # row 1 of batch row 0 does not attend to column 2
    got = READER.read_fp_view(qh, view, bias)
    assert got is not None and got.shape == (2, batch, 3, 16)
    assert (got.double() - _attend64(qh, keys, values, lo, bias)).abs().max().item() <= 1e-5
    if mask != "rows":  # the eager read takes a mask per query token ([batch, 1, q, n]), not per query row
        query = qh.view(2, batch, 3, 1, 16).transpose(0, 1).reshape(batch, 6, 1, 16)  # G = 3 query heads per KV head
        keep = None if bias is None else (bias[0, :, :1] == 0).unsqueeze(1)  # [batch, 1, 1, n], True = attend
        eager = paged_attention(query, view, 1.0, keep)  # [batch, 1, 6, 16]
        assert (got - eager.view(batch, 2, 3, 16).transpose(0, 1)).abs().max().item() <= 1e-5
    cache.check_invariants()
    cache.release()


@needs_compiler
def test_fp_table_read_of_a_grown_pool():
    """A growable fp32 pool that grew into several storage segments while two rows were written: the C read finds
    each block id's segment (`sdpa` in float64 within 1e-5), and keeps no description of a pool that grew since."""
    from hf_pagedkv import BlockPool
    from hf_pagedkv.attention import PagedView

    cache = PagedCache(pool=BlockPool(block_size=4))
    g = torch.Generator().manual_seed(32)
    with torch.no_grad():
        for q in (30, 1, 70, 1):
            k = torch.randn(2, 2, q, 16, generator=g)
            keys, values = cache.update(k, k - 1, 0)
            view = PagedView.of(keys)
            qh = torch.randn(2, 2, 3, 16, generator=g) * 0.5
            got = READER.read_fp_view(qh, view, None)
            assert got is not None
            assert (got.double() - _attend64(qh, keys, values, 0, None)).abs().max().item() <= 1e-5
    assert len(cache.pool.groups[0].store.keys[0].segments) > 1
    cache.check_invariants()
    cache.release()


@needs_compiler
def test_fp_table_read_refuses_what_it_does_not_compute():
    """fp64 queries, a head count or head_dim the pool does not have, more query rows than the C side holds, a mask
    of another width, a block id the pool does not have (the C side trusts the ids): None, the caller reads with
    torch; the pool is unchanged."""
    from hf_pagedkv.attention import PagedView

    cache, view, keys, _ = _fp_view(2, 22, 3, seed=33)
    pool_before = [t.clone() for t in _pool_tensors(view)]
    qh = torch.zeros(2, 2, 3, 16)
    assert READER.read_fp_view(qh, view, None) is not None
    bad_table = view.table.clone()
    bad_table[1, 2] = -1
    bad = PagedView(view.store, view.layer_idx, bad_table, 0, view.end, view.base, view.new, view.materialize,
                    view.confirm)
    refused = [(qh.double(), view, None), (torch.zeros(1, 2, 3, 16), view, None), (torch.zeros(2, 2, 3, 8), view, None),
               (torch.zeros(2, 2, 65, 16), view, None), (qh, view, torch.zeros(1, 2, 3, view.end + 1)),
               (qh, bad, None)]
    for q, v, b in refused:
        assert READER.read_fp_view(q, v, b) is None
    # bit for bit (slots never written hold whatever the allocation held, NaN patterns included, and NaN != NaN)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(pool_before, _pool_tensors(view)))
    cache.check_invariants()
    cache.release()


@needs_compiler
def test_fp_generation_reads_in_c_and_matches_dynamic_cache(monkeypatch):
    """Greedy generation through ``"hf_pagedkv_compiled"`` with a full-precision cache (a batch of 2 with left
    padding, 8-token blocks): every in-place read is the C one through the block table, the tokens equal
    `DynamicCache` with `sdpa`, the logits within 1e-4 (the sums run in another order)."""
    from transformers import DynamicCache

    native = _Recording()
    monkeypatch.setattr(attention_function, "NATIVE_READ", native)
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(34))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids_d, logits_d = greedy(model, "sdpa", DynamicCache, ids, mask)
    ids_c, logits_c = greedy(model, COMPILED_ATTENTION_NAME, lambda: PagedCache(config=model.config, block_size=8),
                             ids, mask)
    assert torch.equal(ids_d, ids_c)
    assert (logits_d - logits_c).abs().max().item() <= 1e-4
    layers = model.config.num_hidden_layers
    # 5 decode steps, every layer but the first step's first (which probes with a copy: no step confirmed before)
    assert native.reads.count("table") == 5 * layers - 1


def test_a_row_masked_everywhere_reads_zero():
    """A query row whose mask hides every column (a padding position of a prompt read in place) gets 0, as torch's
    `sdpa` gives, from every read: the C reads of a fp32 pool and of codes, and the eager reads of full-precision
    parts and of codes; the other rows as before. (NaN there reached the row's real tokens through the next layers'
    K/V.)"""
    from hf_pagedkv.attention.paged_attention import fp_attention

    g = torch.Generator().manual_seed(36)
    cache, view, keys, values = _fp_view(2, 22, 3, seed=35)
    qh = torch.randn(2, 2, 3, 16, generator=g)  # [H, batch, rows, D]
    bias = torch.zeros(1, 2, 3, view.end)
    bias[:, 0, 1] = float("-inf")  # batch row 0, query row 1: masked everywhere
    want = _attend64(qh, keys, values, 0, bias)
    assert torch.equal(want[:, 0, 1], torch.zeros(2, 16, dtype=torch.float64))  # what sdpa gives
    parts = view.fp_parts(4, min_view_blocks=100)  # every block gathered, one a part
    assert len(parts) > 1  # the eager read with several parts (its own softmax), not sdpa
    reads = {"eager fp": fp_attention(qh, parts, bias)}
    if READER.load() is not None:
        reads["C fp"] = READER.read_fp_view(qh, view, bias)
    for name, got in reads.items():
        assert got is not None and torch.isfinite(got).all(), name
        assert (got.double() - want).abs().max().item() <= 1e-5, name
    cache.release()
    read, k, v = _code_read("int4", "int8", batch=2, offset=0.0)
    bias = torch.zeros(1, 2, 3, read.end - read.lo)
    bias[:, 1, 2] = float("-inf")
    s = (qh.double() @ k.double().transpose(-1, -2) + bias.double()).softmax(-1).nan_to_num(0.0)
    want = s @ v.double()  # [H, batch, rows, 16]; the masked row 0
    reads = {"eager codes": code_attention(qh, read, bias, 2048)}
    if READER.load() is not None:
        reads["C codes"] = READER(qh, read, bias)
    for name, got in reads.items():
        assert got is not None and torch.equal(got[:, 1, 2], torch.zeros(2, 16)), name
        assert (got.double() - want).abs().max().item() <= 1e-5, name


@needs_compiler
@pytest.mark.parametrize("quant", [None, "k4v4", "k4v3r", "k4ve5m2"])
def test_hf_pagedkv_reads_in_c_unless_turned_off(quant, monkeypatch):
    """``"hf_pagedkv"`` reads in C on the CPU too (not only ``"hf_pagedkv_compiled"``), rotated keys with the query
    turned in C; with ``HF_PAGEDKV_NATIVE_READ=0`` it reads with torch (no C call), the same tokens, logits within
    1e-4."""
    native = _Recording()
    monkeypatch.setattr(attention_function, "NATIVE_READ", native)
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(37))
    make = lambda: PagedCache(config=model.config, quant=quant, block_size=8)  # noqa: E731
    ids_c, logits_c = greedy(model, "hf_pagedkv", make, ids)
    layers = model.config.num_hidden_layers
    assert native.reads.count("table") == 5 * layers - 1  # every in-place read (see the fp generation test)
    assert native.turned == [quant == "k4v3r"] * len(native.turned) and (quant is None or native.turned)
    monkeypatch.setenv("HF_PAGEDKV_NATIVE_READ", "0")
    before = len(native.reads)
    ids_t, logits_t = greedy(model, "hf_pagedkv", make, ids)
    assert native.reads[before:].count("table") == 0
    assert torch.equal(ids_c, ids_t)
    assert (logits_c - logits_t).abs().max().item() <= 1e-4
