"""Giving freed CPU memory back to the system after a large step (glibc's `malloc_trim`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# NOTE: a step of fewer tokens frees too little to be worth a walk over the heap.
TRIM_MIN_TOKENS = 256


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the free pages of the C heap to the system; whether it could (False without glibc).

    Why: a long prefill frees hundreds of MiB of temporaries (projections, de-quantized K/V, attention tiles), and
    glibc keeps the heap pages between live allocations resident. After a quantized 4096-token `generate` the
    process held ~400 MiB more than the pool (`benchmarks/memory.py`); `malloc_trim(0)` hands back every free page,
    wherever it lies, at the cost of one walk over the heap (about a millisecond). Nothing live moves.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def trim_after_step(num_tokens: int, device: torch.device) -> bool:
    """`trim_heap` after a layer wrote a step of `num_tokens` tokens on `device` (a row's, the longest of a packed
    step's): only on the CPU, and only for steps of at least `TRIM_MIN_TOKENS`; whether it trimmed."""
    return num_tokens >= TRIM_MIN_TOKENS and device.type == "cpu" and trim_heap()


__all__ = ["TRIM_MIN_TOKENS", "trim_after_step", "trim_heap"]
