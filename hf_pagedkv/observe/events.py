"""The block event log: structured records of what happens to each block, a bounded trace, a JSONL dump.

Each `BlockPool` owns an `EventLog` (``pool.events``), off by default: a disabled hook is one attribute check.
`pool.events.enable()` (or the environment variable ``HF_PAGEDKV_EVENTS=<sample rate>`` when the pool is created)
turns it on. Every record goes to the bounded in-memory trace and, when the logger ``hf_pagedkv.observe.events`` is enabled
for DEBUG, to that logger with the record in ``extra={"event": record}``. `dump(path)` writes the trace as JSON
lines; `hf-pagedkv trace FILE` (`trace.py`) reads it back.

A record is a dict: ``n`` (event number), ``t`` (``time.time()`` seconds), ``kind``, ``blocks`` (block ids), and
where known ``seq`` (the cache's owner id in its pool), ``row`` (batch row), ``start``/``end`` (the row's length
in tokens before/after), ``src``/``dst`` (copy-on-write pairs), ``refcounts``. Kinds, and their effect on each
listed block's refcount:

| kind | emitted by | refcount |
| --- | --- | --- |
| ``allocate`` | `BlockGroup.allocate` | 0 -> 1 |
| ``fork`` | `BlockGroup.incref` (fork, beam reorder, shared duplicate rows) | +1 |
| ``free`` | `BlockGroup.free` (before the decrement, so a double free is recorded even if it raises) | -1 |
| ``hit`` | prefix caching: a cache attached to cached blocks | +1 |
| ``append`` | a forward step: row `row` of `seq` grew from `start` to `end` tokens into these new blocks | - |
| ``cow`` | a forward step: shared last blocks `src` copied to `dst` before a write | - |
| ``publish`` | prefix caching: full blocks entered the prefix index | - |
| ``evict`` | prefix caching: idle cached blocks reclaimed (refcount must be 0) | - |
| ``state`` | `enable()`: the refcounts of the blocks in use at that moment | set |

Sampling is by block id, not by event (a deterministic hash keeps a fraction `sample_rate` of the ids), so every
sampled block keeps its complete history and the leak / double-free analysis stays exact for it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hf_pagedkv.blocks.block_table import num_blocks_for

if TYPE_CHECKING:
    from hf_pagedkv.observe.pool_view import ObservedPool

logger = logging.getLogger(__name__)

#: Every event kind and its refcount change for the blocks it lists (None: no change; "set": absolute values).
EVENT_KINDS: dict[str, int | str | None] = {
    "allocate": 1, "fork": 1, "free": -1, "hit": 1,
    "append": None, "cow": None, "publish": None, "evict": None, "state": "set",
}
ENV_VAR = "HF_PAGEDKV_EVENTS"
_HASH_MUL = 2654435761  # Knuth's multiplicative hash, to spread consecutive block ids across the sample


class EventLog:
    """Structured block events of one pool, sampled by block id, kept in a bounded trace.

    Invariants: when disabled, hooks return at once and record nothing; the trace holds at most `capacity`
    records (the oldest are dropped and counted in `num_dropped`); `n` numbers records in emission order.

    Args:
        pool (`BlockPool`): the pool observed (a weak reference; used for the ``state`` record of `enable`).

    Raises:
        ValueError: the environment variable ``HF_PAGEDKV_EVENTS`` is set to something other than a sample rate
            in (0, 1].

    Example:

    ```python
    >>> pool = BlockPool(block_size=16)
    >>> pool.events.enable(sample_rate=1.0)
    >>> out = model.generate(input_ids, past_key_values=PagedCache(pool=pool), max_new_tokens=8)
    >>> pool.events.dump("trace.jsonl")       # then: hf-pagedkv trace trace.jsonl
    ```
    """

    def __init__(self, pool: ObservedPool) -> None:
        self._pool = weakref.ref(pool)
        self.block_size = pool.block_size  # tokens per block; fixed
        self.enabled = False  # record events; changed by enable()/disable() only
        self.sample_rate = 1.0  # fraction of block ids recorded
        self._cutoff = 1 << 32  # a block is sampled iff hash(block) < cutoff
        self._trace: deque[dict] = deque(maxlen=100_000)  # the bounded in-memory trace
        self._lock = threading.Lock()  # guards the trace and the counters
        self.num_events = 0  # records emitted since creation (numbers the next one)
        self.num_dropped = 0  # records pushed out of the full trace
        env = os.environ.get(ENV_VAR)
        if env:
            try:
                rate = float(env)
            except ValueError:
                rate = -1.0
            if not 0 < rate <= 1:
                raise ValueError(f"{ENV_VAR}={env!r}: set it to a sample rate in (0, 1], e.g. 1 or 0.1.")
            self.enable(sample_rate=rate)

    # -- configuration ---------------------------------------------------------------------------------------------
    def enable(self, sample_rate: float = 1.0, capacity: int = 100_000) -> None:
        """Start recording and write a ``state`` record of the blocks in use now (so a trace started mid-run
        still has exact refcounts).

        Args:
            sample_rate (`float`, *optional*, defaults to 1.0): fraction of block ids recorded, in (0, 1].
            capacity (`int`, *optional*, defaults to 100000): records the in-memory trace keeps.

        Raises:
            ValueError: `sample_rate` not in (0, 1], or `capacity` not a positive int.
        """
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be a number in (0, 1], got {sample_rate!r}.")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"`capacity` must be a positive int, got {capacity!r}.")
        with self._lock:
            self.sample_rate = float(sample_rate)
            self._cutoff = int(sample_rate * (1 << 32))
            if capacity != self._trace.maxlen:
                self._trace = deque(self._trace, maxlen=capacity)
            self.enabled = True
        pool = self._pool()
        if pool is not None:
            with pool.lock:
                group = pool.groups[0]
                used = [b for b in range(group.num_blocks) if group.refcount(b) > 0 and self._sampled(b)]
                self.emit("state", used, refcounts=[group.refcount(b) for b in used])

    def disable(self) -> None:
        """Stop recording (the trace is kept)."""
        self.enabled = False

    # -- hooks ------------------------------------------------------------------------------------------------------
    def emit(self, kind: str, blocks: Iterable[int], **fields) -> None:
        """Record one event about `blocks` (nothing when disabled, or when no listed block is sampled).

        Args:
            kind (`str`): one of `EVENT_KINDS`.
            blocks (iterable of `int`): the block ids concerned.
            **fields: extra JSON-serialisable fields (``seq``, ``row``, ``start``, ``end``, ...); None values are
                left out.

        Raises:
            ValueError: an unknown `kind`.
        """
        if not self.enabled:
            return
        if kind not in EVENT_KINDS:
            raise ValueError(f"Unknown block event kind {kind!r}; known: {sorted(EVENT_KINDS)}.")
        blocks = [b for b in blocks if self._sampled(b)]
        if not blocks and kind != "state":
            return
        record = {"kind": kind, "blocks": blocks, **{k: v for k, v in fields.items() if v is not None}}
        with self._lock:
            record = {"n": self.num_events, "t": time.time(), **record}
            self.num_events += 1
            if len(self._trace) == self._trace.maxlen:
                self.num_dropped += 1
            self._trace.append(record)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", json.dumps(record), extra={"event": record})

    def on_step(self, seq, plan, rows) -> None:
        """A forward step of cache `seq` extended its rows (`plan.start` -> `plan.end` tokens, a `StepPlan`):
        record the new blocks of each written row (``append``, from `rows`, the first layer group's block tables)
        and the copy-on-write pairs (``cow``)."""
        if not self.enabled:
            return
        first, last = num_blocks_for(plan.start, self.block_size), num_blocks_for(plan.end, self.block_size)
        if plan.cow_src:
            self.emit("cow", list(plan.cow_dst), seq=seq, rows=list(plan.cow_rows), src=list(plan.cow_src),
                      dst=list(plan.cow_dst), start=plan.start)
        if last > first:
            for r in plan.writers:
                self.emit("append", rows[r].after(first)[: last - first], seq=seq, row=r, start=plan.start,
                          end=plan.end)

    def _sampled(self, block: int) -> bool:
        return self._cutoff > (1 << 32) - 1 or (block * _HASH_MUL) & 0xFFFFFFFF < self._cutoff

    # -- reading ----------------------------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """A copy of the trace, oldest first."""
        with self._lock:
            return list(self._trace)

    def take_events(self) -> list[dict]:
        """The trace, oldest first, and empty it."""
        with self._lock:
            out = list(self._trace)
            self._trace.clear()
            return out

    def header(self) -> dict:
        """The first line of a dump: what the analysis needs to know about the trace."""
        return {"kind": "header", "version": 1, "block_size": self.block_size, "sample_rate": self.sample_rate,
                "num_events": self.num_events, "num_dropped": self.num_dropped, "t": time.time()}

    def dump(self, path: str | os.PathLike) -> int:
        """Write the header and the trace to `path` as JSON lines; return the number of event records written."""
        records = self.events()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(self.header()) + "\n")
            fh.writelines(json.dumps(record) + "\n" for record in records)
        logger.info("Wrote %d block events to %s", len(records), path)
        return len(records)
