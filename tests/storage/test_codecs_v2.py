"""The rotated, 3-bit and fp8 codecs: error bounds from both sides, packing, affine parts, configs and presets."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import QuantConfig
from hf_pagedkv.storage.codecs import (Fp8Codec, Int3Codec, Int4Codec, RotatedCodec, codecs_for, hadamard_rotation,
                                       make_codec)
from hf_pagedkv.storage.codecs.affine import pack


def blocks(seed: int = 0, shape=(3, 5, 32, 64), outlier: bool = True) -> torch.Tensor:
    """Random K/V-like blocks `[heads, blocks, block_size, head_dim]`, optionally with an outlier channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.5 + 0.3
    if outlier:
        x[..., 5] *= 12
    return x


def rel(codec, x: torch.Tensor) -> float:
    y = codec.decode(*codec.encode(x), torch.empty_like(x))
    return float((y - x).norm() / x.norm())


# -- rotation ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 2, 16, 64, 128])
def test_hadamard_rotation_is_orthogonal_and_spreads_every_channel(dim):
    r = hadamard_rotation(dim)
    torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((r.abs() - dim**-0.5).abs().max() < 1e-12)  # every entry +-1/sqrt(dim): equal weight
    assert torch.equal(r, hadamard_rotation(dim))  # fixed: another process reads the same codes


def test_hadamard_rotation_refuses_other_dims():
    with pytest.raises(ValueError, match="power of two; got 96"):
        hadamard_rotation(96)
    with pytest.raises(ValueError, match="power of two; got 80"):
        RotatedCodec(Int4Codec(axis="channel")).layout(32, 80, torch.float32)
    with pytest.raises(ValueError, match="power of two; got 48. Use rotate_keys=False and rotate_values=False"):
        RotatedCodec(Int4Codec(axis="token", group_size=16)).layout(32, 48, torch.float32)  # values


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("name", ["int8", "int4", "int3", "int2", "fp8-e4m3"])
def test_rotated_error_is_the_inner_error_of_the_rotated_keys(name, axis):
    """A rotation keeps L2 norms: per token, ||x - x_hat|| equals the inner codec's error on x @ R (keys grouped
    per channel, values per token)."""
    x = blocks(1)
    inner = make_codec(name, axis)
    codec = RotatedCodec(inner)
    y = codec.decode(*codec.encode(x), torch.empty_like(x))
    xr = x @ hadamard_rotation(64).float()
    yr = inner.decode(*inner.encode(xr), torch.empty_like(xr))
    torch.testing.assert_close((y - x).norm(dim=-1), (yr - xr).norm(dim=-1), rtol=1e-4, atol=1e-5)
    # same codes and bytes as the inner codec of the rotated keys
    assert codec.layout(32, 64, x.dtype) == inner.layout(32, 64, x.dtype)
    assert torch.equal(codec.encode(x)[0], inner.encode(xr)[0])


@pytest.mark.parametrize("bits,lo,hi", [(8, 0.002, 0.01), (4, 0.03, 0.12), (3, 0.06, 0.25), (2, 0.15, 0.5)])
def test_rotated_relative_error_bounds(bits, lo, hi):
    """Both bounds: the codes are lossy (not a disguised identity) and within the bit width's budget."""
    x = blocks(2, outlier=False)
    assert lo < rel(RotatedCodec(make_codec(f"int{bits}", "channel")), x) < hi


def test_rotation_rescues_per_token_groups_from_an_outlier_channel():
    """An outlier channel ruins per-token groups (KIVI); turned, it is spread over every channel."""
    x = blocks(3)
    plain, turned = Int4Codec(axis="token"), RotatedCodec(Int4Codec(axis="token"))
    assert rel(turned, x) < 0.7 * rel(plain, x)


@pytest.mark.parametrize("name,group,lo,hi", [
    ("int8", 64, 0.002, 0.008), ("int4", 64, 0.04, 0.1), ("int4", 32, 0.04, 0.09), ("int3", 64, 0.09, 0.22),
    ("int2", 64, 0.2, 0.5),
])
def test_rotated_value_error_bounds_and_gain(name, group, lo, hi):
    """Rotated values (per token, `group` channels per group) with an outlier channel: lossy, within the bit width's
    budget, and at least 1.5x below the unrotated codec's error (the outlier no longer sets its group's scale);
    without an outlier the rotation changes the error by under 3%."""
    x = blocks(2)
    plain = make_codec(name, "token", group)
    turned = RotatedCodec(make_codec(name, "token", group))
    assert lo < rel(turned, x) < hi
    assert rel(turned, x) * 1.5 < rel(plain, x)
    flat = blocks(2, outlier=False)
    assert abs(rel(turned, flat) / rel(plain, flat) - 1) < 0.03


