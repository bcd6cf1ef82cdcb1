"""`GroupQuant`: the storage format of each kind of layer group of a pool (sliding-window groups, full-attention
groups), from `BlockPool(quant=...)`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hf_pagedkv.config import QuantConfig

KINDS = ("sliding", "full")  # the keys of a per-group `quant=` dict


@dataclass(frozen=True)
class GroupQuant:
    """One `QuantConfig` per kind of layer group: `sliding` for every sliding-window group, `full` for every
    full-attention group (retention tiers of full attention included).

    A sliding-window group holds only its window (a few blocks per sequence), so keeping it in full precision costs
    little while the full-attention groups, which grow with the context, are quantized (as vLLM's
    `kv_cache_dtype_skip_layers` keeps chosen layers unquantized). Build it with `GroupQuant.resolve`, which takes
    what `BlockPool(quant=...)` takes.

    Args:
        sliding (`QuantConfig`): the format of sliding-window groups.
        full (`QuantConfig`): the format of full-attention groups.
    """

    sliding: QuantConfig  # format of every sliding-window group
    full: QuantConfig  # format of every full-attention group

    @classmethod
    def resolve(cls, quant) -> GroupQuant:
        """What `BlockPool(quant=...)` accepts -> a `GroupQuant`.

        `quant` is one format for every group (`None` or ``"fp"``: full precision, a preset name such as ``"k4v4"``,
        or a `QuantConfig`), or a dict giving each kind its own: ``{"sliding": None, "full": "k4v4"}``. A kind the
        dict leaves out is stored in full precision.

        Raises:
            ValueError: a dict key other than "sliding" and "full", or a value (or a single `quant`) that is not
                None, a preset name or a `QuantConfig`; the message names the key and what is accepted.
        """
        if isinstance(quant, GroupQuant):
            return quant
        if not isinstance(quant, dict):
            one = QuantConfig.resolve(quant)
            return cls(one, one)
        unknown = [k for k in quant if k not in KINDS]
        if "layers" in unknown:
            raise ValueError(f"quant={quant!r}: per-layer formats ('layers') are not supported (a layer with its own "
                             "format would need a layer group of its own); give each kind of layer group its format "
                             f"with the keys {', '.join(repr(k) for k in KINDS)}.")
        if unknown:
            raise ValueError(f"quant={quant!r}: unknown layer-group key {unknown[0]!r}; the keys are "
                             f"{', '.join(repr(k) for k in KINDS)} (a kind left out is stored in full precision).")
        formats = {}
        for kind in KINDS:
            try:
                formats[kind] = QuantConfig.resolve(quant.get(kind))
            except ValueError as e:
                raise ValueError(f"quant[{kind!r}]={quant.get(kind)!r}: give None (full precision), a preset name "
                                 f"such as 'k4v4', or a QuantConfig ({e})") from None
        return cls(**formats)

    def for_window(self, window: int | None) -> QuantConfig:
        """The format of the layer group with this sliding window (`None`: full attention)."""
        return self.full if window is None else self.sliding

    @property
    def uniform(self) -> QuantConfig | None:
        """The one format of every group, or None when the kinds differ."""
        return self.full if self.full == self.sliding else None

    @property
    def pool_quant(self) -> QuantConfig | GroupQuant:
        """What `BlockPool.quant` shows: the `QuantConfig` every group shares, else this `GroupQuant`."""
        return self.uniform or self

    @property
    def is_quantized(self) -> bool:
        """Whether any kind of group stores codes (a quantized pool's default block size applies then)."""
        return self.full.is_quantized or self.sliding.is_quantized

    @property
    def name(self) -> str:
        """``"fp"``, ``"k4v4"`` when uniform; ``"sliding=fp,full=k4v4"`` otherwise."""
        return self.uniform.name if self.uniform is not None else f"sliding={self.sliding.name},full={self.full.name}"

    def to_fields(self) -> dict:
        """``{"sliding": fields or None, "full": fields or None}`` (None: full precision), for a prefix file's index;
        `resolve` of `{kind: QuantConfig(**fields)}` gives this back."""
        return {kind: dataclasses.asdict(q) if q.is_quantized else None
                for kind, q in (("sliding", self.sliding), ("full", self.full))}

    @classmethod
    def from_fields(cls, fields: dict) -> GroupQuant:
        """The inverse of `to_fields`.

        Raises:
            ValueError: fields `QuantConfig` does not take.
        """
        try:
            return cls.resolve({k: QuantConfig(**v) if v else None for k, v in fields.items()})
        except TypeError as e:
            raise ValueError(f"unreadable quantization fields {fields!r} ({e})") from None
