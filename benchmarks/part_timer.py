"""`PartTimer`: the time spent inside chosen functions, per part, by wrapping them (no profiler, which slows every
Python call and skews Python-heavy paths); used by `batch_overhead.py --profile` and `step_parts.py`."""

from __future__ import annotations

import time
from typing import Callable


class PartTimer:
    """Accumulates, per part name, the `clock` seconds spent in the functions it wrapped, while `on` is true. Parts
    nest: a part's time includes the parts called inside it. A wrapper costs about a microsecond per call.

    Args:
        clock (`Callable[[], float]`, defaults to `time.perf_counter`): wall time; `time.process_time` for CPU time.
        on (`bool`, defaults to `True`): whether calls are counted (a script may count only its timed steps).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, on: bool = True) -> None:
        self.clock = clock
        self.on = on
        self.seconds: dict[str, float] = {}  # part -> seconds counted since the last `clear`

    def timed(self, fn: Callable, part: str) -> Callable:
        """`fn`, wrapped so that its calls count towards `part`."""
        def wrapper(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[part] = self.seconds.get(part, 0.0) + self.clock() - t0
        return wrapper

    def patch(self, owner, name: str, part: str) -> None:
        """Replace the attribute `name` of `owner` (a class or module) by its `timed` wrapper."""
        setattr(owner, name, self.timed(getattr(owner, name), part))

    def clear(self) -> None:
        self.seconds.clear()


__all__ = ["PartTimer"]