def test_rotated_fp8_values_gain_nothing():
    """fp8 codes keep a relative precision per element: turning an outlier channel over every channel raises their
    error instead (which is why rotation is the integer codes' tool)."""
    x = blocks(2)
    assert rel(RotatedCodec(make_codec("fp8-e4m3", "token")), x) > 1.3 * rel(make_codec("fp8-e4m3", "token"), x)


def test_rotated_decode_into_a_strided_view():
    x = blocks(4)
    codec = RotatedCodec(Int4Codec(axis="channel"))
    codes, scales = codec.encode(x)
    out = torch.empty(3, 7, 32, 64)
    codec.decode(codes, scales, out[:, 1:6])
    torch.testing.assert_close(out[:, 1:6], codec.decode(codes, scales, torch.empty_like(x)))


def test_rotated_affine_parts_are_in_the_rotated_basis():
    x = blocks(5)
    codec = RotatedCodec(Int4Codec(axis="channel"))
    codes, scales = codec.encode(x)
    q = codec.unpack(codes, torch.empty_like(x))
    s, z = codec.affine(scales, torch.float32)
    rotated = q * s.unsqueeze(-2) + z.unsqueeze(-2)  # [..., B, D] = x_hat @ R
    r = codec.matrix(64, torch.float32, "cpu")
    torch.testing.assert_close(rotated @ r.T, codec.decode(codes, scales, torch.empty_like(x)), rtol=1e-5, atol=1e-5)
    assert codec.rotated and codec.inner.rotated is False and codec.inner is not codec


# -- int3 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_int3_within_half_a_step_and_lossy(axis):
    codec = Int3Codec(axis=axis, group_size=32)
    x = blocks(6, outlier=False)
    codes, scales = codec.encode(x)
    assert codes.shape == (3, 5, 32 * 64 * 3 // 8) and codes.dtype == torch.uint8
    y = codec.decode(codes, scales, torch.empty_like(x))
    xg, red = codec.grouped(x)
    step = (xg.amax(red, keepdim=True) - xg.amin(red, keepdim=True)) / 7
    err, _ = codec.grouped((y - x).abs())
    assert bool((err <= step / 2 * (1 + 1e-3) + 1e-6).all())
    assert 0.06 < float((y - x).norm() / x.norm()) < 0.2  # between int4's and int2's


def test_int3_packing_planes():
    """Code q of token t, channel c: low two bits in the 2-bit plane (token quarters), the high bit in the 1-bit
    plane (token eighths)."""
    B, D = 8, 2
    q = torch.arange(B * D, dtype=torch.int32).reshape(1, B, D) % 8  # [1, 8, 2], values 0..7
    codes = Int3Codec(axis="channel").pack(q)  # [1, 3, 2]: 2 bytes of low bits per channel, 1 of high bits
    assert codes.shape == (1, 3, 2)
    assert torch.equal(codes[:, :2], pack(q & 3, 2)) and torch.equal(codes[:, 2:], pack(q >> 2, 1))
    # token 5 of channel 1: q = 11 % 8 = 3 -> low bits 3 in byte (5 % 2, 1) at bits (5 // 2) * 2; high bit 0
    assert (int(codes[0, 1, 1]) >> 4) & 3 == 3 and (int(codes[0, 2, 1]) >> 5) & 1 == 0
    out = torch.empty(1, B, D)
    assert torch.equal(Int3Codec(axis="channel").unpack(codes.flatten(-2), out), q.float())


def test_int3_block_size_must_be_a_multiple_of_8():
    with pytest.raises(ValueError, match="3-bit codes pack 8 tokens together: block_size=12"):
        Int3Codec(axis="channel").layout(12, 64, torch.float32)
    with pytest.raises(ValueError, match="block_size=20 must be a multiple of 8"):
        from hf_pagedkv.storage.quantized_store import QuantizedPageStore
        QuantizedPageStore(20, QuantConfig.preset("k3v3r"))


# -- fp8 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,ulp,sub", [("e4m3", 2**-4, 2**-10), ("e5m2", 2**-3, 2**-17)])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("scales", ["group", "block"])
def test_fp8_relative_error_bound_per_element(fmt, ulp, sub, axis, scales):
    codec = Fp8Codec(fmt, axis, 32, scales=scales)
    x = blocks(7)
    codes, s = codec.encode(x)
    assert s.shape[-1] == (1 if scales == "block" else codec.num_groups(32, 64))
    y = codec.decode(codes, s, torch.empty_like(x))
    scale = torch.empty_like(x)
    if scales == "block":
        scale.copy_(s.float().unsqueeze(-1).expand_as(x))
    else:
        g, _ = codec.grouped(scale)
        g.copy_(codec.stats_view(s.float(), 32, 64).expand_as(g))
    err = (y - x).abs()
    assert bool((err <= ulp * x.abs() + sub * scale + 1e-7).all()), float((err - ulp * x.abs()).max())
    r = float((y - x).norm() / x.norm())
    assert ulp / 16 < r < ulp  # lossy, and within half an ulp on average
    # the codes are the fp8 bit patterns of x / s: decode == code value * scale
    torch.testing.assert_close(codes.view(codec.dtype).float().reshape(x.shape) * scale, y)


def test_fp8_affine_parts_and_no_saturation():
    codec = Fp8Codec("e4m3", "token", 64)
    x = blocks(8)
    codes, s = codec.encode(x)
    vals = codec.unpack(codes, torch.empty_like(x))
    scale, zero = codec.affine(s, torch.float32)
    assert zero is None
    torch.testing.assert_close(vals * scale.unsqueeze(-1), codec.decode(codes, s, torch.empty_like(x)))
    assert float(vals.abs().max()) <= 448  # absmax / s <= largest: nothing clips
    with pytest.raises(NotImplementedError, match="per-block"):
        Fp8Codec("e4m3", "token", scales="block").affine(s, torch.float32)


def test_fp8_bad_arguments():
    with pytest.raises(ValueError, match="`fmt` must be one of e4m3, e5m2; got 'e3m4'"):
        Fp8Codec("e3m4", "token")
    with pytest.raises(ValueError, match="`scales` must be one of group, block"):
        Fp8Codec("e4m3", "token", scales="tensor")


# -- configs and presets ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fields", [
    ("k4v4r", dict(key_bits=4, value_bits=4, rotate_keys=True)),
    ("k3v3r", dict(key_bits=3, value_bits=3, rotate_keys=True)),
    ("k4v3r", dict(key_bits=4, value_bits=3, rotate_keys=True)),
    ("k8v4r", dict(key_bits=8, value_bits=4, rotate_keys=True)),
    ("k4ve4m3", dict(key_bits=4, value_bits=8, value_format="e4m3")),
    ("k4ve4m3b", dict(key_bits=4, value_bits=8, value_format="e4m3", fp8_scales="block")),
    ("ke5m2v4r", dict(key_bits=8, value_bits=4, key_format="e5m2", rotate_keys=True)),
    ("k8v4rv", dict(key_bits=8, value_bits=4, rotate_keys=True, rotate_values=True)),
    ("k4v4rv", dict(key_bits=4, value_bits=4, rotate_keys=True, rotate_values=True)),
    ("k3v3rv", dict(key_bits=3, value_bits=3, rotate_keys=True, rotate_values=True)),
    ("k8v4v", dict(key_bits=8, value_bits=4, rotate_values=True)),
    ("k16v4v", dict(value_bits=4, rotate_values=True)),
])
def test_presets_round_trip_their_names(name, fields):
    quant = QuantConfig.preset(name)
    assert quant == QuantConfig(**fields) and quant.name == name


