"""The quantized read through block tables in Triton (`TritonCodeAttention`, the GPU engine of
``"hf_pagedkv_compiled"``): on the CPU under Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``
where there is no CUDA device), against the eager read and the C read of the same pool; on CUDA (``gpu``) against
the eager read there."""

from __future__ import annotations

import os

import pytest
import torch

import hf_pagedkv.attention.attention_function as attention_function
from hf_pagedkv import BlockPool, PagedCache, QuantConfig, cache_kwargs
from hf_pagedkv.attention import COMPILED_ATTENTION_NAME, PagedView
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import code_attention
from hf_pagedkv.attention.triton_read import TritonCodeAttention
from tests.attention.test_native_read import generate_eager_and_compiled
from tests.conftest import VOCAB, tiny_model

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[dev]' brings it)")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a CUDA device is here: the kernel is tested on it (the gpu tests)")
READER = TritonCodeAttention(interpret=True)
C_READER = NativeCodeAttention()


def _pool_read(quant: str, prompt: int | tuple, dim: int = 32, num_blocks: int | None = 40, device: str = "cpu",
               seed: int = 13, steps: int = 30):
    """A 3-row cache of one layer in a pool of 16-token blocks whose rows' decode blocks interleave, and the view of
    its next step (`prompt` tokens, or steps of these many, then `steps` single ones, then the step read)."""
    # (the pool's storage is made on the device of the first K/V written)
    pool = BlockPool(block_size=16, num_blocks=num_blocks, quant=QuantConfig.preset(quant))
    cache = PagedCache(pool=pool)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in (prompt if isinstance(prompt, tuple) else (prompt,)) + (1,) * steps:
            k = torch.randn(3, 2, q, dim, generator=g).to(device)
            cache.update(k, k + 1, 0)
        k = torch.randn(3, 2, 1, dim, generator=g).to(device)
        view = PagedView.of(cache.update(k, k * 0.5, 0)[0])
    return cache, view


def _bias(table, device="cpu") -> torch.Tensor:
    """A mask `[1, 3, 2, width]`: row 1 never sees column 5, query row 1 of batch row 2 not its first 3 columns,
    query row 1 of batch row 0 nothing (a padding position: every read gives it 0, as `sdpa`)."""
    bias = torch.zeros(1, 3, 2, table.end - table.lo, device=device)
    bias[:, 1, :, 5] = float("-inf")
    bias[:, 2, 1, :3] = float("-inf")
    bias[:, 0, 1] = float("-inf")
    return bias


@interpreted
@pytest.mark.parametrize("quant", ["k8v8", "k8v4", "k4v4"])
@pytest.mark.parametrize("prompt", [40, 34])
@pytest.mark.parametrize("mask", [False, True])
def test_triton_read_equals_the_eager_and_c_reads(quant, prompt, mask):
    """Through block ids (rows' blocks out of order), with each row's staged partial block, the step's token and
    the sink token where they lie: the eager read of the gathered codes within 1e-5, and the C read of the same
    table within 1e-5 (another summation order); with and without a mask per query row; 40 + 30 tokens leave a
    staged partial block, 34 + 30 none before the step's token."""
    cache, view = _pool_read(quant, prompt)
    table, read = view.code_table(), view.code_read()
    assert table is not None and (table.ids[:, 1:] - table.ids[:, :-1] != 1).any()
    assert table.rest == (prompt + 30) % 16 and table.new is not None and table.sink_end == 1
    qh = torch.randn(2, 3, 2, 32, generator=torch.Generator().manual_seed(3)) * 0.3  # [H, batch, rows, D]
    bias = _bias(table) if mask else None
    got = READER.read_table(qh, table, bias)
    assert got is not None and got.shape == (2, 3, 2, 32)
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5
    assert (got - C_READER.read_table(qh, table, bias)).abs().max().item() <= 1e-5
    cache.check_invariants()
    cache.release()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_read_of_half_precision_models(dtype):
    """A model in fp16 or bf16 (GPU models are): the kernel sums in fp32 and returns the query's dtype, so it equals
    the eager read of the same codes with the query and the full-precision tokens upcast to fp32, within the
    output dtype's rounding (its eps times the largest output)."""
    pool = BlockPool(block_size=16, num_blocks=40, quant=QuantConfig.preset("k4v4"))
    cache = PagedCache(pool=pool)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for q in (40,) + (1,) * 30:
            k = torch.randn(3, 2, q, 32, generator=g).to(dtype)
            cache.update(k, k + 1, 0)
        k = torch.randn(3, 2, 1, 32, generator=g).to(dtype)
        view = PagedView.of(cache.update(k, k * 0.5, 0)[0])
    table, read = view.code_table(), view.code_read()
    qh = (torch.randn(2, 3, 2, 32, generator=g) * 0.3).to(dtype)
    got = READER.read_table(qh, table, None)
    assert got is not None and got.dtype == dtype
    want = code_attention(qh.float(), read._replace(full=tuple(f.float() for f in read.full)), None, 2048)
    assert (got.float() - want).abs().max().item() <= torch.finfo(dtype).eps * want.abs().max().item()
    cache.release()


