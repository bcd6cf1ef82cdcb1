"""Reading a block event dump (see `events.py`): leaks, double frees and one block's refcount history.

The analysis replays the refcount changes of each block in event order::

    #3 allocate 0 -> 1     #9 fork 1 -> 2     #14 free 2 -> 1     #20 free 1 -> 0     #31 free 0 -> ?  double free

A trace started by `EventLog.enable()` opens with a ``state`` record of the blocks in use at that moment, so every
block's starting refcount is known. If the in-memory trace overflowed (``num_dropped > 0`` in the header), blocks
first seen mid-history start as unknown and are left out of the leak and double-free counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from hf_pagedkv.errors import counted
from hf_pagedkv.observe.events import EVENT_KINDS


@dataclass(frozen=True)
class HistoryLine:
    """One event in a block's history, with its refcount before and after (None: unknown)."""

    block: int
    n: int  # event number
    t: float  # time.time() of the event
    kind: str
    before: int | None
    after: int | None
    record: dict  # the whole record (seq, row, start, end, ...)


@dataclass
class TraceReport:
    """What `analyze` found. `never_freed` maps each block still referenced at the end to its refcount."""

    num_events: int
    sample_rate: float
    num_dropped: int  # records the in-memory trace dropped before the dump
    never_freed: dict[int, int] = field(default_factory=dict)
    double_frees: list[HistoryLine] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)  # fork of a free block, eviction of a block in use, ...
    histories: dict[int, list[HistoryLine]] = field(default_factory=dict)  # block -> its events, in order

    @property
    def ok(self) -> bool:
        """No leak, no double free, no other anomaly."""
        return not (self.never_freed or self.double_frees or self.anomalies)


def read_trace(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """Read a JSONL dump written by `EventLog.dump`: ``(header, records)``.

    Raises:
        ValueError: a line that is not JSON, or a record without ``n``, ``kind`` or ``blocks`` (with its line
            number), or an unknown event kind.
    """
    header: dict = {}
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not a JSON line ({e.msg}); expected a dump of EventLog.dump()"
                ) from e
            if record.get("kind") == "header":
                header = record
                continue
            missing = [k for k in ("n", "kind", "blocks") if k not in record]
            if missing:
                raise ValueError(f"{path}:{lineno}: block event without {missing}: {line.strip()[:120]}")
            if record["kind"] not in EVENT_KINDS:
                raise ValueError(
                    f"{path}:{lineno}: unknown event kind {record['kind']!r}; known: {sorted(EVENT_KINDS)}"
                )
            records.append(record)
    return header, records


def analyze(records: list[dict], header: dict | None = None) -> TraceReport:
    """Replay the refcount changes of every block (see the module docstring).

    Args:
        records (`list[dict]`): event records, as `EventLog.events()` returns them or `read_trace` reads them.
        header (`dict`, *optional*): the dump's header (sample rate, dropped records).
    """
    header = header or {}
    records = sorted(records, key=lambda r: r["n"])
    report = TraceReport(len(records), float(header.get("sample_rate", 1.0)), int(header.get("num_dropped", 0)))
    # Every block starts at refcount 0 when the trace begins with the `state` record of `enable()` and nothing was
    # dropped; otherwise a block is unknown until its first `allocate` or `state`.
    baseline_known = bool(records) and records[0]["kind"] == "state" and report.num_dropped == 0
    rc: dict[int, int | None] = {}
    for record in records:
        kind, delta = record["kind"], EVENT_KINDS[record["kind"]]
        for i, b in enumerate(record["blocks"]):
            before = rc.get(b, 0 if baseline_known else None)
            if delta == "set":  # a state record: the refcount is given, not derived
                before = None
                after = (record.get("refcounts") or [None] * len(record["blocks"]))[i]
            elif kind == "allocate":
                if before:
                    report.anomalies.append(f"#{record['n']}: block {b} allocated while in use (refcount {before})")
                after = 1
            elif delta is None:
                after = before
                if kind == "evict" and before:
                    report.anomalies.append(f"#{record['n']}: block {b} evicted while in use (refcount {before})")
            elif before is None:
                after = None
            elif kind == "free" and before == 0:
                after = 0
            else:
                if before == 0 and kind == "fork":
                    report.anomalies.append(f"#{record['n']}: block {b} forked while free")
                after = before + delta
            line = HistoryLine(b, record["n"], record.get("t", 0.0), kind, before, after, record)
            if kind == "free" and before == 0:
                report.double_frees.append(line)
            rc[b] = after
            report.histories.setdefault(b, []).append(line)
    report.never_freed = {b: c for b, c in sorted(rc.items()) if c}
    return report


def format_report(report: TraceReport, block: int | None = None, limit: int = 20) -> str:
    """A readable report: counts, the blocks never freed and the double frees (up to `limit` each), and the
    refcount history of `block` when given."""
    t0 = min((h[0].t for h in report.histories.values()), default=0.0)
    dropped = f", {report.num_dropped} oldest dropped" if report.num_dropped else ""
    out = [f"trace: {counted(report.num_events, 'event')} on {counted(len(report.histories), 'block')} (sample rate "
           f"{report.sample_rate:g})"
           + dropped]
    out.append(f"blocks allocated and never freed: {len(report.never_freed)}")
    for b, c in list(report.never_freed.items())[:limit]:
        owner = _last_owner(report.histories[b])
        out.append(f"  block {b}: refcount {c}{owner}")
    out.append(f"double frees: {len(report.double_frees)}")
    for line in report.double_frees[:limit]:
        out.append(f"  #{line.n} +{line.t - t0:.6f}s block {line.block}: freed at refcount 0"
                   f"{_last_owner(report.histories[line.block])}")
    if report.anomalies:
        out.append(f"other anomalies: {len(report.anomalies)}")
        out.extend(f"  {a}" for a in report.anomalies[:limit])
    if block is not None:
        history = report.histories.get(block)
        if not history:
            out.append(f"block {block}: no events (not used, or not sampled at rate {report.sample_rate:g})")
        else:
            out.append(f"block {block} refcount history ({len(history)} events):")
            out.extend(f"  #{h.n} +{h.t - t0:.6f}s {h.kind:<8} {_rc(h.before)} -> {_rc(h.after)}{_details(h.record)}"
                       for h in history)
    return "\n".join(out)


def _rc(value: int | None) -> str:
    return "?" if value is None else str(value)


def _details(record: dict) -> str:
    parts = [f"{k}={record[k]}" for k in ("seq", "row", "rows") if k in record]
    if "start" in record and "end" in record:
        parts.append(f"tokens {record['start']}->{record['end']}")
    if "src" in record:
        parts.append(f"copied {record['src']} -> {record['dst']}")
    return ("  " + " ".join(parts)) if parts else ""


def _last_owner(history: list[HistoryLine]) -> str:
    """`(seq S row R, N tokens)` of the last event of a block that names its sequence, or ''."""
    for h in reversed(history):
        if "seq" in h.record:
            row = f" row {h.record['row']}" if "row" in h.record else ""
            tokens = f", {counted(h.record['end'], 'token')}" if "end" in h.record else ""
            return f" (last seen in seq {h.record['seq']}{row}{tokens})"
    return ""

