"""Block codecs for quantized KV storage, registered by name. Adding a codec: one class, one line in `CODECS`."""

from __future__ import annotations

from functools import partial

from hf_pagedkv.storage.codecs.base import AXES, BlockLayout, Codec, check_finite
from hf_pagedkv.storage.codecs.bnb import BnbCodec
from hf_pagedkv.storage.codecs.identity import IdentityCodec
from hf_pagedkv.storage.codecs.int2 import Int2Codec
from hf_pagedkv.storage.codecs.int4 import Int4Codec
from hf_pagedkv.storage.codecs.int8 import Int8Codec
from hf_pagedkv.storage.codecs.reference import ReferenceCodec

#: name -> constructor taking (axis, group_size)
CODECS = {
    "identity": IdentityCodec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "int2": Int2Codec,
    "ref-int8": partial(ReferenceCodec, 8),
    "ref-int4": partial(ReferenceCodec, 4),
    "ref-int2": partial(ReferenceCodec, 2),
    "bnb-int8": partial(BnbCodec, 8),
    "bnb-nf4": partial(BnbCodec, 4),
}

_BY_BACKEND = {
    "torch": {8: "int8", 4: "int4", 2: "int2"},
    "reference": {8: "ref-int8", 4: "ref-int4", 2: "ref-int2"},
    "bitsandbytes": {8: "bnb-int8", 4: "bnb-nf4"},
}


def codec_name(backend: str, bits: int | None) -> str:
    """Registry name of the codec `backend` uses for `bits` (``"identity"`` for full precision).

    Raises:
        ValueError: the backend has no codec for `bits`.
    """
    if bits is None:
        return "identity"
    names = _BY_BACKEND.get(backend, {})
    if bits not in names:
        raise ValueError(f"Backend {backend!r} has no {bits}-bit codec; available: {sorted(names) or 'none'}.")
    return names[bits]


def make_codec(name: str, axis: str, group_size: int = 64) -> Codec:
    """Build the codec registered as `name` for grouping `axis` (``"channel"`` or ``"token"``).

    Raises:
        ValueError: an unknown name (the message lists the registered ones) or axis.
    """
    if name not in CODECS:
        raise ValueError(f"Unknown codec {name!r}; registered: {', '.join(CODECS)}.")
    return CODECS[name](axis=axis, group_size=group_size)


__all__ = ["AXES", "CODECS", "BlockLayout", "BnbCodec", "Codec", "IdentityCodec", "Int2Codec", "Int4Codec",
           "Int8Codec", "ReferenceCodec", "check_finite", "codec_name", "make_codec"]
