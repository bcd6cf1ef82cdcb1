"""Settings parsing shared by the pool and the cache."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_positive_int(name: str, value: object) -> int:
    """Return `value` if it is a positive `int` (not a `bool`), else raise `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return value


def parse_bytes(value: int | str, name: str = "max_memory") -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512 MB"`` or ``1073741824`` into bytes (`name`: the argument, for
    the error message).

    Raises:
        ValueError: if the value is not a positive size with a known unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"`{name}` must be positive, got {value!r}.")
        return value
    match = re.fullmatch(r"\s*(-\s*)?([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match is not None and match.group(1):
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    if match is None or match.group(3).lower() not in _UNITS:
        raise ValueError(f"`{name}` must be bytes (int) or a size like '4GiB' or '512MB', got {value!r}.")
    unit = _UNITS[match.group(3).lower()]
    number = float(match.group(2)) * unit
    if unit == 1 and number != int(number):  # "4.5" bytes; "0.3GiB" rounds down
        raise ValueError(f"`{name}`={value!r} is not a whole number of bytes; give bytes as an int or a size "
                         "with a unit such as '4.5GiB'.")
    size = int(number)
    if size <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    return size


# NOTE: keys are grouped per channel over the tokens of one block (KIVI), so each block pays fp16 parameters per
# channel: a scale and a minimum at int4/int2, 4 / block_size bytes per key element. At 16 tokens that is 0.25
# B/element, half of what int4 codes cost; at 32 (KIVI's key group size) it is 0.125. Quantized pools default to
# 32-token blocks.
DEFAULT_BLOCK_SIZE = 16  # tokens per block of a full-precision pool
DEFAULT_QUANT_BLOCK_SIZE = 32  # tokens per block of a quantized pool (the key quantization group)
#: The largest block size a pool takes, in tokens. NOTE: a block is the unit of allocation (a row's last block
#: wastes up to ``block_size - 1`` slots, and a growable pool grows by 16 blocks or more at a time), so a larger
#: block would hold a whole long context per row; the limit turns a typo (``block_size=10**9``) into an error at
#: construction instead of a failed allocation of terabytes at the first forward pass.
MAX_BLOCK_SIZE = 65536


def check_block_size(block_size: object) -> int:
    """Return `block_size` if it is an int in ``[1, MAX_BLOCK_SIZE]``, else raise `ValueError` naming it."""
    check_positive_int("block_size", block_size)
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"`block_size`={block_size:,} is more than the largest block size, {MAX_BLOCK_SIZE:,} tokens: "
                         f"block_size counts the tokens of one block, the unit of allocation (typical values are "
                         f"{DEFAULT_BLOCK_SIZE} to 256); give a smaller one, or leave it unset for the default.")
    return block_size

_BITS = (None, 8, 4, 3, 2)
_BACKENDS = ("torch", "reference", "bitsandbytes")
_FORMATS = ("int", "e4m3", "e5m2")  # integer codes, or 8-bit floats (float8_e4m3fn, float8_e5m2)
_FP8_SCALES = ("group", "block")
RANGE_FITS = ("minmax", "lsq", "mse")  # how affine codecs pick a group's range (`storage/codecs/affine.fit_range`)
#: a preset name: ``k<key>v<value>`` with each half 16 (full precision), 8, 4, 3, 2 bits or an fp8 format, and an
#: ``r`` suffix for rotated keys, a ``v`` suffix for rotated values (``rv``: both) and a ``b`` suffix for per-block
#: fp8 scales
_PRESET = re.compile(r"k(16|8|4|3|2|e4m3|e5m2)v(16|8|4|3|2|e4m3|e5m2)(r?)(v?)(b?)")
#: The preset ladder: name -> (key_bits, value_bits), None meaning full precision (the planner uses it too).
PRESETS: dict[str, tuple[int | None, int | None]] = {
    "fp": (None, None), "v8": (None, 8), "k8v8": (8, 8), "k8v4": (8, 4), "k4v4": (4, 4), "k4v2": (4, 2),
    "k2v2": (2, 2),
}
_warned: set[tuple[int, int]] = set()  # (key_bits, value_bits) pairs already warned about


@dataclass(frozen=True)
class QuantConfig:
    """How a `BlockPool` stores keys and values: full precision, or integer codes with fp16 scales.

    Keys are quantized per channel with the tokens of one block as the group, values per token in groups of
    `value_group_size` channels along `head_dim` (KIVI, Liu et al. 2024, arXiv 2402.02750: keys have outlier
    channels, values do not). The last, partial block of each sequence stays in full precision and is encoded once,
    when it fills. So do the sequence's first `sink_tokens` tokens: the attention sink, which most heads attend to
    heavily, so its quantization error reaches every later token (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453;
    KVQuant, Hooper et al. 2024, arXiv 2401.18079, also keeps the first token in full precision). On SmolLM2
    (1024-token prefill, 256 decode steps; docs/quantization.md), keeping one sink token lowers k8v4's mean KL from
    2.1e-3 to 1.1e-3. Values tolerate fewer bits than keys (keys feed the softmax), hence the preset ladder
    ``fp -> v8 -> k8v8 -> k8v4 -> k4v4 (-> k4v2 -> k2v2)``.

    Args:
        key_bits (`int`, *optional*): 8, 4, 3 or 2 bits per key element; `None` keeps keys in full precision.
        value_bits (`int`, *optional*): 8, 4, 3 or 2 bits per value element; `None` keeps values in full precision.
        value_group_size (`int`, *optional*, defaults to 64): channels per value quantization group (capped at
            `head_dim`, which it must divide).
        backend (`str`, *optional*, defaults to `"torch"`): `"torch"` (vectorised, the default), `"reference"`
            (plain, slow, the specification) or `"bitsandbytes"` (NF4 / blockwise int8; 4 and 8 bits only).
        sink_tokens (`int`, *optional*, defaults to 1): tokens at the start of each sequence whose K/V are also kept
            in full precision (model dtype), read in place of their decoded codes; 0 turns this off. At most the
            pool's block size. Costs `sink_tokens` full-precision tokens per sequence (0.1% of the fp16 bytes of
            a 2048-token sequence of an fp32 model).
        rotate_keys (`bool`, *optional*, defaults to False): quantize keys turned by a fixed randomized Hadamard
            rotation (QuaRot, arXiv 2404.00456; TurboQuant, arXiv 2504.19874), which spreads outlier channels over
            all channels (`RotatedCodec`; head_dim a power of two). Reads de-rotate; the ``"hf_pagedkv"`` attention
            rotates the query instead. Same bytes.
        rotate_values (`bool`, *optional*, defaults to False): quantize values turned by the same rotation before
            they are grouped along head_dim (`RotatedCodec`; head_dim a power of two): an outlier channel no longer
            sets the scale of its whole group. Reads de-rotate; the ``"hf_pagedkv"`` attention reads the codes as
            stored and turns its output back once per head (``p @ (V R) = (p @ V) R``). Same bytes. On SmolLM2
            (docs/quantization.md), k8v4 with keys and values rotated (``"k8v4rv"``) has mean KL 1.0e-3 against
            1.7e-3 unrotated, top-1 98.1% against 97.5% (98.5% with its default `value_range_fit`).
        key_format, value_format (`str`, *optional*, defaults to `"int"`): `"int"` (integer codes), or `"e4m3"` /
            `"e5m2"` for 8-bit floating-point codes (`Fp8Codec`; bits must then be 8; `torch` backend).
        fp8_scales (`str`, *optional*, defaults to `"group"`): fp8 scale granularity: `"group"` (keys per channel
            over the block, values per token and channel group, as the integer codecs) or `"block"` (one scale per
            block of one head).
        value_range_fit (`str`, *optional*): how 4-, 3- and 2-bit value codes (torch backend) pick each
            group's range when a block is encoded (`fit_range`): `"lsq"` refits min/max's range by least squares,
            `"mse"` also searches clipped ranges, each only where it lowers the group's squared error; `"minmax"`
            covers the group (nothing clips; error at most half a step). Defaults to `"lsq"` with
            `rotate_values`, else `"minmax"` (`value_fit`): on SmolLM2 (docs/quantization.md) the refit raises the
            top-1 agreement of every rotated rung by 0.4-1.1 points at about the same mean KL (k8v4rv 98.52%
            against 98.12%), but raises unrotated k8v4's mean KL by half (it clips the outlier channels that set
            the range of a group, the same channels token after token). Keys keep min/max ranges. An encoder
            setting only: the codes and scales have the same format and every read path is unchanged, so it is
            left out of `repr` and equality (pools differing only in it read each other's prefix files). `"lsq"`
            costs about 3x min/max's encode work, `"mse"` 20x.

    Raises:
        ValueError: bits not in {None, 8, 4, 3, 2}, a non-positive group size, a negative `sink_tokens`, an unknown
            backend, format, scale granularity or range fit, an fp8 format without 8 bits, or a backend that cannot
            encode the requested bits.

    A config giving keys fewer bits than values (say `k4v8`) is allowed for ablations but logs a warning once.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache, QuantConfig
    >>> cache = PagedCache(quant="k8v4")            # or quant=QuantConfig(key_bits=8, value_bits=4)
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    >>> cache.pool.stats().bytes_in_use             # codes + scales + full-precision partial blocks
    ```
    """

    key_bits: int | None = None
    value_bits: int | None = None
    value_group_size: int = 64
    backend: str = "torch"
    sink_tokens: int = 1
    rotate_keys: bool = False
    rotate_values: bool = False
    key_format: str = "int"
    value_format: str = "int"
    fp8_scales: str = "group"
    value_range_fit: str | None = field(default=None, repr=False, compare=False)  # encoder setting, not format

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if isinstance(bits, bool) or bits not in _BITS:
                fmt = name.replace("bits", "format")
                raise ValueError(f"`{name}` must be None (full precision), 8, 4, 3 or 2 (8 with {fmt}='e4m3' or "
                                 f"'e5m2' for fp8 codes; a preset name's 16 means None); got {bits!r}.")
        check_positive_int("value_group_size", self.value_group_size)
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"`sink_tokens` must be an int >= 0 (0: no full-precision sink); got {self.sink_tokens!r}.")
        if self.backend not in _BACKENDS:
            raise ValueError(f"`backend` must be one of {', '.join(_BACKENDS)}; got {self.backend!r}.")
        for name in ("rotate_keys", "rotate_values"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False; got {getattr(self, name)!r}.")
        for name in ("key_format", "value_format"):
            fmt, bits = getattr(self, name), getattr(self, name.replace("format", "bits"))
            if fmt not in _FORMATS:
                raise ValueError(f"`{name}` must be one of {', '.join(_FORMATS)}; got {fmt!r}.")
            if fmt != "int" and (bits != 8 or self.backend != "torch"):
                raise ValueError(f"`{name}`={fmt!r} is an 8-bit float: it needs {name.replace('format', 'bits')}=8 "
                                 f"and backend='torch' (got {bits!r}, {self.backend!r}).")
        if self.fp8_scales not in _FP8_SCALES:
            raise ValueError(f"`fp8_scales` must be one of {', '.join(_FP8_SCALES)}; got {self.fp8_scales!r}.")
        if self.value_range_fit is not None and self.value_range_fit not in RANGE_FITS:
            raise ValueError(f"`value_range_fit` must be one of {', '.join(RANGE_FITS)}; got "
                             f"{self.value_range_fit!r}.")
        if self.backend != "torch" and 3 in (self.key_bits, self.value_bits):
            raise ValueError(f"3-bit codes are the torch backend's (got backend={self.backend!r}); use "
                             "backend='torch'.")
        if self.backend == "bitsandbytes" and 2 in (self.key_bits, self.value_bits):
            raise ValueError("backend='bitsandbytes' encodes 8 or 4 bits (blockwise int8, NF4); use backend='torch' "
                             f"for 2 bits (got key_bits={self.key_bits}, value_bits={self.value_bits}).")
        k, v = self.key_bits or 16, self.value_bits or 16
        if k < v and (k, v) not in _warned:
            _warned.add((k, v))
            logger.warning(
                "QuantConfig(key_bits=%s, value_bits=%s) gives keys fewer bits than values. Keys are the fragile "
                "half (outlier channels, and their error is amplified by the softmax); quantize values first. "
                "Fine for an ablation.", self.key_bits, self.value_bits)

    @classmethod
    def preset(cls, name: str, **overrides) -> QuantConfig:
        """A preset along the ladder: `fp`, `v8`, `k8v8`, `k8v4`, `k4v4`, `k4v2`, `k2v2`, or any ``k<b>v<b>`` with
        each `b` 16 (full precision), 8, 4, 3, 2 or an fp8 format (`e4m3`, `e5m2`: 8-bit floats), an ``r``
        suffix for rotated keys, a ``v`` suffix for rotated values (``rv``: both) and a ``b`` suffix for per-block
        fp8 scales: ``"k4v4r"``, ``"k4v4rv"``, ``"k3v3rv"``, ``"k4ve4m3"``.

        Raises:
            ValueError: an unknown name.
        """
        key = str(name).lower()
        match = _PRESET.fullmatch(key)
        if key in PRESETS:
            k, v = PRESETS[key]
            fields = {"key_bits": k, "value_bits": v}
        elif match:
            fields = {"rotate_keys": bool(match.group(3)), "rotate_values": bool(match.group(4)),
                      "fp8_scales": "block" if match.group(5) else "group"}
            for half, b in zip(("key", "value"), match.groups()[:2]):
                fp8 = b.startswith("e")
                fields[f"{half}_bits"] = 8 if fp8 else None if b == "16" else int(b)
                if fp8:
                    fields[f"{half}_format"] = b
        else:
            raise ValueError(f"Unknown quantization preset {name!r}; use one of {', '.join(PRESETS)} "
                             "(or 'k<b>v<b>' with b in 16, 8, 4, 3, 2, e4m3, e5m2, and an 'r' suffix for rotated "
                             "keys, 'v' for rotated values, 'b' for per-block fp8 scales) or a QuantConfig.")
        return cls(**{**fields, **overrides})


    @classmethod
    def resolve(cls, quant: QuantConfig | str | None) -> QuantConfig:
        """`None` or a preset name or a `QuantConfig` -> a `QuantConfig` (full precision for `None`).

        Raises:
            ValueError: not one of those.
        """
        if quant is None:
            return cls()
        if isinstance(quant, QuantConfig):
            return quant
        if isinstance(quant, str):
            return cls.preset(quant)
        raise ValueError(f"`quant` must be None, a preset name such as 'k8v4', or a QuantConfig; got {quant!r}.")

    @property
    def value_fit(self) -> str:
        """The value codes' range fit: `value_range_fit`, or by default ``"lsq"`` for rotated values and
        ``"minmax"`` for the others."""
        if self.value_range_fit is not None:
            return self.value_range_fit
        return "lsq" if self.rotate_values else "minmax"

    @property
    def is_quantized(self) -> bool:
        """Whether keys or values are stored as codes (False for full precision)."""
        return self.key_bits is not None or self.value_bits is not None

    @property
    def name(self) -> str:
        """The preset name such as ``"k8v4"`` or ``"fp"``; otherwise ``k<bits>v<bits>`` with 16 for full precision."""
        bits = (self.key_bits, self.value_bits)
        plain = (self.key_format, self.value_format, self.rotate_keys, self.rotate_values) == ("int", "int", False,
                                                                                               False)
        named = next((name for name, preset in PRESETS.items() if preset == bits), None) if plain else None
        if named is not None:
            return named
        k = self.key_format if self.key_format != "int" else self.key_bits or 16
        v = self.value_format if self.value_format != "int" else self.value_bits or 16
        fp8 = "e" in f"{k}{v}"
        return (f"k{k}v{v}" + ("r" if self.rotate_keys and self.key_bits is not None else "")
                + ("v" if self.rotate_values and self.value_bits is not None else "")
                + ("b" if fp8 and self.fp8_scales == "block" else ""))
