"""`EngineLoop`: the background thread that steps an `Engine` (`Engine.start` / `Engine.stop`)."""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class EngineLoop:
    """Calls `step` in a daemon thread while there is work, and sleeps on `cond` while there is none.

    Invariants: at most one thread runs the loop; the loop ends only after `stop` asked it to (at the end of the
    step it is in), never on its own; a step that raises an `Exception` (an engine fault outside a forward, which
    `step` does not catch) calls `on_fault` and the loop goes on.

    Args:
        step (`Callable[[], int]`): one engine step; returns the tokens it computed (0: nothing could run).
        has_work (`Callable[[], bool]`): whether a request waits or runs; called with `cond` held.
        on_fault (`Callable[[], None]`): called after `step` raised an `Exception`, to fail what runs (rather than
            step it again forever).
        cond (`threading.Condition`): the engine's condition, notified when requests arrive or change.
    """

    def __init__(self, step: Callable[[], int], has_work: Callable[[], bool], on_fault: Callable[[], None],
                 cond: threading.Condition) -> None:
        self._step = step  # fixed
        self._has_work = has_work  # fixed
        self._on_fault = on_fault  # fixed
        self._cond = cond  # fixed
        self._thread: threading.Thread | None = None  # the running thread; start / stop only
        self._stopping = False  # asks the thread to end; start / stop only, under `cond`

    @property
    def is_started(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (a no-op while it runs)."""
        with self._cond:
            if self.is_started:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="hf_pagedkv-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end after its current step and wait for it (at most `timeout` seconds)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                computed = self._step()
            except Exception:
                logger.exception("Engine loop: a step failed outside the model's forward")
                self._on_fault()
                computed = 0
            if not computed:
                with self._cond:
                    self._cond.wait(0.01)


__all__ = ["EngineLoop"]
