"""Block codecs for quantized KV storage, registered by name. Adding a codec: one class, one line in `CODECS`."""

from __future__ import annotations

from functools import partial

from hf_pagedkv.storage.codecs.affine import AffineCodec
from hf_pagedkv.storage.codecs.base import AXES, BlockLayout, Codec, check_finite
from hf_pagedkv.storage.codecs.bnb import BnbCodec
from hf_pagedkv.storage.codecs.fp8 import Fp8Codec
from hf_pagedkv.storage.codecs.identity import IdentityCodec
from hf_pagedkv.storage.codecs.int2 import Int2Codec
from hf_pagedkv.storage.codecs.int3 import Int3Codec
from hf_pagedkv.storage.codecs.int4 import Int4Codec
from hf_pagedkv.storage.codecs.int8 import Int8Codec
from hf_pagedkv.storage.codecs.reference import ReferenceCodec
from hf_pagedkv.storage.codecs.rotation import RotatedCodec, hadamard_rotation

#: name -> constructor taking (axis, group_size)
CODECS = {
    "identity": IdentityCodec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "int3": Int3Codec,
    "int2": Int2Codec,
    "fp8-e4m3": partial(Fp8Codec, "e4m3"),
    "fp8-e5m2": partial(Fp8Codec, "e5m2"),
    "fp8-e4m3-block": partial(Fp8Codec, "e4m3", scales="block"),
    "fp8-e5m2-block": partial(Fp8Codec, "e5m2", scales="block"),
    "ref-int8": partial(ReferenceCodec, 8),
    "ref-int4": partial(ReferenceCodec, 4),
    "ref-int2": partial(ReferenceCodec, 2),
    "bnb-int8": partial(BnbCodec, 8),
    "bnb-nf4": partial(BnbCodec, 4),
}

_BY_BACKEND = {
    "torch": {8: "int8", 4: "int4", 3: "int3", 2: "int2"},
    "reference": {8: "ref-int8", 4: "ref-int4", 2: "ref-int2"},
    "bitsandbytes": {8: "bnb-int8", 4: "bnb-nf4"},
}


def codec_name(backend: str, bits: int | None, fmt: str = "int", fp8_scales: str = "group") -> str:
    """Registry name of the codec `backend` uses for `bits` (``"identity"`` for full precision), or of the fp8
    codec of format `fmt` (``"e4m3"``, ``"e5m2"``) with `fp8_scales` (``"group"``, ``"block"``).

    Raises:
        ValueError: the backend has no codec for `bits`.
    """
    if bits is None:
        return "identity"
    if fmt != "int":
        return f"fp8-{fmt}" + ("-block" if fp8_scales == "block" else "")
    names = _BY_BACKEND.get(backend, {})
    if bits not in names:
        raise ValueError(f"Backend {backend!r} has no {bits}-bit codec; available: {sorted(names) or 'none'}.")
    return names[bits]


def make_codec(name: str, axis: str, group_size: int = 64, fit: str = "minmax") -> Codec:
    """Build the codec registered as `name` for grouping `axis` (``"channel"`` or ``"token"``); `fit` is the range
    fit of an `AffineCodec` (int4, int3, int2: ``"minmax"``, ``"lsq"`` or ``"mse"``, see `fit_range`), ignored by
    the others (their ranges have no clip to search).

    Raises:
        ValueError: an unknown name (the message lists the registered ones), axis or fit.
    """
    if name not in CODECS:
        raise ValueError(f"Unknown codec {name!r}; registered: {', '.join(CODECS)}.")
    cls = CODECS[name]
    if isinstance(cls, type) and issubclass(cls, AffineCodec):
        return cls(axis=axis, group_size=group_size, fit=fit)
    return cls(axis=axis, group_size=group_size)


def codecs_for(quant) -> tuple[Codec, Codec]:
    """The key codec (``axis="channel"``; wrapped in `RotatedCodec` when ``quant.rotate_keys``) and the value codec
    (``axis="token"``; wrapped in `RotatedCodec` when ``quant.rotate_values``; range fit
    ``quant.value_fit``) of a `QuantConfig`. Keys keep min/max ranges.

    Raises:
        ValueError: the backend has no codec for the bits.
    """
    key = make_codec(codec_name(quant.backend, quant.key_bits, quant.key_format, quant.fp8_scales), "channel")
    value = make_codec(codec_name(quant.backend, quant.value_bits, quant.value_format, quant.fp8_scales), "token",
                       quant.value_group_size, fit=quant.value_fit)
    if quant.rotate_keys and key.bits is not None:
        key = RotatedCodec(key)
    if quant.rotate_values and value.bits is not None:
        value = RotatedCodec(value)
    return key, value


__all__ = ["AXES", "CODECS", "AffineCodec", "BlockLayout", "BnbCodec", "Codec", "Fp8Codec", "IdentityCodec",
           "Int2Codec", "Int3Codec", "Int4Codec", "Int8Codec", "ReferenceCodec", "RotatedCodec", "check_finite",
           "codec_name", "codecs_for", "hadamard_rotation", "make_codec"]