@interpreted
def test_triton_read_of_a_grown_pool():
    """A growable pool that grew into several storage segments: each block id is found in its segment (element
    offsets from the lowest segment), the eager read within 1e-5."""
    cache, view = _pool_read("k4v4", (30, 70, 100), num_blocks=None, seed=14, steps=3)
    table, read = view.code_table(), view.code_read()
    assert len(table.codes[0].segments) > 1
    qh = torch.randn(2, 3, 2, 32, generator=torch.Generator().manual_seed(4)) * 0.3
    got = READER.read_table(qh, table, None)
    assert got is not None
    assert (got - code_attention(qh, read, None, 2048)).abs().max().item() <= 1e-5
    cache.release()


@interpreted
def test_refuses_what_it_does_not_compute():
    """Blocks under 16 tokens, a head_dim that is not a power of two, other codecs, a mask of another width, and
    CPU tensors for a reader that is not interpreted: None, the caller reads another way."""
    cache, view = _pool_read("k4v4", 40)
    table = view.code_table()
    qh = torch.zeros(2, 3, 2, 32)
    assert READER.supports_table(qh, table, None)
    assert not READER.supports_table(qh, table, torch.zeros(1, 3, 2, table.end - table.lo + 1))
    assert not TritonCodeAttention().supports_table(qh, table, None)
    assert TritonCodeAttention().read_table(qh, table, None) is None
    assert not READER.supports_table(qh.double()[..., :16], table, None)
    cache.release()
    for pool in (BlockPool(block_size=8, quant=QuantConfig.preset("k4v4")),
                 BlockPool(block_size=16, quant=QuantConfig(key_bits=4, value_bits=4, backend="reference"))):
        c = PagedCache(pool=pool)
        with torch.no_grad():
            for q in (40, 1):
                k = torch.randn(1, 2, q, 32)
                v = PagedView.of(c.update(k, k, 0)[0])
        t = v.code_table()
        assert t is None or not READER.supports_table(torch.zeros(2, 1, 2, 32), t, None)
        c.release()
    cache, view = _pool_read("k4v4", 40, dim=24)
    assert not READER.supports_table(torch.zeros(2, 3, 2, 24), view.code_table(), None)
    cache.release()


class _Recording(TritonCodeAttention):
    """The Triton read, interpreted, recording whether it served each quantized read."""

    def __init__(self) -> None:
        super().__init__(interpret=True)
        self.reads: list[bool] = []

    def read_view(self, qh, view, bias):
        out = super().read_view(qh, view, bias)
        self.reads.append(out is not None)
        return out


@interpreted
@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_generation_through_the_triton_read(quant, monkeypatch):
    """Greedy generation through ``"hf_pagedkv_compiled"`` with every quantized read in the Triton kernel (made
    the engine of CPU reads here; the C and `torch.compile`d engines made to fail if reached) gives the tokens of
    the eager ``"hf_pagedkv"`` and logits within 1e-4; a batch of 2 with left padding, 16-token blocks."""
    calls = []
    monkeypatch.setattr(attention_function, "COMPILED_READ", lambda *a: calls.append(a))
    triton_read = _Recording()
    monkeypatch.setattr(attention_function, "NATIVE_READ", triton_read)
    generate_eager_and_compiled(quant, block_size=16)
    assert triton_read.reads and all(triton_read.reads) and not calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["k8v8", "k8v4", "k4v4"])
def test_triton_read_on_cuda(quant):
    """On CUDA (the kernel compiled by Triton): the eager read of the same pool on the same device within 1e-5, with a
    mask, and ``"hf_pagedkv_compiled"``'s greedy tokens equal the eager ``"hf_pagedkv"``'s."""
    reader = TritonCodeAttention()
    cache, view = _pool_read(quant, 40, device="cuda")
    table, read = view.code_table(), view.code_read()
    qh = (torch.randn(2, 3, 2, 32, generator=torch.Generator().manual_seed(3)) * 0.3).cuda()
    bias = _bias(table, "cuda")
    got = reader.read_table(qh, table, bias)
    assert got is not None and not reader.failed
    assert (got - code_attention(qh, read, bias, 2048)).abs().max().item() <= 1e-5
    cache.release()
    import copy

    model = copy.deepcopy(tiny_model("llama")).cuda()
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()
    tokens = {}
    for impl in ("hf_pagedkv", COMPILED_ATTENTION_NAME):
        model.set_attn_implementation(impl)
        c = PagedCache(config=model.config, quant=quant, block_size=16)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, **cache_kwargs(c), do_sample=False, max_new_tokens=6)
        c.release()
    assert torch.equal(*tokens.values())
