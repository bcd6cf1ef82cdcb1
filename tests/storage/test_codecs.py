"""Block codecs: round-trip error bounds, packing order, edge cases, and fast path == plain reference."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv.storage.codecs import CODECS, Int2Codec, Int4Codec, Int8Codec, ReferenceCodec, make_codec
from hf_pagedkv.storage.codecs.affine import pack, unpack_into

FAST = {8: Int8Codec, 4: Int4Codec, 2: Int2Codec}
AXES = ["channel", "token"]


def blocks(seed: int = 0, shape=(3, 5, 16, 64), outlier: bool = True) -> torch.Tensor:
    """Random K/V-like blocks `[heads, blocks, block_size, head_dim]` with an outlier channel (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.5 + 0.3
    if outlier:
        x[..., 5] *= 12
    return x


def element_scale(codec, scales: torch.Tensor, B: int, D: int) -> torch.Tensor:
    """The scale `s` that applies to each element, `[..., B, D]` (expanded from the per-group scales)."""
    s = scales if codec.bits == 8 else scales.chunk(2, dim=-1)[0]
    out = torch.empty((*scales.shape[:-1], B, D))
    grouped, _ = codec.grouped(out)
    grouped.copy_(codec.stats_view(s.float(), B, D).expand_as(grouped))
    return out


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_round_trip_within_half_a_step(bits, axis):
    codec = FAST[bits](axis=axis, group_size=32)
    x = blocks()
    codes, scales = codec.encode(x)
    layout = codec.layout(16, 64, x.dtype)
    assert codes.shape == (3, 5, layout.code_size) and codes.dtype == torch.uint8
    assert scales.shape == (3, 5, layout.scale_size) and scales.dtype == torch.float16
    y = codec.decode(codes, scales, torch.empty_like(x))
    s = element_scale(codec, scales, 16, 64)
    err = (y - x).abs()
    assert bool((err <= s / 2 * (1 + 1e-5) + 1e-6).all()), f"max excess {(err - s / 2).max():.3g}"
    # the step is what the docstring says: absmax / 127 (int8) or range / (2**bits - 1)
    xg, red = codec.grouped(x)
    expect = xg.abs().amax(red) / 127 if bits == 8 else (xg.amax(red) - xg.amin(red)) / (2**bits - 1)
    got = scales if bits == 8 else scales.chunk(2, dim=-1)[0]
    torch.testing.assert_close(got.float().reshape(expect.shape), expect, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("bits,max_rel", [(8, 0.008), (4, 0.1), (2, 0.5)])
def test_relative_error_per_bit_width(bits, max_rel):
    x = blocks(1, outlier=False)
    for axis in AXES:
        codec = FAST[bits](axis=axis, group_size=64)
        y = codec.decode(*codec.encode(x), torch.empty_like(x))
        rel = float((y - x).norm() / x.norm())
        assert max_rel / 10 < rel < max_rel, (axis, rel)


def test_keys_per_channel_beat_per_token_on_outlier_channels():
    """KIVI's observation, the reason keys are grouped per channel: an outlier channel ruins per-token groups."""
    x = blocks(2)
    errs = {axis: float((Int4Codec(axis=axis).decode(*Int4Codec(axis=axis).encode(x), torch.empty_like(x)) - x)
                        .norm()) for axis in AXES}
    assert errs["channel"] < 0.5 * errs["token"]


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fast_path_equals_reference(bits, axis):
    x = blocks(3)
    fast, ref = FAST[bits](axis=axis, group_size=32), ReferenceCodec(bits, axis=axis, group_size=32)
    (cf, sf), (cr, sr) = fast.encode(x), ref.encode(x)
    assert torch.equal(cf, cr) and torch.equal(sf, sr)
    assert torch.equal(fast.decode(cf, sf, torch.empty_like(x)), ref.decode(cr, sr, torch.empty_like(x)))
    # decoding into a strided view (as the store's read does) gives the same values
    out = torch.empty(3, 7, 16, 64)
    fast.decode(cf, sf, out[:, 1:6])
    assert torch.equal(out[:, 1:6], ref.decode(cr, sr, torch.empty_like(x)))


def test_packing_order_low_bits_first_token_parts():
    q = torch.arange(16).view(8, 2)  # one block of 8 tokens x 2 channels, q[t, c] = 2 t + c
    packed4 = pack(q, 4)  # byte (t, c): token t (low nibble), token t + 4 (high nibble) of channel c
    assert packed4.tolist() == [[q[t, c].item() | q[t + 4, c].item() << 4 for c in range(2)] for t in range(4)]
    assert packed4[1, 0].item() == 2 | 10 << 4
    q2 = q % 4
    packed2 = pack(q2, 2)  # byte (t, c): tokens t, t + 2, t + 4, t + 6 in bits 0-1, 2-3, 4-5, 6-7
    assert packed2[1, 1].item() == (3 % 4) | (7 % 4) << 2 | (11 % 4) << 4 | (15 % 4) << 6
    for bits, p, src in ((4, packed4, q), (2, packed2, q2)):
        assert torch.equal(unpack_into(p, bits, torch.empty(8, 2)), src.float())
    # through the codec: a group spanning exactly 0..15 has s = 1 and m = 0, so the codes are the values
    x = torch.tensor([[0.0, 15, 3], [15, 0, 7]]).view(1, 2, 3)  # [blocks, B=2, D=3], one group per token
    codes, scales = Int4Codec(axis="token", group_size=3).encode(x)
    assert codes[0].tolist() == [0 | 15 << 4, 15 | 0 << 4, 3 | 7 << 4]  # byte c: token 0 low, token 1 high
    assert scales[0].tolist() == [1.0, 1.0, 0.0, 0.0]  # scales first, then minimums


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_constant_blocks(bits, axis):
    """Zero range: the asymmetric codecs store s = 0 and decode the minimum exactly; symmetric int8 is within
    half a step (absmax / 254). Zero is exact for all."""
    codec = FAST[bits](axis=axis, group_size=32)
    for value in (0.0, 1.5, -3.25, 0.1):  # 0.1 is not an fp16 value: the rounded-down minimum plus one step
        x = torch.full((2, 3, 16, 64), value)
        codes, scales = codec.encode(x)
        y = codec.decode(codes, scales, torch.empty_like(x))
        assert bool(torch.isfinite(y).all())
        if value == 0.0 or (bits < 8 and value != 0.1):
            assert torch.equal(y, x), value
        bound = abs(value) / 254 if bits == 8 else 1e-4
        assert float((y - x).abs().max()) <= bound * (1 + 1e-3), value


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_raises(name, bad):
    if name == "identity":
        pytest.skip("full precision stores NaN/inf as is")
    if name.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    x = blocks(4, shape=(1, 2, 32, 64))
    x[0, 1, 3, 7] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        make_codec(name, "channel").encode(x)


def test_scale_beyond_fp16_raises():
    with pytest.raises(ValueError, match="fp16 range"):
        Int4Codec(axis="token").encode(torch.tensor([[[0.0, 1e6]]]).expand(1, 2, 2).contiguous())


def test_bad_arguments():
    with pytest.raises(ValueError, match="axis"):
        Int8Codec(axis="head")
    with pytest.raises(ValueError, match="value_group_size=48 does not divide head_dim=64"):
        Int4Codec(axis="token", group_size=48).layout(16, 64, torch.float32)
    with pytest.raises(ValueError, match="Unknown codec 'int5'"):
        make_codec("int5", "channel")


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("axis", AXES)
def test_registry_matrix(name, axis):
    """Every registered codec round-trips whole blocks, with the bytes its layout promises."""
    if name.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
    codec = make_codec(name, axis, 32)
    x = blocks(5, shape=(2, 3, 32, 64), outlier=False)
    codes, scales = codec.encode(x)
    layout = codec.layout(32, 64, x.dtype)
    assert codes.shape[-1] == layout.code_size and scales.shape[-1] == layout.scale_size
    assert codes.dtype == layout.code_dtype and scales.dtype == layout.scale_dtype
    y = codec.decode(codes, scales, torch.empty_like(x))
    bits = codec.bits or 32
    bound = {32: 1e-7, 8: 0.02, 4: 0.12, 3: 0.25, 2: 0.45}[bits] if not name.startswith("fp8") else 0.06
    assert float((y - x).norm() / x.norm()) < bound
    assert codec.bytes_per_token(32, 64, x.dtype) == layout.bytes / 32
    assert layout.bytes <= 32 * 64 * bits / 8 + 2 * 4 * codec.num_groups(32, 64) + (4 * 32 * 64 if bits == 32 else 0)


def test_bytes_per_token():
    assert Int4Codec(axis="channel").bytes_per_token(32, 64) == (32 * 32 + 2 * 64 * 2) / 32  # 40
    assert Int4Codec(axis="token", group_size=64).bytes_per_token(32, 64) == 32 + 2 * 2  # 36
    assert Int8Codec(axis="channel").bytes_per_token(32, 64) == 64 + 64 * 2 / 32  # 68
    assert Int2Codec(axis="token", group_size=32).bytes_per_token(32, 64) == 16 + 2 * 2 * 2  # 24


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_against_reference(bits, axis):
    """The bitsandbytes codecs (NF4, dynamic int8) stay close to the uniform reference at the same bits and bytes."""
    pytest.importorskip("bitsandbytes")
    x = blocks(6, shape=(3, 4, 32, 64), outlier=False)
    ref = ReferenceCodec(bits, axis=axis, group_size=64)
    bnb = make_codec("bnb-nf4" if bits == 4 else "bnb-int8", axis, 64)
    err_ref = float((ref.decode(*ref.encode(x), torch.empty_like(x)) - x).norm())
    err_bnb = float((bnb.decode(*bnb.encode(x), torch.empty_like(x)) - x).norm())
    assert err_bnb < 1.8 * err_ref, (err_bnb, err_ref)
    assert bnb.layout(32, 64, x.dtype).bytes <= ref.layout(32, 64, x.dtype).bytes
