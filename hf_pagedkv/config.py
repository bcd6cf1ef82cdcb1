"""Settings parsing shared by the pool and the cache."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_positive_int(name: str, value: object) -> int:
    """Return `value` if it is a positive `int` (not a `bool`), else raise `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return value


def parse_bytes(value: int | str) -> int:
    """Parse a memory size such as ``"4GiB"``, ``"512 MB"`` or ``1073741824`` into bytes.

    Raises:
        ValueError: if the value is not a positive size with a known unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"`max_memory` must be positive, got {value!r}.")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"`max_memory` must be bytes (int) or a size like '4GiB' or '512MB', got {value!r}.")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"`max_memory` must be positive, got {value!r}.")
    return size
