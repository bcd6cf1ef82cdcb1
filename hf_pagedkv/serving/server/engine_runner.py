"""`EngineRunner`: steps an `Engine` in a thread of its own and hands each request's new tokens to the caller's
sink after every step, without a thread per request.

NOTE: the engine's own background loop (`Engine.start`) only wakes threads blocked in `Engine.stream`, one per
request; an HTTP server holds many requests on one event loop, so this runner steps the engine itself (`step()`,
which the engine allows from any one thread) and, after each step, reads every tracked request's output and
passes what is new to that request's sink. A sink must be cheap and thread-safe (the server's puts the event on
an asyncio queue with `call_soon_threadsafe`).

The runner's thread steps under `torch.inference_mode()` (no autograd bookkeeping: less CPU per step than
`torch.no_grad()` with the same tokens, docs/serving_http.md); so does every other call of the runner that can write the
pool's or a cache's tensors (`cancel`, `close`), since a tensor made in inference mode may only be written in inference
mode.

Waiting requests: `num_waiting` counts tracked requests the engine has not admitted yet (PENDING at the last step,
and those submitted since); `submit` refuses new work past `max_queue` of them (`QueueFull`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from hf_pagedkv.errors import counted
from hf_pagedkv.serving.engine import Engine
from hf_pagedkv.serving.request import RequestOutput, RequestStatus

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """`submit` past `max_queue` waiting requests."""


@dataclass(frozen=True)
class TokenEvent:
    """What a sink receives: new tokens of one request, and its final output once it has ended."""

    request_id: str
    tokens: list[int]  # generated since the last event
    output: RequestOutput | None = None  # set on the request's last event: status, finish reason, error, times


@dataclass
class _Tracked:
    sink: Callable[[TokenEvent], None]  # fixed
    sent: int = 0  # generated tokens handed to the sink
    waiting: bool = True  # not admitted by the engine yet (as of the last step)


class EngineRunner:
    """Steps `engine` in a daemon thread while it has work; sinks get every tracked request's tokens.

    Invariants: a request is tracked from `submit` until its terminal event was handed to its sink (then the
    engine forgets it: `pop_output`); `num_waiting` <= tracked requests.

    Args:
        engine (`Engine`): the engine (not started: this runner steps it).
        max_queue (`int`, *optional*): waiting requests at most; None for no limit.
    """

    def __init__(self, engine: Engine, max_queue: int | None = None) -> None:
        self.engine = engine  # fixed
        self.max_queue = max_queue  # fixed
        self._lock = threading.Lock()  # guards `_tracked`, `_dirty` and `_stopping` (taken before the engine's)
        self._wake = threading.Condition(self._lock)  # notified on submit, cancel and stop
        self._tracked: dict[str, _Tracked] = {}  # request id -> its sink and progress; submit / dispatch only
        self._dirty = False  # a request ended outside a step (cancelled while waiting): dispatch without stepping
        self._stopping = False  # asks the loop to end; start / stop only
        self._thread: threading.Thread | None = None
        self.num_faults = 0  # steps that raised outside the model's forward (their running requests cancelled)

    # -- requests ---------------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        with self._lock:
            return sum(t.waiting for t in self._tracked.values())

    @property
    def num_tracked(self) -> int:
        """Requests submitted and not ended (or whose end was not handed to their sink yet)."""
        with self._lock:
            return len(self._tracked)

    def check_room(self, n: int) -> None:
        """Raise `QueueFull` if `n` more waiting requests would pass `max_queue`."""
        if self.max_queue is not None and self.num_waiting + n > self.max_queue:
            raise QueueFull(f"{counted(self.num_waiting, 'request')} waiting for the engine (--max-queue "
                            f"{self.max_queue}); retry later.")

    def submit(self, input_ids: list[int], sink: Callable[[TokenEvent], None], **kwargs) -> str:
        """`Engine.add_request(input_ids, **kwargs)`, tracked: `sink` gets its tokens. Raises `ValueError` as
        `add_request` does (nothing tracked then)."""
        with self._lock:
            rid = self.engine.add_request(input_ids, **kwargs)
            self._tracked[rid] = _Tracked(sink)
            self._wake.notify_all()
        return rid

    def cancel(self, request_id: str) -> None:
        """Cancel a tracked request (its blocks are freed at the end of the current step at the latest); its sink
        still gets the terminal event. Unknown or ended requests are ignored."""
        with self._lock:
            if request_id not in self._tracked:
                return
            try:
                with torch.inference_mode():  # it may free the request's blocks here (not computing in a step)
                    self.engine.cancel(request_id)
            except KeyError:
                return
            self._dirty = True
            self._wake.notify_all()

    # -- the loop -----------------------------------------------------------------------------------------------------
    @property
    def is_started(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._lock:
            if self.is_started:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="hf_pagedkv-server-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the loop after its current step; tracked requests stay (`start` goes on with them)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop, cancel every unfinished request (freeing its blocks) and hand each sink its terminal event."""
        self.stop()
        with torch.inference_mode():
            self.engine.close()
        self.dispatch()

    def _loop(self) -> None:
        with torch.inference_mode():
            self._steps()

    def _steps(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._dirty or self.engine.has_unfinished):
                    self._wake.wait()
                if self._stopping:
                    return
                self._dirty = False
            computed = 0
            if self.engine.has_unfinished:
                try:
                    computed = self.engine.step()
                except Exception:  # a fault outside the forward: cancel what runs rather than spin on it
                    logger.exception("hf_pagedkv server: an engine step failed outside the model's forward")
                    self.num_faults += 1
                    with self._lock:
                        for rid in list(self._tracked):
                            self.engine.cancel(rid)
            self.dispatch()
            if not computed and self.engine.has_unfinished:
                with self._wake:  # nothing could run (waiting for room): do not spin
                    self._wake.wait(0.01)

    def dispatch(self) -> None:
        """Hand each tracked request's new tokens (and its end) to its sink."""
        with self._lock:
            for rid, t in list(self._tracked.items()):
                out = self.engine.output(rid)
                t.waiting = out.status == RequestStatus.PENDING
                new = out.generated_tokens[t.sent:]
                done = out.is_finished()
                if done:
                    self.engine.pop_output(rid)
                    del self._tracked[rid]
                if new or done:
                    t.sent += len(new)
                    try:
                        t.sink(TokenEvent(rid, new, out if done else None))
                    except Exception:  # a sink whose consumer is gone (its event loop closed)
                        logger.debug("hf_pagedkv server: the sink of %s failed", rid, exc_info=True)


__all__ = ["EngineRunner", "QueueFull", "TokenEvent"]