def test_codecs_for_a_config():
    k, v = codecs_for(QuantConfig.preset("k4ve4m3r"))
    assert isinstance(k, RotatedCodec) and isinstance(k.inner, Int4Codec) and k.axis == "channel"
    assert isinstance(v, Fp8Codec) and v.fmt == "e4m3" and v.axis == "token" and not v.per_block
    k, v = codecs_for(QuantConfig(value_bits=8, rotate_keys=True))  # full-precision keys are not turned
    assert k.bits is None and not k.rotated
    k, v = codecs_for(QuantConfig.preset("k4v3rv"))
    assert k.rotated and isinstance(v, RotatedCodec) and isinstance(v.inner, Int3Codec) and v.axis == "token"
    assert v.group_size == v.inner.group_size == 64
    k, v = codecs_for(QuantConfig(key_bits=4, rotate_values=True))  # full-precision values are not turned
    assert not k.rotated and v.bits is None and not v.rotated
    assert QuantConfig(key_bits=4, rotate_values=True).name == "k4v16"


@pytest.mark.parametrize("kwargs,match", [
    (dict(key_bits=4, key_format="e4m3"), "8-bit float: it needs key_bits=8"),
    (dict(value_bits=8, value_format="e4m3", backend="reference"), "backend='torch'"),
    (dict(value_bits=8, value_format="fp8"), "`value_format` must be one of int, e4m3, e5m2"),
    (dict(key_bits=3, backend="reference"), "3-bit codes are the torch backend's"),
    (dict(key_bits=4, rotate_keys=1), "`rotate_keys` must be True or False"),
    (dict(value_bits=4, rotate_values="yes"), "`rotate_values` must be True or False"),
    (dict(value_bits=8, fp8_scales="token"), "`fp8_scales` must be one of group, block"),
    (dict(key_bits=5), r"`key_bits` must be None \(full precision\), 8, 4, 3 or 2 \(8 with key_format='e4m3' or "
                       r"'e5m2' for fp8 codes; a preset name's 16 means None\); got 5"),
    (dict(value_bits=16), r"`value_bits` must be None \(full precision\), 8, 4, 3 or 2 .*got 16"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_unknown_preset_names_the_grammar():
    with pytest.raises(ValueError, match="b in 16, 8, 4, 3, 2, e4m3, e5m2"):
        QuantConfig.preset("k5v5")
