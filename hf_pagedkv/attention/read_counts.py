"""`ReadCounts`: which path served each in-place read of the ``"hf_pagedkv"`` attention, per storage format, and
every fallback from a kernel to the torch read, with its reason (no silent fallback)."""

from __future__ import annotations

import logging
import weakref
from collections import Counter

logger = logging.getLogger(__name__)

#: the paths that serve a read: the C / Triton kernel following block ids, the C or `torch.compile`d read of a
#: gathered `CodeRead`, torch over codes (`code_attention`), torch over de-quantized chunks, full-precision pools
PATHS = ("kernel-table", "kernel-codes", "torch-codes", "torch-chunks", "fp")


#: key codec -> (value codec, format name): `format_name` runs per layer and step
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def format_name(codecs) -> str:
    """A storage format as ``"<key codec>/<value codec>"`` (``"int4+rot/int4"``, ``"int8/fp8-e4m3"``)."""
    known = _NAMES.get(codecs[0])
    if known is not None and known[0] is codecs[1]:
        return known[1]
    names = []
    for c in codecs:
        inner = c.inner
        if inner.name == "fp8":
            name = f"fp8-{inner.fmt}" + ("-block" if inner.per_block else "")
        elif inner.name in ("reference", "bitsandbytes"):
            name = f"{inner.name}-{inner.bits}"
        else:
            name = inner.name
        names.append(name + ("+rot" if c.rotated else ""))
    _NAMES[codecs[0]] = (codecs[1], "/".join(names))
    return _NAMES[codecs[0]][1]


class ReadCounts:
    """Counters of the in-place reads of one process.

    - `served[(path, format)]`: reads each path (`PATHS`) served, per storage format (`format_name`; ``"fp"`` for
      full-precision pools).
    - `fallbacks[(format, reason)]`: quantized reads a kernel was offered but declined, read by torch instead
      (`code_attention`, which reads every codec: affine ones in their folded form, the others decoded tile by
      tile). The first fallback of each (format, reason) is logged as a warning.

    Reset with `reset()`; read with `snapshot()`.
    """

    def __init__(self) -> None:
        self.served: Counter = Counter()  # (path, format) -> reads; changed by `serve` / `reset` only
        self.fallbacks: Counter = Counter()  # (format, reason) -> reads; changed by `fall_back` / `reset` only

    def serve(self, path: str, fmt: str) -> None:
        assert path in PATHS, path
        self.served[(path, fmt)] += 1

    def fall_back(self, fmt: str, reason: str) -> None:
        key = (fmt, reason)
        if key not in self.fallbacks:
            logger.warning("hf_pagedkv attention: the kernels do not read %s KV (%s); reading it with torch "
                           "(code_attention). Counted in hf_pagedkv.attention.READ_COUNTS.", fmt, reason)
        self.fallbacks[key] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"served": {"path format": n}, "fallbacks": {"format: reason": n}}``."""
        return {"served": {f"{p} {f}": n for (p, f), n in sorted(self.served.items())},
                "fallbacks": {f"{f}: {r}": n for (f, r), n in sorted(self.fallbacks.items())}}

    def reset(self) -> None:
        self.served.clear()
        self.fallbacks.clear()


#: the process's counters (every layer and cache)
READ_COUNTS = ReadCounts()

__all__ = ["PATHS", "READ_COUNTS", "ReadCounts", "format_name"]
