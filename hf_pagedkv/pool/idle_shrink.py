"""`IdleShrink`: a growable pool gives its free storage back by itself once it has been idle for a while."""

from __future__ import annotations

import logging
import threading
import time
import weakref

logger = logging.getLogger("hf_pagedkv")


class IdleShrink:
    """Calls `pool.shrink()` from a daemon timer thread once `seconds` have passed without an allocation
    (`BlockPool(shrink_after=seconds)`).

    Why: a burst grows a pool; when the burst is over its free trailing segments stay reserved until someone calls
    `shrink()`. With `shrink_after`, the pool returns them itself. Only `shrink` runs on the timer: it drops
    storage segments that hold no live block, under the pool's lock, so it is safe while other threads decode.
    (`compact`, which moves live blocks, is never called from here: it must run between forward steps.)

    State: `seconds` (fixed), `last_active` (monotonic time of the last `touch`), `_timer` (the armed timer or
    None). The timer holds the pool only weakly, so an armed timer never keeps a pool alive. The block ids a pool
    hands out after a shrink may differ from those it would have without one, so ranks of a tensor-parallel run,
    which must keep identical block tables, should not use it.
    """

    def __init__(self, pool, seconds: float) -> None:
        self.seconds = seconds  # idle time before a shrink; fixed
        self.last_active = time.monotonic()  # of the last allocation; set by touch
        self.num_shrinks = 0  # shrinks that returned bytes; counted by _fire
        self._pool = weakref.ref(pool)
        self._timer: threading.Timer | None = None  # armed by arm, cleared when it fires

    def touch(self) -> None:
        """The pool allocated: the idle time starts again."""
        self.last_active = time.monotonic()

    def arm(self) -> None:
        """Blocks were freed: make sure a timer will look at the pool once it has been idle for `seconds`."""
        if self._timer is None:
            self._start(self.seconds)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start(self, delay: float) -> None:
        self._timer = threading.Timer(delay, IdleShrink._fire, args=(weakref.ref(self),))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _fire(ref: weakref.ref) -> None:
        self = ref()
        pool = None if self is None else self._pool()
        if pool is None:
            return
        with pool.lock:
            self._timer = None
            left = self.last_active + self.seconds - time.monotonic()
            if left > 0:  # allocated meanwhile: look again when the idle time would be over
                self._start(left)
                return
            returned = pool.shrink()
        if returned:
            self.num_shrinks += 1
            logger.debug("BlockPool idle for %.1f s: shrink returned %d bytes", self.seconds, returned)
